"""scripts/export_hf.py and peft's LoRA folders, without torch: the files' names, rows and settings, a peft adapter's
numbers checked by merging it into the base's own safetensors, and the refusals (one line, nothing written).
tests/test_export_hf_reference.py checks the exported folders in transformers and peft themselves."""
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from conftest import REPO, assert_refused, snapshot
from tiny_models import max_abs, randomize_adapters

import jittor as jt

from Models.formats import CheckpointError, hf_remote, peft
from Models.formats.adapters import load_adapter, read_adapter, read_adapter_config, save_adapter
from Models.formats.base_model import base_args, build_model
from Models.formats.hf import CONFIG, from_hf_rows, to_hf_rows
from Models.formats.safetensors import SINGLE_FILE, read_arrays, save_safetensors

sys.path.insert(0, str(REPO / "scripts"))
import export_hf  # noqa: E402

ALL_TARGETS = "Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN"


def adapted(base, seed=0, **settings):
    """Our model on `base` with a random adapter (every tensor N(0, 0.3^2): LoRA B nonzero)."""
    model = build_model(base, base_args(base, max_seq_len=32, precision="fp32", lora_rank=4, p_adapter_size=8,
                                        **settings))
    randomize_adapters(model, seed=seed, scale=0.3)
    model.eval()
    return model


def logits(model, tokens):
    return model.llama(jt.array(tokens)).numpy()


TOKENS = np.random.default_rng(0).integers(1, 300, (2, 10)).astype(np.int32)


def test_hf_rows_round_trip():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # two heads of 8 rows
    hf = to_hf_rows(rows, 8)
    assert hf[:, 0].tolist()[:8] == [0, 6, 12, 18, 3, 9, 15, 21]  # Meta's pairs (0,1),(2,3).. -> halves
    np.testing.assert_array_equal(from_hf_rows(hf, 8), rows)


@pytest.mark.parametrize("layers,targets", [("0-2", ALL_TARGETS), ("1-2", "Q,K,FFN_DOWN")])
def test_plain_lora_exports_as_peft_and_merges_into_the_base(tiny_hf_llama, tmp_path, layers, targets):
    """W + (alpha/r) B A, with the file's names and rows, written into a copy of the base's safetensors, gives the
    adapted model's logits with no adapter: peft's names, HF's q/k rows and its scale are what peft applies."""
    model = adapted(tiny_hf_llama, method="moe", expert_num=1, lora_layers=layers, lora_targets=targets, lora_alpha=6)
    save_adapter(model, str(tmp_path / "adapter"))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out"), "--base", tiny_hf_llama,
                           "--base_ref", "meta-llama/Llama-3.2-1B"]) is None
    config = json.loads((tmp_path / "out" / peft.PEFT_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "layers_to_transform")} \
        == {"peft_type": "LORA", "base_model_name_or_path": "meta-llama/Llama-3.2-1B", "r": 4, "lora_alpha": 6,
            "layers_to_transform": None if layers == "0-2" else [1]}
    assert sorted(config["target_modules"]) == sorted({"Q": "q_proj", "K": "k_proj", "V": "v_proj", "O": "o_proj",
                                                        "FFN_UP": "up_proj", "FFN_GATE": "gate_proj",
                                                        "FFN_DOWN": "down_proj"}[t] for t in targets.split(","))
    tensors = read_arrays(str(tmp_path / "out" / peft.PEFT_WEIGHTS))
    assert len(tensors) == 2 * len(targets.split(",")) * (2 if layers == "0-2" else 1)
    merged = tmp_path / "merged"
    shutil.copytree(tiny_hf_llama, merged)
    weights = read_arrays(str(merged / SINGLE_FILE))
    for name, A in tensors.items():
        if name.endswith("lora_A.weight"):
            B = tensors[name.replace("lora_A", "lora_B")]
            hf_name = name[len(peft.PEFT_PREFIX):].replace(".lora_A", "")
            weights[hf_name] = weights[hf_name] + 6 / 4 * B @ A
    save_safetensors(weights, str(merged / SINGLE_FILE))
    plain = build_model(str(merged), base_args(str(merged), max_seq_len=32, precision="fp32"))
    ours = logits(model, TOKENS)
    assert max_abs(ours, logits(plain, TOKENS)) < 1e-4
    assert max_abs(ours, logits(build_model(tiny_hf_llama, plain.args), TOKENS)) > 0.5  # the LoRA does act
    # and back: the folder loads here as the same adapter
    fields = read_adapter_config(str(tmp_path / "out"))
    assert fields == {"method": "moe", "expert_num": 1, "lora_rank": 4, "lora_alpha": 6.0, "lora_targets": targets,
                      "lora_layers": layers, "prompt_layers": "0-0", "p_adapter_layers": "0-0"}
    back = build_model(tiny_hf_llama, base_args(tiny_hf_llama, max_seq_len=32, precision="fp32", **fields))
    load_adapter(back, str(tmp_path / "out"))
    arrays = read_adapter(str(tmp_path / "adapter"))
    assert all(np.array_equal(p.numpy(), arrays[n]) for n, p in back.adapter_parameters().items())


