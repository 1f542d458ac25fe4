"""Settings, each checked by its declared rule where it comes from (a flag, a recipe, a base's params.json, a
run's args.json, an adapter's adapter_params.json, the authors' files) and refused in one line naming that source,
before anything is written; a resumed run refuses what it cannot change; Compare.py refuses flags that would
mislabel its rows; Infer.py refuses a MoA flag that differs from the adapter's own settings."""
import json
import os

import pytest
from conftest import (DATA, MPIRUN, assert_refused, edited_base, make_entries, math_argv, math_refuses, mpirun,
                      one_error_line, snapshot, tiny_adapter, train)
from golden_files import golden_model

import Math
from Models.formats import CheckpointError
from Models.formats.adapters import export_authors_adapter, import_authors_adapter, read_adapter_config, save_adapter
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs


def test_flags_are_checked_by_their_settings_rules(tiny_base, synthetic_data, tmp_path, capsys):
    cases = [
        (["--lr", "inf"], ["--lr", "finite"]), (["--min_lr", "nan"], ["--min_lr", "finite"]),
        (["--warmup_epochs", "nan"], ["--warmup_epochs", "finite"]), (["--seed", str(2**64)], ["--seed", "at most"]),
        (["--clip_grad", "nan"], ["--clip_grad", "finite"]), (["--weight_decay", "-0.1"], ["--weight_decay", "at least 0"]),
        (["--max_threshold", "nan"], ["--max_threshold", "finite"]), (["--max_threshold", "0"], ["--max_threshold", "> 0"]),
        (["--max_threshold", "1.5"], ["--max_threshold", "at most 1"]), (["--lora_alpha", "nan"], ["--lora_alpha"]),
        (["--lora_alpha", "1e39"], ["--lora_alpha", "finite"]), (["--lr", "-1"], ["--lr", "> 0"]),
        (["--lora_targets", ","], ["lora_targets", "no target"]), (["--lora_targets", "Q,V,Q"], ["repeated", "'Q'"]),
        (["--lora_targets", "Q,X"], ["unknown target", "'X'"]),
        (["--min_lr", "0.1"], ["--min_lr 0.1", "above the learning rate 0.01"]),
        (["--val_fraction", "1"], ["--val_fraction", "< 1"]), (["--lb_loss_coeff", "-1"], ["--lb_loss_coeff"]),
        # 0 or a subnormal in float32: trains nothing, or with no effect
        (["--lr", "1e-300"], ["--lr", "0 or a subnormal"]), (["--min_lr", "1e-40"], ["--min_lr", "subnormal"]),
        (["--weight_decay=1e-39"], ["--weight_decay", "subnormal"]),
    ]
    for extra, needles in cases:
        math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, extra, needles)


def test_recipe_and_params_files_are_checked_naming_file_and_field(tiny_base, synthetic_data, tmp_path, capsys):
    recipe = tmp_path / "recipe.json"
    for bad in [{"batch_size": "32"}, {"clip_grad": None}, {"seed": 1.5}, {"lora_rank": "8"}, {"lora_alpha": float("nan")},
                {"precision": "fp16"}, {"hydra_moe": 1}, {"temperature": "hot"}, {"top_p": 7}, {"max_gen_len": 0}]:
        recipe.write_text(json.dumps(bad))  # decoding settings too: Math.py records them for Infer.py
        (field, value), = bad.items()
        math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--recipe", str(recipe)],
                     [str(recipe), f"field '{field}'", "null" if value is None else repr(value)])
    for i, bad in enumerate([{"norm_eps": float("nan")}, {"rope_theta": -1.0}, {"ffn_dim_multiplier": "1.3"},
                             {"n_heads": 0}, {"use_scaled_rope": "yes"}]):
        base = edited_base(tiny_base, tmp_path / f"base{i}", **bad)
        (field, _), = bad.items()
        math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--llama_path", base],
                     [os.path.join(base, "params.json"), f"field '{field}'"])


