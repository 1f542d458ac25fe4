"""Utils/settings.py: one declaration per setting, flags generated from it, recipes and their precedence."""
import json
from types import SimpleNamespace

import pytest

import Infer
import Math
from Models.ModelArgs import ModelArgs, parse_layer_span
from Utils.settings import RECIPES, GenerationArgs, TrainArgs, add_arguments, given, recipe_values, setting_fields


def flags(parser):
    return {a.dest for a in parser._actions}


def test_flags_come_from_the_declarations():
    math_flags, infer_flags = flags(Math.get_args_parser()), flags(Infer.get_args_parser())
    model_settings = {f.name for f in setting_fields(ModelArgs)}
    assert {"lora_rank", "lora_alpha", "variant", "max_seq_len", "gamma_grad"} <= model_settings
    # Infer.py sizes max_seq_len itself and trains nothing to recompute
    assert model_settings <= math_flags and model_settings - {"max_seq_len", "recompute"} <= infer_flags
    assert "recompute" not in infer_flags
    assert {f.name for f in setting_fields(TrainArgs)} <= math_flags
    assert {f.name for f in setting_fields(GenerationArgs)} <= infer_flags
    # Meta's params.json fields are the checkpoint's, never flags
    assert not {"dim", "n_layers", "vocab_size"} & (math_flags | infer_flags)


def test_unset_flags_stay_out_and_bools_toggle():
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser, ModelArgs)
    assert given(parser.parse_args([]), ModelArgs) == {}
    ns = parser.parse_args(["--lora_rank", "4", "--hydra_moe", "--no-const_threshold"])
    assert given(ns, ModelArgs) == {"lora_rank": 4, "hydra_moe": True, "const_threshold": False}


def test_paper_recipes():
    for recipe in ("math", "commonsense"):
        sparse, soft = recipe_values(recipe), recipe_values(recipe, "soft")
        for values in (sparse, soft):
            assert (values["lora_rank"], values["lora_alpha"], values["lora_targets"]) == (8, 8.0, "Q,K,V,O,FFN_DOWN")
            assert (values["p_adapter_size"], values["swi_x"], values["blr"]) == (16, 4, 6e-3)
            assert (values["batch_size"] * values["accum_iter"], values["epochs"], values["warmup_epochs"]) == (32, 2, 1)
            assert (values["clip_grad"], values["val_fraction"], values["weight_decay"]) == (0.0, 0.0, 0.02)
            assert (values["temperature"], values["top_p"]) == (0.1, 0.75)
            assert values["precision"] == "bf16"  # the authors' bf16=True; an 8B base needs it on 24 GB
        assert sparse["variant"] == "sparse" and sparse["max_threshold"] == 0.5 and "prompt_layers" not in sparse
        assert soft["variant"] == "soft" and (soft["prompt_layers"], soft["prompt_len"]) == ("all", 10)
    assert recipe_values("math")["max_seq_len"] == 300 and recipe_values("math")["max_gen_len"] == 200
    assert recipe_values("commonsense")["max_seq_len"] == 200 and recipe_values("commonsense")["max_gen_len"] == 40
    # every recipe's keys are declared settings
    declared = set().union(*({f.name for f in setting_fields(c)} for c in (ModelArgs, TrainArgs, GenerationArgs)))
    for name in RECIPES:
        assert set(recipe_values(name)) <= declared, name


def test_all_layers_span():
    assert parse_layer_span("all", 3) == frozenset({0, 1, 2})
    args = ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=64, lora_layers="all", p_adapter_layers="all")
    assert args.lora_layers == "0-3" and args.p_adapter_layers == "0-3"  # saved configs name the span


def resolved(argv, world_size=1, n_layers=4):
    ns = Math.get_args_parser().parse_args(argv)
    ns.world_size = world_size
    return Math.resolve_settings(ns, n_layers)