def test_moa_exports_as_a_transformers_folder(tiny_qwen3, tmp_path):
    model = adapted(tiny_qwen3, method="moa", variant="soft", lora_layers="0-2", prompt_layers="1-2",
                    p_adapter_layers="0-2", swi_x=2)
    save_adapter(model, str(tmp_path / "adapter"))
    (tmp_path / "args.json").write_text(json.dumps({"llama_path": tiny_qwen3}))  # the run's base, found by default
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out")]) is None
    out = tmp_path / "out"
    config = json.loads((out / CONFIG).read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_moa.MoAConfig",
                                  "AutoModelForCausalLM": "modeling_moa.MoAForCausalLM"}
    assert config["base_model_name_or_path"] == os.path.abspath(tiny_qwen3)
    moa = config["moa"]
    assert (moa["method"], moa["variant"], moa["lora_layers"], moa["prompt_layers"], moa["clamp"]) == \
        ("moa", "soft", [0, 1], [1], True)
    assert moa["base_config"] == {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
                                  "vocab_size": model.args.vocab_size}
    for name in hf_remote.MODELING_FILES:
        assert (out / name).read_bytes() == (REPO / "Models" / "formats" / "hf_remote_code" / name).read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tiny_qwen3, name), "rb") as f:
            assert (out / name).read_bytes() == f.read()
    tensors, ours = read_arrays(str(out / hf_remote.REMOTE_WEIGHTS)), read_adapter(str(tmp_path / "adapter"))
    assert len(tensors) == len(ours)
    for name, array in ours.items():
        exported = tensors[hf_remote.remote_name(name)]
        permuted = ".lora_Q.lora_B" in name or ".lora_K.lora_B" in name
        np.testing.assert_array_equal(exported, to_hf_rows(array, 32) if permuted else array)
    assert hf_remote.remote_name("llama.layers.1.attention.prompt_gate") == "model.layers.1.self_attn.prompt_gate"
    assert hf_remote.remote_name("llama.layers.0.adapter_type_router.w1.weight") == \
        "model.layers.0.adapter_type_router.w1.weight"
    assert hf_remote.remote_name("llama.layers.0.feed_forward.lora_DOWN.lora_B.weight") == \
        "model.layers.0.mlp.lora_DOWN.lora_B.weight"
    # a second export into the same folder replaces what the first wrote; a peft export removes its stale files
    lora = adapted(tiny_qwen3, method="moe", expert_num=1, lora_layers="0-2")
    save_adapter(lora, str(tmp_path / "lora"))
    assert export_hf.main([str(tmp_path / "lora"), str(out), "--base", tiny_qwen3]) is None
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [peft.PEFT_CONFIG, peft.PEFT_WEIGHTS]