def test_a_learning_rate_that_computes_as_zero_is_refused():
    """float32 holds 1e-300 as 0 and 1e-40 as a subnormal: either trains nothing. The least normal float32 passes."""
    from Utils.settings import FLOAT32_TINY, SettingError, TrainArgs
    assert TrainArgs(lr=FLOAT32_TINY, min_lr=FLOAT32_TINY).lr == FLOAT32_TINY
    for settings, needle in [(dict(lr=1e-300), "--lr must be 0 or at least"), (dict(min_lr=5e-39), "--min_lr"),
                             (dict(blr=2e-38, batch_size=1), "--blr \\* --batch_size")]:
        with pytest.raises(SettingError, match=needle):
            TrainArgs(**settings)


def test_recorded_decoding_and_adapter_settings_are_checked(tmp_path):
    import Infer
    from Models.formats.adapters import export_authors_adapter, read_adapter_config
    from Utils.settings import SettingError
    flags = Infer.get_args_parser().parse_args([])
    for bad in [{"max_gen_len": 0}, {"top_p": 7}, {"temperature": "hot"}, {"temperature": -1}, {"max_gen_len": 2.5}]:
        (field, _), = bad.items()
        with pytest.raises(SettingError, match=f"run/args.json: field '{field}'"):
            Infer.generation_settings(flags, bad, "run/args.json")
        given = Infer.get_args_parser().parse_args([f"--{field}", "1"])  # a flag given replaces the recorded value
        assert getattr(Infer.generation_settings(given, bad, "run/args.json"), field) == 1
    ours, theirs = tmp_path / "ours", tmp_path / "theirs" / "adapter.pth"
    args = tiny_adapter(ours)
    export_authors_adapter(str(ours), str(theirs))
    for folder, bad in [(ours, {"lora_alpha": "8"}), (ours, {"max_threshold": 2.0}), (ours, {"norm_eps": 0}),
                        (theirs.parent, {"lora_rank": "8"}), (theirs.parent, {"swi_x": -1}),
                        (theirs.parent, {"max_seq_len": None})]:
        path = folder / "adapter_params.json"
        saved = path.read_text()
        path.write_text(json.dumps({**json.loads(saved), **bad}))
        (field, _), = bad.items()
        with pytest.raises(ValueError, match=f"{path}: field '{field}'"):
            read_adapter_config(str(folder))
        path.write_text(saved)
    (ours / "adapter_params.json").write_text(json.dumps({**args.to_dict(), "lora_rnak": 2}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['lora_rnak'\]"):
        read_adapter_config(str(ours))


@pytest.mark.slow
def test_resume_refuses_settings_it_cannot_change(tiny_base, synthetic_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 0
    saved = snapshot(out)
    for extra, fields in [(["--precision", "bf16"], ["precision"]), (["--precision", "int8"], ["precision"]),
                          (["--lora_alpha", "4"], ["lora_alpha"]),
                          (["--gamma_grad", "ste"], ["gamma_grad"]), (["--lr", "2e-2"], ["lr"]),
                          (["--lora_rank", "8", "--batch_size", "8"], ["lora_rank", "batch_size"])]:
        assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto", *extra) == 2, extra
        one_error_line(capsys.readouterr().err, "another configuration", *(f"{field}: " for field in fields))
        assert snapshot(out) == saved  # args.json, log.txt and checkpoint-latest.pth not rewritten
    # what a resumed run may change: its length, its logging, the decoding recorded for Infer.py
    assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto", "--log_interval", "5") == 0
    assert json.loads((out / "args.json").read_text())["log_interval"] == 5
    # but not to fewer steps than it ran: its args.json would say 1 where the checkpoint holds 2
    saved = snapshot(out)
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1, "--resume", "auto") == 2
    one_error_line(capsys.readouterr().err, "--max_steps 1 is below the step", "(2)", "--overwrite")
    assert snapshot(out) == saved


def test_a_resumed_runs_args_json_is_checked_field_by_field(tiny_base, synthetic_data, tmp_path, capsys):
    """The issue's cases: without llama_path a resumed run took the demo base (then refused for its architecture),
    an unknown field and max_gen_len 10**12 passed. args.json is read as Math.py wrote it: every field a resumed run
    reads present (the inputs, each setting the recipe and Math.py set, the training loop's), none unknown, each
    value by its rule; refused naming the file and the field, before anything is read or written."""
    out = tmp_path / "run"
    ns = Math.get_args_parser().parse_args(math_argv(tiny_base, synthetic_data, out))
    ns.world_size = 1
    model, train_args, generation = Math.resolve_settings(ns, 2)
    record = {**Math.run_flags(ns), "recipe": ns.recipe, **model, **vars(train_args), **generation, "run_id": "r1"}
    path = out / "args.json"
    cases = [({"llama_path": None}, "missing field(s) ['llama_path']"), ({"data_path": None}, "['data_path']"),
             ({"lora_rank": None}, "missing field(s) ['lora_rank']"), ({"epochs": None}, "['epochs']"),
             ({"recipe": None}, "['recipe']"), ({"lora_rnak": 3}, "unknown field(s) ['lora_rnak']"),
             ({"max_gen_len": 10**12}, "field 'max_gen_len' must be at most"), ({"device": "tpu"}, "field 'device'"),
             ({"world_size": 0}, "field 'world_size'"), ({"run_id": 5}, "field 'run_id' must be a string"),
             ({"overwrite": "no"}, "field 'overwrite'"), ({"temperature": -1.0}, "field 'temperature'"),
             ({"llama_path": 7}, "field 'llama_path' must be a string"), ({"recipe": "nonesuch"}, "field 'recipe'")]
    for change, needle in cases:
        damaged = {k: v for k, v in {**record, **change}.items() if v is not None or k not in change}
        make_entries(out, "args.json", text=json.dumps(damaged))
        assert_refused(capsys, lambda: Math.main(["--resume", "auto", "--output_dir", str(out)]), str(path), needle)
        assert os.listdir(out) == ["args.json"] and json.loads(path.read_text()) == damaged
    make_entries(out, "args.json", text=json.dumps(record))  # as written, it resumes with its base and data
    resumed = Math.get_args_parser().parse_args(["--resume", "auto", "--output_dir", str(out)])
    assert Math.recorded_run(resumed)[0] == str(path) and resumed.llama_path == tiny_base
    del record["llama_path"]  # a flag given stands in for a missing field
    make_entries(out, "args.json", text=json.dumps(record))
    given = Math.get_args_parser().parse_args(["--resume", "auto", "--output_dir", str(out), "--llama_path", "b"])
    assert Math.recorded_run(given)[0] == str(path) and given.llama_path == "b"


@pytest.mark.slow
def test_resume_refuses_changed_data_at_the_same_path(tiny_base, synthetic_data, tmp_path, capsys):
    own = {k: str(tmp_path / f"{k}.json") for k in synthetic_data}
    for k in synthetic_data:
        with open(synthetic_data[k]) as src, open(own[k], "w") as dst:
            dst.write(src.read())
    out = str(tmp_path / "run")
    assert train(tiny_base, own, out, "--max_steps", 1) == 0
    saved = snapshot(out)
    with open(own["train"]) as f:
        rows = json.load(f)
    with open(own["train"], "w") as f:
        json.dump(rows[:-4], f)  # 4 examples fewer, same file name
    capsys.readouterr()
    assert train(tiny_base, own, out, "--max_steps", 2, "--resume", "auto") == 2
    one_error_line(capsys.readouterr().err, "another configuration", "train_sha256")
    assert snapshot(out) == saved


def test_batch_size_and_world_size():
    def args(batch_size, world_size):
        ns = Math.get_args_parser().parse_args(["--batch_size", str(batch_size)])
        ns.world_size = world_size
        return ns
    with pytest.raises(Math.UserError, match="smaller than the 4 MPI ranks"):
        Math.resolve_settings(args(2, 4), 2)
    with pytest.raises(Math.UserError, match="not divisible by the 2 MPI ranks"):
        Math.resolve_settings(args(5, 2), 2)
    model_settings, cfg, _ = Math.resolve_settings(args(8, 2), 2)
    assert cfg.lr == pytest.approx(cfg.blr * 8 / 256) and model_settings["lora_layers"] == "all"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (install OpenMPI to test data parallel)")
def test_batch_size_must_split_over_ranks(tiny_base, synthetic_data, tmp_path):
    result = mpirun(2, math_argv(tiny_base, synthetic_data, tmp_path / "bad", "--batch_size", 3))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "--batch_size 3 is not divisible by the 2 MPI ranks" in output and "Traceback" not in output
    assert not (tmp_path / "bad").exists()


MOA = dict(lora_layers="0-2", lora_rank=4, lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN", p_adapter_layers="0-2",
           p_adapter_size=8, swi_x=2, variant="sparse")


@pytest.mark.parametrize("settings, message", [
    ({**MOA, "lora_targets": "Q,FFN_MID"}, "unknown target"),
    ({**MOA, "lora_layers": "0-"}, "lora_layers"),
    ({**MOA, "lora_layers": "3-1"}, "ends before it starts"),
    ({**MOA, "p_adapter_layers": "0-9"}, "past the model"),
    ({**MOA, "prompt_layers": "0-2"}, "Sparse MoA"),
    ({**MOA, "gamma_grad": "soft"}, "gamma_grad"),
    ({"method": "topk", "expert_num": 1}, "expert_num must be >= 2"),
    ({"method": "topk", "expert_num": 4, "top_k": 5}, "top_k=5 must be between 1"),
    ({"method": "topk", "expert_num": 4, "top_k": 1, "lb_loss_coeff": 0.0}, "never learns"),
    ({"method": "adamole", "expert_num": 4, "p_adapter_layers": "0-1"}, "LoRA experts only"),
    ({"method": "unipeft", "p_adapter_layers": "0-2", "prompt_layers": "0-1"}, "every p_adapter layer needs prompt"),
    ({"method": "sparse_moe"}, "must be one of moa, moe, topk"),
])
def test_model_settings_without_a_working_form_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs(**{**dict(dim=32, n_layers=2, n_heads=4, vocab_size=97, multiple_of=16, lora_layers="0-2"),
                     **settings})


def test_authors_options_we_do_not_implement_are_refused(tmp_path):
    model, data, meta = golden_model("baselines/sparse_moe_topk2_e4_s0")
    save_adapter(model, str(tmp_path / "ours"))
    export_authors_adapter(str(tmp_path / "ours"), str(tmp_path / "theirs" / "adapter.pth"))
    path = tmp_path / "theirs" / "adapter_params.json"
    fields = json.loads(path.read_text())
    path.write_text(json.dumps({**fields, "noisy_router": True}))
    with pytest.raises(CheckpointError, match=r"\['noisy_router'\].*not implement"):
        import_authors_adapter(str(tmp_path / "theirs" / "adapter.pth"), str(tmp_path / "back"), model.args)
    path.write_text(json.dumps({**fields, "adamole": "False"}))  # their type=bool flag: any string is True
    arrays_args = ModelArgs(**{**model.args.to_dict(), "method": "adamole"})
    with pytest.raises(CheckpointError, match="missing adapter tensor"):
        import_authors_adapter(str(tmp_path / "theirs" / "adapter.pth"), str(tmp_path / "back"), arrays_args)
    gated = ModelArgs(**{**model.args.to_dict(), "lora_targets": "Q,FFN_GATE"})
    save_adapter(LLaMA_adapter(gated), str(tmp_path / "gated"))
    with pytest.raises(CheckpointError, match="no FFN_GATE LoRA"):
        export_authors_adapter(str(tmp_path / "gated"), str(tmp_path / "x" / "adapter.pth"))


def test_a_moa_flag_must_equal_the_adapters_setting(tiny_run, addsub, tmp_path, monkeypatch, capsys):
    """Beside its adapter_params.json an adapter's settings are used: a MoA flag that differs from one is refused
    (one line naming the file and the setting, exit 2, nothing written), a flag that equals it is accepted."""
    import Infer
    monkeypatch.setattr(Infer, "generate", lambda model, tok, prompts, *a, **k: [[] for _ in prompts])
    adapter = tiny_run / "adapter"
    saved = read_adapter_config(str(adapter))
    common = ["--adapter_path", str(adapter), "--data_path", addsub, "--output_dir", str(tmp_path / "eval")]
    differing = {"lora_rank": saved["lora_rank"] * 2, "variant": "soft", "lora_targets": "Q,V",
                 "lora_alpha": saved["lora_alpha"] + 1}
    for field, value in differing.items():
        assert_refused(capsys, lambda: Infer.main([*common, f"--{field}", str(value)]),
                       str(adapter / "adapter_params.json"), "another configuration", f"{field}: adapter has")
        assert not (tmp_path / "eval").exists()
    equal = [a for field in differing for a in (f"--{field}", str(saved[field]))]
    assert Infer.main([*common, *equal])["datasets"]["AddSub"]["total"] == 2


def test_flags_that_do_nothing_are_refused(tiny_base, synthetic_data, addsub, tmp_path, capsys):
    """A setting given on the command line that the others make do nothing is refused naming it and why (one rule
    table, Models/ModelArgs.IDLE_SETTINGS); the same values from a recipe are the recipe's, not refused."""
    no_lora = ["--lora_layers", "0-0"]
    cases = [(["--variant", "soft", "--max_threshold", "0.3"], "--max_threshold 0.3", "only Sparse MoA"),
             (["--variant", "soft", "--const_threshold"], "--const_threshold", "only Sparse MoA"),
             (["--variant", "soft", "--no-const_threshold"], "--no-const_threshold", "only Sparse MoA"),
             (["--method", "instance", "--gamma_grad", "ste"], "--gamma_grad ste", "only Sparse MoA"),
             (["--top_k", "3"], "--top_k 3", "only --method topk"),
             (["--method", "adamole", "--expert_num", "4", "--p_adapter_layers", "0-0", "--top_k", "3"], "--top_k 3",
              "only --method topk"),
             (["--lb_loss_coeff", "5"], "--lb_loss_coeff 5.0", "only --method topk and adamole"),
             (["--expert_num", "1", "--hydra_moe"], "--hydra_moe", "one LoRA expert"),
             (["--method", "topk", "--expert_num", "4", "--p_adapter_layers", "0-0", "--hydra_moe"], "--hydra_moe",
              "the experts of --method topk"),
             (["--p_adapter_hydra"], "--p_adapter_hydra", "one parallel adapter"),
             (["--prompt_len", "5"], "--prompt_len 5", "no layer has prompt tuning"),
             (["--p_adapter_layers", "0-0", "--p_adapter_size", "8"], "--p_adapter_size 8", "no layer has a parallel"),
             ([*no_lora, "--lora_rank", "8"], "--lora_rank 8", "no layer has LoRA"),
             ([*no_lora, "--lora_alpha", "2"], "--lora_alpha 2.0", "no layer has LoRA"),
             (["--method", "moe", "--swi_x", "2"], "--swi_x 2", "no layer has a type router"),
             ([*no_lora, "--p_adapter_layers", "0-0", "--expert_num", "2"], "--expert_num 2", "no layer has experts")]
    for extra, flag, why in cases:  # the demo recipe's settings, then the flags given
        argv = ["--llama_path", tiny_base, "--data_path", synthetic_data["train"], "--output_dir",
                str(tmp_path / "out"), "--max_steps", "1", *extra]
        assert_refused(capsys, lambda: Math.main(argv), f"error: {flag} does nothing here: {why}")
        assert not (tmp_path / "out").exists()
    # a recipe's values are its own: a soft recipe holding Sparse MoA's threshold and topk's k is not refused (the
    # run goes on to the next check, an accum_iter past the batches)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"variant": "soft", "max_threshold": 0.3, "top_k": 3, "lb_loss_coeff": 5.0,
                                  "const_threshold": True, "prompt_len": 4}))
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--recipe", recipe, "--accum_iter", 10**6],
                 ["cannot fill one optimizer step"])
    import Infer  # Infer.py's model flags too: with no adapter, no LoRA
    assert_refused(capsys, lambda: Infer.main(["--no_adapter", "--llama_path", tiny_base, "--data_path", addsub,
                                               "--output_dir", str(tmp_path / "eval"), "--lora_rank", "4"]),
                   "--lora_rank 4 does nothing here: no layer has LoRA")
    assert not (tmp_path / "eval").exists()