def test_precedence_defaults_recipe_flags():
    model, train, generation = resolved([])  # the demo recipe
    assert "precision" not in model and ModelArgs.__dataclass_fields__["precision"].default == "fp32"
    assert (model["lora_rank"], model["lora_alpha"], train.blr, train.clip_grad) == (16, 16.0, 4e-2, 1.0)
    model, train, generation = resolved(["--recipe", "math", "--variant", "soft", "--lora_rank", "4"])
    assert (model["lora_rank"], model["lora_alpha"], model["prompt_layers"], train.blr) == (4, 8.0, "all", 6e-3)
    assert train.lr == pytest.approx(6e-3 * 32 / 256) and generation == {"max_gen_len": 200, "temperature": 0.1,
                                                                          "top_p": 0.75}


def test_a_resumed_run_takes_its_args_json_under_the_flags_given(tmp_path):
    """`--resume auto --output_dir <run>`: the base, data, recipe and every setting from the run's args.json,
    the flags given over them; a recorded value its rule refuses names the file and field."""
    model, train, generation = resolved(["--recipe", "math", "--lora_rank", "2", "--seed", "7"])  # as Math.py records
    recorded = {"recipe": "math", "llama_path": "/bases/qwen3", "data_path": "/data/math_14k.json",
                "val_data_path": None, **model, **vars(train), **generation, "max_steps": 3, "output_dir": "/elsewhere"}
    (tmp_path / "args.json").write_text(json.dumps(recorded))
    ns = Math.get_args_parser().parse_args(["--resume", "auto", "--output_dir", str(tmp_path), "--max_steps", "9"])
    ns.world_size = 1
    path, values = Math.recorded_run(ns)
    model, train, _ = Math.resolve_settings(ns, 4, path, values)
    assert (ns.recipe, ns.llama_path, ns.data_path, ns.output_dir) == ("math", "/bases/qwen3", "/data/math_14k.json",
                                                                       str(tmp_path))
    assert (model["lora_rank"], model["lora_alpha"], train.seed, train.max_steps, train.blr) == (2, 8.0, 7, 9, 6e-3)
    with pytest.raises(ValueError, match=f"{tmp_path / 'args.json'}: field 'lora_rank' must be an integer"):
        Math.resolve_settings(ns, 4, path, {**values, "lora_rank": "2"})
    fresh = Math.get_args_parser().parse_args(["--output_dir", str(tmp_path)])
    assert Math.recorded_run(fresh) == (None, {}) and fresh.recipe is None  # only a resumed run reads it


def test_recipe_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"lora_rank": 2, "epochs": 3}))
    model, train, _ = resolved(["--recipe", str(path)])
    assert model["lora_rank"] == 2 and train.epochs == 3 and model["lora_layers"] == "0-4"
    path.write_text(json.dumps({"lora_rnak": 2}))
    with pytest.raises(Math.UserError, match=r"unknown setting\(s\) \['lora_rnak'\]"):
        resolved(["--recipe", str(path)])
    with pytest.raises(ValueError, match="not one of"):
        recipe_values("nonesuch")


def test_train_settings_are_checked():
    with pytest.raises(ValueError, match="--accum_iter must be at least 1"):
        TrainArgs(accum_iter=0)
    with pytest.raises(ValueError, match="--val_fraction must be < 1, got 1.0"):
        TrainArgs(val_fraction=1.0)
    assert TrainArgs(blr=1e-3, batch_size=64, accum_iter=2).lr == pytest.approx(1e-3 * 128 / 256)


def test_infer_generation_settings_follow_the_run():
    recorded = {"max_gen_len": 40, "temperature": 0.1, "top_p": 0.75, "samples_per_task": 10}
    ns = Infer.get_args_parser().parse_args([])
    assert vars(Infer.generation_settings(ns, recorded)) == recorded
    ns = Infer.get_args_parser().parse_args(["--temperature", "0"])
    assert Infer.generation_settings(ns, recorded).temperature == 0.0
    assert vars(Infer.generation_settings(SimpleNamespace(), {})) == vars(GenerationArgs())