def test_export_refusals_write_nothing(tiny_base, tiny_qwen3, tiny_hf_llama, tmp_path, capsys):
    meta = build_model(tiny_base, base_args(tiny_base, max_seq_len=32, lora_layers="0-2"))
    save_adapter(meta, str(tmp_path / "meta"))
    qwen = adapted(tiny_qwen3, method="moe", expert_num=1, lora_layers="0-2")
    save_adapter(qwen, str(tmp_path / "qwen"))
    out = tmp_path / "out"

    def refused(argv, *needles):
        before = snapshot(tmp_path)
        assert_refused(capsys, lambda: export_hf.main([*map(str, argv)]), *needles)
        assert snapshot(tmp_path) == before
    refused([tmp_path / "meta", out, "--base", tiny_base], "trained on a Meta-layout base, which has no Hugging Face form")
    refused([tmp_path / "qwen", out, "--base", tiny_base], "a Meta-layout base, which has no Hugging Face form")
    refused([tmp_path / "qwen", out, "--base", tiny_hf_llama], "trained on another base than",
            "architecture: adapter 'qwen3', base 'llama'")
    refused([tmp_path / "qwen", out], "no base named", "pass --base")
    refused([tmp_path / "nothing", out, "--base", tiny_qwen3], str(tmp_path / "nothing"), "no such adapter")
    refused([peft_folder(tmp_path), out, "--base", tiny_qwen3], "not an adapter of MoA-Jittor", "import it first")
    refused([tmp_path / "qwen", tmp_path / "qwen", "--base", tiny_qwen3], "is the folder of adapter")
    out.mkdir()
    (out / peft.PEFT_CONFIG).write_text("mine")
    refused([tmp_path / "qwen", out, "--base", tiny_qwen3], "holds adapter_config.json, which no run of the tools wrote")
    (tmp_path / "file").write_text("")
    refused([tmp_path / "qwen", tmp_path / "file" / "x", "--base", tiny_qwen3], "is under", "which is a file")
    (tmp_path / "args.json").write_text(json.dumps({"data_path": None}))  # a run's, its base's field lost
    refused([tmp_path / "qwen", out], f"{tmp_path / 'args.json'}: field 'llama_path'", "pass --base")