def test_compare_passes_a_flag_to_the_methods_it_does_something_in():
    """Flags after `--` are for every method: one that does nothing in a method's model (Math.py would refuse it)
    is left out of that method's Math.py command only."""
    import Compare
    args = Compare.get_args_parser().parse_args(["--", "--lora_rank", "4", "--p_adapter_size=8", "--swi_x", "2",
                                                 "--lb_loss_coeff", "0.01", "--val_data_path", "v.json"])
    flags = {method: Compare.method_flags(args, method) for method in ("sparse", "soft", "lora", "topk", "unipeft")}
    assert flags["sparse"][0] == ["--val_data_path", "v.json", "--lora_rank", "4", "--p_adapter_size", "8",
                                  "--swi_x", "2"] and list(flags["sparse"][1]) == ["lb_loss_coeff"]
    assert flags["soft"][0] == flags["sparse"][0]
    assert flags["lora"][0] == ["--val_data_path", "v.json", "--lora_rank", "4"]
    assert sorted(flags["lora"][1]) == ["lb_loss_coeff", "p_adapter_size", "swi_x"]
    assert flags["topk"][0] == ["--val_data_path", "v.json", "--lora_rank", "4", "--lb_loss_coeff", "0.01"]
    assert flags["unipeft"][0] == ["--val_data_path", "v.json", "--lora_rank", "4", "--p_adapter_size", "8"]
    assert "--swi_x" in Compare.commands(args, "sparse")["math"]
    assert "--swi_x" not in Compare.commands(args, "lora")["math"]
    Compare.check_math_flags(args)  # each does something in some method
    for methods, flag in [(["sparse", "lora"], "--p_adapter_hydra"), (["lora", "topk"], "--prompt_len=4")]:
        nowhere = Compare.get_args_parser().parse_args(["--methods", *methods, "--", flag])
        with pytest.raises(ValueError, match=f"{flag.split('=')[0]} after `--` does nothing in any method compared"):
            Compare.check_math_flags(nowhere)