def peft_folder(tmp_path, config=None, tensors=None, name="peft", layer=1):
    """A peft LoRA folder: rank 2 on layer `layer`'s q_proj and down_proj of a 64-wide base, `config` fields
    changed (`tensors`: other shapes)."""
    folder = tmp_path / name
    folder.mkdir()
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"],
            "layers_to_transform": [1], "bias": "none", "use_dora": False, "lora_dropout": 0.05,
            "task_type": "CAUSAL_LM"}
    (folder / peft.PEFT_CONFIG).write_text(json.dumps({**base, **(config or {})}))
    rng = np.random.default_rng(0)
    prefix = peft.PEFT_PREFIX + f"model.layers.{layer}."
    shapes = tensors or {"self_attn.q_proj.lora_A.weight": (2, 64), "self_attn.q_proj.lora_B.weight": (128, 2),
                         "mlp.down_proj.lora_A.weight": (2, 160), "mlp.down_proj.lora_B.weight": (64, 2)}
    save_safetensors({prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
                     str(folder / peft.PEFT_WEIGHTS))
    return str(folder)


def test_peft_folder_reads_as_our_settings_and_rows(tiny_qwen3, tmp_path):
    folder = peft_folder(tmp_path, {"use_rslora": True})
    fields = read_adapter_config(folder)
    assert fields == {"method": "moe", "expert_num": 1, "lora_rank": 2, "lora_alpha": 4 * 2 ** 0.5,
                      "lora_targets": "Q,FFN_DOWN", "lora_layers": "1-2", "prompt_layers": "0-0",
                      "p_adapter_layers": "0-0"}
    model = build_model(tiny_qwen3, base_args(tiny_qwen3, max_seq_len=32, **fields))
    load_adapter(model, folder)
    theirs = read_arrays(os.path.join(folder, peft.PEFT_WEIGHTS))
    q_b = theirs[peft.PEFT_PREFIX + "model.layers.1.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_array_equal(model.llama.layers[1].attention.lora_Q.lora_B.weight.numpy(), from_hf_rows(q_b, 32))
    # tensors that are no LoRA of this base, or not finite, are refused naming the file
    arrays = dict(theirs)
    for changed, message in [({"self_attn.q_proj.lora_B.weight": np.ones((129, 2), np.float32)},
                              "model.layers.1.self_attn.q_proj.lora_B.weight' has shape [129, 2], where LoRA of "
                              "rank 2 on the base's self_attn.q_proj has [128, 2]"),
                             ({"mlp.down_proj.lora_A.weight": np.ones((2, 161), np.float32)},
                              "mlp.down_proj.lora_A.weight' has shape [2, 161], where LoRA of rank 2 on the base's "
                              "mlp.down_proj has [2, 160]"),
                             ({"mlp.down_proj.lora_B.weight": np.ones((64, 3), np.float32)},
                              "mlp.down_proj.lora_B.weight' has shape [64, 3]"),
                             ({"mlp.down_proj.lora_A.weight": np.full((2, 160), np.nan, np.float32)},
                              "hold NaN or inf values")]:
        save_safetensors({**arrays, **{peft.PEFT_PREFIX + "model.layers.1." + k: v for k, v in changed.items()}},
                         os.path.join(folder, peft.PEFT_WEIGHTS))
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_adapter(model, folder)
    assert peft.spans([0, 1, 2, 5, 7, 8]) == "0-3,5-6,7-9"


@pytest.mark.parametrize("config,tensors,message", [
    ({"use_dora": True}, None, "use_dora True changes what the adapter computes and has no form"),
    ({"bias": "all"}, None, "bias 'all' changes what the adapter computes"),
    ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 8}}, None, "alpha_pattern"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"peft_type": "IA3"}, None, "peft_type 'IA3': only peft's LORA adapters load here"),
    ({"init_lora_weights": "pissa"}, None, "init_lora_weights 'pissa' changes the base's weights too"),
    ({"some_future_option": {"on": 1}}, None, "['some_future_option'] unknown to MoA-Jittor's peft reader"),
    ({"r": 4}, None, "LoRA ranks [2] where adapter_config.json says r 4"),
    ({}, {"self_attn.q_proj.lora_A.weight": (2, 64), "self_attn.q_proj.lora_B.weight": (128, 2),
          "self_attn.q_proj.lora_magnitude_vector": (128,)}, "is not LoRA on a projection of a decoder layer"),
    ({}, {"self_attn.q_proj.lora_A.weight": (2, 64)}, "layer 1 Q lora_B is absent"),
    ({"use_rslora": "false"}, None, "field 'use_rslora' is 'false', expected true or false"),
    ({"lora_alpha": float("inf")}, None, "field 'lora_alpha' is inf, expected a positive number"),
    ({}, {"self_attn.q_proj.lora_A.weight": (), "self_attn.q_proj.lora_B.weight": (128, 2)},
     "lora_A.weight' has shape [], where a LoRA matrix has 2 dimensions"),
])
def test_peft_settings_with_no_form_here_are_refused(tmp_path, config, tensors, message):
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_adapter_config(peft_folder(tmp_path, config, tensors))


LAYER_99 = {"self_attn.q_proj.lora_A.weight": (2, 64), "self_attn.q_proj.lora_B.weight": (128, 2)}
LAYER_1_ALL = dict(target_modules="all-linear", layers_to_transform=None,
                   exclude_modules=r"model\.layers\.0\..*|.*\.(k_proj|v_proj|o_proj|gate_proj|up_proj)")


@pytest.mark.parametrize("config,message", [
    # where peft puts LoRA (check_target_module_exists) and where the tensors are disagree: refused either way
    ({"target_modules": ["q_proj"]}, "'base_model.model.model.layers.1.mlp.down_proj.lora_A.weight' is on a module "
                                     "that {folder}/adapter_config.json's target_modules ['q_proj'] keeps LoRA off"),
    ({"layers_to_transform": [0]}, "layers.1.self_attn.q_proj.lora_A.weight' is on a module that {folder}/"
                                   "adapter_config.json's layers_to_transform [0] keeps LoRA off: peft would leave"),
    ({"layers_to_transform": 0}, "layers_to_transform 0 keeps LoRA off"),
    ({"layers_pattern": "h"}, "layers_pattern 'h' keeps LoRA off"),
    ({"exclude_modules": ["down_proj"]}, "mlp.down_proj.lora_A.weight' is on a module that {folder}/adapter_config"
                                         ".json's exclude_modules ['down_proj'] keeps LoRA off"),
    ({"target_modules": r".*\.q_proj", "layers_to_transform": None}, r"target_modules '.*\\.q_proj' keeps LoRA off"),
    ({"layers_to_transform": None}, "{folder}/adapter_config.json: target_modules and the fields beside it put LoRA "
                                    "on model.layers.0.self_attn.q_proj, for which {folder}/adapter_model.safetensors "
                                    "holds no tensors (2 such module(s))"),
    ({**LAYER_1_ALL, "exclude_modules": r".*\.(k_proj|v_proj|o_proj|gate_proj|up_proj)"},
     "put LoRA on model.layers.0.self_attn.q_proj"),
    ({"target_modules": ["q_proj", "down_proj", "lm_head"]}, "{folder}/adapter_config.json: target_modules and the "
     "fields beside it put LoRA on lm_head: no form here, where LoRA is on the seven projections only"),
    ({"target_modules": ["q_proj", "down_proj", "q_norm"], "layers_to_transform": None,
      "exclude_modules": r"model\.layers\.0\..*_proj"}, "put LoRA on model.layers.0.self_attn.q_norm: no form"),
    ({"target_modules": r".*layers\.1\.(self_attn\.q_proj|mlp\.down_proj|mlp)", "layers_to_transform": None},
     "put LoRA on model.layers.1.mlp: no form"),
    # fields of kinds or combinations peft does not take
    ({"target_modules": None}, "field 'target_modules' is missing"),
    ({"target_modules": 5}, "field 'target_modules' is 5, expected a string or a list of strings"),
    ({"target_modules": "(["}, "field 'target_modules' '([' is no regular expression"),
    ({"target_modules": "all-linear"}, "layers_to_transform or layers_pattern with a target_modules string ('all-"),
    ({"target_modules": ".*", "layers_to_transform": None, "layers_pattern": []}, "with a target_modules string"),
    ({"layers_to_transform": None, "layers_pattern": "layers"}, "layers_pattern without layers_to_transform"),
    ({"layers_to_transform": ["1"]}, "field 'layers_to_transform' is ['1'], expected a layer number or a list"),
    ({"exclude_modules": {"down_proj": 1}}, "field 'exclude_modules' is {'down_proj': 1}, expected a string or"),
    # settings that must say exactly what peft reads, naming the file and the field
    ({"r": 2.0}, "{folder}/adapter_config.json: field 'r' is 2.0, expected a positive integer"),
    ({"bias": 0}, "{folder}/adapter_config.json: bias 0 changes what the adapter computes and has no form in "
                  "MoA-Jittor's LoRA (only 'none' has)"),
    ({"bias": None}, "bias None changes what the adapter computes"),
    ({"use_rslora": True, "lora_alpha": 1.5e308}, "{folder}/adapter_config.json: lora_alpha 1.5e+308 times sqrt(r)"),
])
def test_peft_tensors_must_be_where_the_config_puts_lora(tiny_qwen3, tmp_path, config, message):
    folder = peft_folder(tmp_path, config)
    expected = message.replace("{folder}", folder)
    with pytest.raises(CheckpointError) as info:
        read_adapter_config(folder, base=base_args(tiny_qwen3))
    assert expected in str(info.value), str(info.value)