def test_compare_refuses_flags_that_would_mislabel_its_rows(tmp_path, capsys):
    import Compare
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(["--methods", "molora", "--", "--expert_num", "4"], ["--expert_num", "molora preset"]),
             (["--methods", "hydralora", "--", "--no-hydra_moe"], ["--hydra_moe", "hydralora preset"]),
             (["--methods", "sparse", "soft", "--", "--variant=soft"], ["--variant", "sparse preset"]),
             (["--methods", "lora", "--", "--max_steps", "5"], ["--max_steps", "Compare.py itself"]),
             (["--methods", "lora", "--", "--output_dir", "x"], ["--output_dir", "Compare.py itself"]),
             (["--output_dir", str(a_file)], [str(a_file), "is a file"]),
             (["--output_dir", str(a_file / "sub")], ["which is a file"]),
             (["--ranks", "0"], ["--ranks"]), (["--methods", "nonesuch"], ["--methods", "invalid choice"])]
    addsub = DATA / "math" / "AddSub"
    cases += [(["--test_data", str(tmp_path / "nothere.json")], ["--test_data", "nothere.json", "no such"]),
              (["--data_path", str(tmp_path / "train.json")], ["--data_path", "without --test_data"]),
              (["--test_data", str(addsub), str(addsub / "test.json")], ["both data set 'AddSub'"])]
    for extra, needles in cases:
        out = [] if "--output_dir" in extra else ["--output_dir", str(tmp_path / "cmp")]
        assert_refused(capsys, lambda: Compare.main(out + extra), *needles)
        assert not (tmp_path / "cmp").exists()  # refused before any run
    # its output folder is its own: a table of the user's is not replaced, a training run's folder not taken
    make_entries(tmp_path / "mine", "compare.md", text="my table")
    make_entries(tmp_path / "trained", ".manifest.json", text='{"tool": "Math.py", "written": ["args.json"]}')
    for folder, needles in [("mine", ["compare.md", "which no run of the tools wrote"]),
                            ("trained", ["belongs to Math.py"])]:
        before = snapshot(tmp_path / folder)
        assert_refused(capsys, lambda: Compare.main(["--output_dir", str(tmp_path / folder), "--methods", "lora"]),
                       *needles)
        assert snapshot(tmp_path / folder) == before
    # a folder Compare.py wrote before it kept a manifest is its own: told by its table and its runs' logs
    make_entries(tmp_path / "earlier", "compare.md", "lora/compare.log", "base/compare.log",
                 text="$ python Math.py ...")
    (tmp_path / "earlier" / "compare.json").write_text(json.dumps({"note": "n", "rows": []}))
    Compare.claim_output_dir(Compare.get_args_parser().parse_args(["--output_dir", str(tmp_path / "earlier"),
                                                                   "--methods", "lora"]))
    assert json.loads((tmp_path / "earlier" / ".manifest.json").read_text())["written"] == [
        "base", "compare.json", "compare.md", "lora"]