@pytest.mark.parametrize("config", [
    {"layers_to_transform": 1, "layers_pattern": ["h", "layers"]}, LAYER_1_ALL,
    {"target_modules": r"model\.layers\.1\.(self_attn\.q_proj|mlp\.down_proj)", "layers_to_transform": None},
    {"target_modules": ["model.layers.1.self_attn.q_proj", "down_proj"], "layers_to_transform": [1, 5],
     "exclude_modules": "lm_head"}])
def test_peft_config_that_puts_lora_where_its_tensors_are_loads(tiny_qwen3, tmp_path, config):
    assert read_adapter_config(peft_folder(tmp_path, config), base=base_args(tiny_qwen3))["lora_layers"] == "1-2"


def test_peft_folders_refused_by_infer_are_named_by_their_files(tiny_qwen3, addsub, tmp_path, capsys, monkeypatch):
    """Infer.py reads the peft folder's settings against the base: a tensor on a layer the base lacks is named with
    its file, before the model is built; a flag other than the folder's settings names adapter_config.json (not
    the adapter_params.json a folder of ours would have)."""
    import Infer
    monkeypatch.setattr(Infer, "build_model", lambda *a: pytest.fail("the model was built"))
    folder = peft_folder(tmp_path, {"layers_to_transform": [99]}, LAYER_99, layer=99)
    argv = ["--llama_path", tiny_qwen3, "--data_path", addsub, "--output_dir", str(tmp_path / "eval")]
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", folder, *argv]),
                   f"{folder}/adapter_model.safetensors: tensor 'base_model.model.model.layers.99.self_attn.q_proj."
                   "lora_A.weight' is on layer 99, past the base's 2 layers")
    monkeypatch.undo()
    folder = peft_folder(tmp_path, name="good")
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", folder, *argv, "--lora_rank", "4"]),
                   f"{folder}/adapter_config.json: adapter from another configuration: lora_rank: adapter has 2")
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", folder, *argv, "--lora_layers", "0-9"]),
                   "'0-9' reaches past the model's 2 layers", f"(the adapter's settings: {folder}/adapter_config.json")
    assert not (tmp_path / "eval").exists()


def test_infer_without_llama_path_takes_the_base_a_peft_folder_names_or_refuses(tiny_qwen3, addsub, tmp_path,
                                                                               capsys, monkeypatch):
    """No --llama_path and no run's args.json: a peft folder's base_model_name_or_path when it is a local folder,
    else a refusal saying to pass --llama_path; never the demo base, whose shapes the adapter does not fit."""
    import Infer
    monkeypatch.setattr(Infer, "ensure_default_base", lambda: pytest.fail("the demo base was taken"))
    local = peft_folder(tmp_path, {"base_model_name_or_path": tiny_qwen3}, name="local")
    assert Infer.resolve_run(Infer.get_args_parser().parse_args(["--adapter_path", local]))[3] == tiny_qwen3
    hub = peft_folder(tmp_path, {"base_model_name_or_path": "Qwen/Qwen3-0.6B"}, name="hub")
    argv = ["--data_path", addsub, "--output_dir", str(tmp_path / "eval")]
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", hub, *argv]),
                   f"{hub}/adapter_config.json: base_model_name_or_path 'Qwen/Qwen3-0.6B' is not a local folder",
                   "pass --llama_path")
    save_adapter(adapted(tiny_qwen3, method="moe", expert_num=1, lora_layers="0-1"), str(tmp_path / "ours"))
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", str(tmp_path / "ours"), *argv]),
                   f"--adapter_path {tmp_path / 'ours'}: no run's args.json beside it names its base",
                   "pass --llama_path")
    assert not (tmp_path / "eval").exists()


def test_export_carries_the_runs_decoding_and_its_base_precision(tiny_qwen3, tmp_path, capsys):
    """generation_config.json: the base's token ids with the run's decoding (args.json), not the base's sampling;
    config.json: the base's model_type (AutoTokenizer asks nothing: tests/test_export_hf_reference.py) and the
    precision the adapter trained in; an int8 or nf4 one exports with a warning line (nf4's names bitsandbytes')."""
    save_adapter(adapted(tiny_qwen3, method="moa", variant="sparse", lora_layers="0-2", p_adapter_layers="0-2",
                         swi_x=2), str(tmp_path / "adapter"))
    base_generation = json.loads(open(os.path.join(tiny_qwen3, "generation_config.json")).read())
    decoding = {"temperature": 0.1, "top_p": 0.75, "max_gen_len": 200}
    (tmp_path / "args.json").write_text(json.dumps({"llama_path": tiny_qwen3, **decoding}))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out")]) is None
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"eos_token_id": base_generation["eos_token_id"], "do_sample": True, "temperature": 0.1,
                          "top_p": 0.75, "max_new_tokens": 200}
    config = json.loads((tmp_path / "out" / CONFIG).read_text())
    assert config["model_type"] == "qwen3" and config["moa"]["trained_precision"] == "fp32"
    assert "warning" not in capsys.readouterr().err
    params = tmp_path / "adapter" / "adapter_params.json"
    params.write_text(json.dumps({**json.loads(params.read_text()), "precision": "int8"}))
    (tmp_path / "args.json").write_text(json.dumps({"llama_path": tiny_qwen3, **decoding, "temperature": 0.0}))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out")]) is None
    assert "warning: the adapter was trained on an int8 base" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / CONFIG).read_text())["moa"]["trained_precision"] == "int8"
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"eos_token_id": base_generation["eos_token_id"], "do_sample": False, "max_new_tokens": 200}
    params.write_text(json.dumps({**json.loads(params.read_text()), "precision": "nf4"}))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out")]) is None
    assert "warning: the adapter was trained on an nf4 base (QLoRA's 4-bit NormalFloat" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / CONFIG).read_text())["moa"]["trained_precision"] == "nf4"


def test_peft_layers_differing_in_projections_are_refused(tmp_path):
    folder = peft_folder(tmp_path, {"layers_to_transform": None})
    arrays = read_arrays(os.path.join(folder, peft.PEFT_WEIGHTS))
    arrays[peft.PEFT_PREFIX + "model.layers.0.mlp.down_proj.lora_A.weight"] = np.ones((2, 160), np.float32)
    arrays[peft.PEFT_PREFIX + "model.layers.0.mlp.down_proj.lora_B.weight"] = np.ones((64, 2), np.float32)
    save_safetensors(arrays, os.path.join(folder, peft.PEFT_WEIGHTS))
    with pytest.raises(CheckpointError, match="LoRA on other projections in some layers than in others "
                                              r"\(layer 0 Q lora_A is absent\)"):
        read_adapter_config(folder)


@pytest.mark.slow
def test_infer_scores_with_a_peft_folder(tiny_hf_llama, addsub, tmp_path):
    """Infer.py takes a peft LoRA folder as --adapter_path: its settings from adapter_config.json, its tensors
    from adapter_model.safetensors."""
    import Infer
    save_adapter(adapted(tiny_hf_llama, method="moe", expert_num=1, lora_layers="0-2"), str(tmp_path / "adapter"))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "peft"), "--base", tiny_hf_llama]) is None
    summary = Infer.main(["--adapter_path", str(tmp_path / "peft"), "--llama_path", tiny_hf_llama, "--data_path",
                          addsub, "--output_dir", str(tmp_path / "eval"), "--max_gen_len", "2", "--batch_size", "2",
                          "--plot_examples", "0"])
    assert summary["adapter"] == str(tmp_path / "peft") and summary["datasets"]["AddSub"]["total"] == 2
