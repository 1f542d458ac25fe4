"""Only what a manifest lists is ever removed or overwritten, anywhere: the sweep of temp files and staging folders
that dead writers left (beside an evaluation folder, in a run folder and below), and scripts/compare_routers.py's
outputs and scripts/build_base.py's base, whose bad inputs are refused in one line (exit 2) with nothing written.
A folder another tool's manifest names is refused whole, by Math.py (--resume and --overwrite too) and
scripts/export_hf.py, which removes only what an earlier export wrote."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
from conftest import assert_refused, exit_code, infer_base_alone, make_entries, one_error_line, snapshot, train

import Infer
from Data.tiny_base import DEFAULT_BASE_DIR
from Models.formats.adapters import save_adapter
from Models.formats.base_model import base_args, build_model
from scripts import build_base, compare_routers, export_hf
from Utils import file_io, output_dirs


def dead_pid() -> int:
    """The pid of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def listed(folder, tool, *names):
    """`folder` with a manifest of `tool` listing `names`."""
    os.makedirs(folder, exist_ok=True)
    output_dirs.record_written(str(folder), tool, names)
    return folder


def test_the_sweep_removes_only_what_a_manifest_lists(tmp_path):
    dead = dead_pid()
    # beside an evaluation folder: a dead run's staging folder (its own manifest claims it) and an evaluation
    # folder it set aside (its manifest lists all it holds) go; the user's folders of the same form stay
    output_dirs.make_staging(str(tmp_path / f".tmp{dead}.eval"))
    make_entries(tmp_path / f".tmp{dead}.eval", "AddSub_predictions.jsonl")
    make_entries(listed(tmp_path / f".tmp{dead}.old-eval", "Infer.py", "scores.json"), "scores.json")
    make_entries(tmp_path, f".tmp{dead}.my_dataset_backup/data.json", f".tmp{dead}.notes.txt")
    make_entries(listed(tmp_path / f".tmp{dead}.kept", "Infer.py", "scores.json"), "scores.json", "mine.txt")
    # in a run folder and below: temp files of the entries its manifest lists, and any inside a listed folder
    run = listed(tmp_path / "run", "Math.py", "checkpoint-latest.pth", "checkpoint-best.pth", "adapter")
    make_entries(run, f".tmp{dead}.checkpoint-latest.pth", f".tmp{dead}..manifest.json",
                 f"adapter/.tmp{dead}.adapter.pth", f".tmp{dead}.notes.txt", f"notes/.tmp{dead}.draft",
                 file_io.temp_name("checkpoint-best.pth"))  # a live writer's: kept
    gone = [f".tmp{dead}.eval", f".tmp{dead}.old-eval", f"run/.tmp{dead}.checkpoint-latest.pth",
            f"run/.tmp{dead}..manifest.json", f"run/adapter/.tmp{dead}.adapter.pth"]
    kept = [f".tmp{dead}.my_dataset_backup/data.json", f".tmp{dead}.notes.txt", f".tmp{dead}.kept/mine.txt",
            f"run/.tmp{dead}.notes.txt", f"run/notes/.tmp{dead}.draft", f"run/{file_io.temp_name('checkpoint-best.pth')}"]
    removed = output_dirs.remove_stale_temp(str(tmp_path / "run")) + output_dirs.remove_stale_temp(str(tmp_path), False)
    assert sorted(os.path.relpath(p, tmp_path) for p in removed) == sorted(gone)
    assert not any((tmp_path / name).exists() for name in gone) and all((tmp_path / name).exists() for name in kept)


def test_an_evaluation_keeps_the_users_temp_named_folder_beside_it(tiny_base, addsub, tmp_path, monkeypatch):
    """The issue's case: a user's `.tmp3999999.my_dataset_backup/` beside --output_dir, its pid long dead."""
    assert not output_dirs.pid_alive(3999999)
    make_entries(tmp_path, ".tmp3999999.my_dataset_backup/test.json", text="[]")
    monkeypatch.setattr(Infer, "generate", lambda model, tok, prompts, *a, **k: [[] for _ in prompts])
    assert infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", addsub)["datasets"]["AddSub"]["total"] == 2
    assert (tmp_path / ".tmp3999999.my_dataset_backup" / "test.json").read_text() == "[]"


def weights_folder(folder, n_layers=2, n_examples=2, n_tokens=6):
    """type_weight.pkl and token_weight.pkl as Infer.py --save_weights writes them (Utils/weight_pickles.py) for a Sparse
    MoA of `n_layers` layers, each with the types Q and V, random weights; returns the folder."""
    rng = np.random.default_rng(n_layers)
    types = [["Q", "V"]] * n_layers
    for kind, columns in (("type_weight", 2), ("token_weight", 1)):
        examples = [{"dataset": "AddSub", "index": i, "token_ids": list(range(n_tokens)), "tokens": ["t"] * n_tokens,
                     "n_prompt": 3, "generation": "", "weights": [rng.random((n_tokens, columns), np.float32)
                                                                  for _ in types]} for i in range(n_examples)]
        make_entries(folder, f"{kind}.pkl", text="")
        with open(os.path.join(folder, f"{kind}.pkl"), "wb") as f:
            pickle.dump({"kind": kind, "method": "moa", "variant": "sparse", "layer_types": types,
                         "examples": examples}, f)
    return str(folder)


def test_compare_routers_writes_only_what_it_owns_and_refuses_bad_inputs(tmp_path, capsys):
    runs = [weights_folder(tmp_path / f"run{i}" / "eval") for i in range(2)]
    out = tmp_path / "out"

    def compare(*argv, folders=runs):
        return lambda: compare_routers.main([*folders, "--output_dir", str(out), *map(str, argv)])
    make_entries(out, "similarity.json", "router_comparison.png", text="mine")
    assert_refused(capsys, compare(), str(out), "similarity.json, router_comparison.png", "no run of the tools wrote")
    assert snapshot(out) == {"similarity.json": b"mine", "router_comparison.png": b"mine"}
    for name in ("similarity.json", "router_comparison.png"):
        os.remove(out / name)
    for _ in range(2):  # its own files, which the manifest lists, it replaces
        assert exit_code(compare()) is None
        assert json.loads((out / ".manifest.json").read_text())["written"] == ["router_comparison.png",
                                                                              "router_report.html", "similarity.json"]
    capsys.readouterr()
    written = snapshot(out)

    swapped = tmp_path / "swapped"
    shutil.copytree(runs[0], swapped)
    shutil.copy(swapped / "token_weight.pkl", swapped / "type_weight.pkl")
    cut = tmp_path / "cut"
    shutil.copytree(runs[0], cut)
    (cut / "type_weight.pkl").write_bytes((swapped / "token_weight.pkl").read_bytes()[:100])
    deeper = weights_folder(tmp_path / "deeper", n_layers=3)
    crafted = {}  # pickles that would call a function while they load: read through the allow-list, refused
    for name, payload in [("runs", (os.system, (f"touch {tmp_path / 'ran'}",))), ("calls", (dict.__getitem__,
                                                                                        ({}, "k")))]:
        crafted[name] = tmp_path / name
        shutil.copytree(runs[0], crafted[name])
        (crafted[name] / "type_weight.pkl").write_bytes(pickle.dumps(type("Crafted", (), {
            "__reduce__": lambda self, payload=payload: payload})()))
    cases = [(compare("--example", "-100"), ["--example", "'-100'"]),
             (compare("--example", "2"), ["--example 2", "holds 2 examples"]),
             (compare(folders=[str(swapped), runs[1]]), [str(swapped / "type_weight.pkl"), "kind 'token_weight'"]),
             (compare(folders=[str(cut), runs[1]]), [str(cut / "type_weight.pkl"), "not a --save_weights pickle"]),
             (compare(folders=[runs[0], deeper]), ["2 and 3 layers", deeper]),
             (compare(folders=[str(crafted["runs"]), runs[1]]), [str(crafted["runs"] / "type_weight.pkl"),
                                                                  "names posix.system"]),
             (compare(folders=[str(crafted["calls"]), runs[1]]), [str(crafted["calls"] / "type_weight.pkl"),
                                                                    "names builtins.getattr"])]
    damaged = {}  # what labels a run and marks its answers, damaged: the file named, and the line
    for name, path, text in [("args", "args.json", "[1, 2]"), ("params", "adapter/adapter_params.json", "{"),
                             ("predictions", "eval/synthetic_predictions.jsonl", '{"index": 0}\n[3]\n')]:
        damaged[name] = tmp_path / name
        shutil.copytree(runs[0], damaged[name] / "eval")
        os.makedirs((damaged[name] / path).parent, exist_ok=True)
        (damaged[name] / path).write_text(text)
    cases += [(compare(folders=[str(damaged["args"] / "eval"), runs[1]]),
               [str(damaged["args"] / "args.json"), "expected a JSON object"]),
              (compare(folders=[str(damaged["params"] / "eval"), runs[1]]),
               [str(damaged["params"] / "adapter" / "adapter_params.json"), "not valid JSON"]),
              (compare(folders=[str(damaged["predictions"] / "eval"), runs[1]]),
               [str(damaged["predictions"] / "eval" / "synthetic_predictions.jsonl"), "line 2 is not a JSON object"])]
    for call, needles in cases:
        assert_refused(capsys, call, *needles)
        assert snapshot(out) == written
    assert not (tmp_path / "ran").exists()


def edited_weights(folder, copy, kind: str, layer: int, change):
    """A copy of a weights folder whose `kind` pickle has example 1's entry changed: change(example, layer)."""
    shutil.copytree(folder, copy)
    path = os.path.join(copy, f"{kind}.pkl")
    with open(path, "rb") as f:
        data = pickle.load(f)
    change(data["examples"][1], layer)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return str(copy)


def test_compare_routers_checks_every_weight_before_writing(tmp_path, capsys):
    """Router weights of strings, objects, complex numbers or booleans, and examples keyed by what no run writes, are
    refused (exit 2) naming the file, the example and the layer; NaN or inf ones exit 3; and the output folder, which
    holds an earlier comparison, is left as it was (similarity.json was written before the figure failed)."""
    runs = [weights_folder(tmp_path / f"run{i}" / "eval") for i in range(2)]
    out = tmp_path / "out"
    assert compare_routers.main([*runs, "--output_dir", str(out)]) is None
    capsys.readouterr()
    written = snapshot(out)

    def weights(value):
        return lambda ex, layer: ex["weights"].__setitem__(layer, value(ex["weights"][layer]))
    cases = [("type_weight", lambda w: w.astype(str), 2, "dtype <U"),
             ("type_weight", lambda w: w.astype(object), 2, "dtype object"),
             ("type_weight", lambda w: w + 1j, 2, "dtype complex"), ("token_weight", lambda w: w > 0.5, 2, "dtype bool"),
             ("type_weight", lambda w: np.where(w > 0.5, np.nan, w), 3, "NaN or inf"),
             ("token_weight", lambda w: np.full_like(w, np.inf), 3, "NaN or inf")]
    for i, (kind, value, code, needle) in enumerate(cases):
        bad = edited_weights(runs[0], tmp_path / f"bad{i}", kind, 1, weights(value))
        assert_refused(capsys, lambda: compare_routers.main([bad, runs[1], "--output_dir", str(out)]),
                       f"{bad}/{kind}.pkl", "example 1 layer 1", needle, code=code)
        assert snapshot(out) == written
    for i, change in enumerate([lambda ex, _: ex.__setitem__("dataset", ["AddSub"]),
                                lambda ex, _: ex.__setitem__("token_ids", [[0]] * len(ex["token_ids"])),
                                lambda ex, _: ex.pop("index")]):
        bad = edited_weights(runs[0], tmp_path / f"keys{i}", "type_weight", 0, change)
        assert_refused(capsys, lambda: compare_routers.main([bad, runs[1], "--output_dir", str(out)]),
                       f"{bad}/type_weight.pkl", "example 1 has no dataset name, index, integer token_ids")
        assert snapshot(out) == written
    for i, fields in enumerate([{"method": ["moa"]}, {"variant": None}]):  # what labels the runs
        bad = tmp_path / f"named{i}"
        shutil.copytree(runs[0], bad)
        with open(bad / "type_weight.pkl", "rb") as f:
            data = pickle.load(f)
        with open(bad / "type_weight.pkl", "wb") as f:
            pickle.dump({**data, **fields}, f)
        assert_refused(capsys, lambda: compare_routers.main([str(bad), runs[1], "--output_dir", str(out)]),
                       f"{bad}/type_weight.pkl", "its method and variant are not names")
        assert snapshot(out) == written


def test_build_base_checks_its_options_and_writes_only_its_own_files(tmp_path, capsys):
    """Refused before the tokenizer trains: options the model's rules or the budget refuse, and an --out holding
    a file of the four it writes that no run of the tools wrote (a base of the user's); the shipped base's
    manifest lists its four, so it can be rebuilt in place."""
    mine = tmp_path / "mine"
    make_entries(mine, "params.json", text="my own base")
    cases = [(["--n_heads", "3"], ["dim=128", "n_heads=3"]), (["--minutes", "0"], ["--minutes 0", "positive"]),
             (["--bpe_vocab", "-5"], ["--bpe_vocab -5", "256 single bytes"]),
             (["--out", str(mine)], [str(mine), "params.json", "no run of the tools wrote"])]
    for extra, needles in cases:
        out = [] if "--out" in extra else ["--out", str(tmp_path / "new")]
        assert_refused(capsys, lambda: build_base.main(out + extra), *needles)
        assert not (tmp_path / "new").exists() and snapshot(mine) == {"params.json": b"my own base"}
    output_dirs.check_claimable(DEFAULT_BASE_DIR, build_base.FILES, "--out")  # the shipped base: claimed


# another tool's folders, as each leaves them (names its manifest lists)
FOLDERS = {"Math.py": ["args.json", "log.txt", "checkpoint-latest.pth", "adapter/adapter.pth", "data/train.json"],
           "Infer.py": ["AddSub_predictions.jsonl", "scores.json"], "Compare.py": ["compare.md", "lora/compare.log"],
           "scripts/export_hf.py": ["config.json", "moa_adapter.safetensors"],
           "scripts/compare_routers.py": ["similarity.json"], "scripts/build_base.py": ["params.json"]}


def tool_folder(folder, tool):
    make_entries(folder, *FOLDERS[tool])
    return listed(folder, tool, *dict.fromkeys(n.split("/")[0] for n in FOLDERS[tool]))


def test_a_run_never_takes_another_tools_folder(tiny_base, synthetic_data, tmp_path, capsys):
    """The issue's case: Math.py into an Infer.py folder, advised to resume, trained a fresh run there; now every
    other tool's folder is refused however asked, and --resume auto is offered only where a checkpoint is."""
    for tool in FOLDERS:
        if tool != "Math.py":
            folder = tool_folder(tmp_path / tool.replace("/", "_"), tool)
            before = snapshot(folder)
            for extra in ([], ["--resume", "auto"], ["--overwrite"]):
                assert train(tiny_base, synthetic_data, folder, "--max_steps", 1, *extra) == 2, (tool, extra)
                one_error_line(capsys.readouterr().err, str(folder), f"belongs to {tool}", "choose another")
                assert snapshot(folder) == before
    run = listed(tmp_path / "run", "Math.py", "args.json", "log.txt")
    make_entries(run, "args.json", "log.txt")
    for checkpoint in (False, True):  # a run stopped before its first checkpoint has nothing to resume
        assert train(tiny_base, synthetic_data, run, "--max_steps", 1) == 2
        err = capsys.readouterr().err
        one_error_line(err, "another run's files", "--overwrite")
        assert ("--resume auto" in err) == checkpoint, err
        make_entries(listed(run, "Math.py", "checkpoint-latest.pth"), "checkpoint-latest.pth")


def test_an_export_never_takes_another_tools_folder(tiny_qwen3, tmp_path, capsys):
    """The issue's case: `export_hf.py run/adapter run` deleted the run (the export removed every name the
    manifest listed, whichever tool wrote it). Into its own folder it removes what an earlier export wrote
    (peft's two files, before a MoA folder) and nothing else."""
    args = base_args(tiny_qwen3, max_seq_len=32, lora_rank=4, p_adapter_size=8, lora_layers="0-2",
                     p_adapter_layers="0-2")
    adapter = tmp_path / "run" / "adapter"
    save_adapter(build_model(tiny_qwen3, args), str(adapter))
    make_entries(listed(adapter.parent, "Math.py", "adapter", "args.json", "log.txt"), "args.json", "log.txt")
    (adapter.parent / "args.json").write_text("{}")  # the export reads the run's decoding from it
    for tool in FOLDERS:
        if tool != "scripts/export_hf.py":
            folder = adapter.parent if tool == "Math.py" else tool_folder(tmp_path / tool.replace("/", "_"), tool)
            before = snapshot(folder)
            assert_refused(capsys, lambda: export_hf.main([str(adapter), str(folder), "--base", tiny_qwen3]),
                           str(folder), f"belongs to {tool}")
            assert snapshot(folder) == before
    out = tmp_path / "export"
    make_entries(listed(out, "scripts/export_hf.py", "adapter_config.json", "adapter_model.safetensors"),
                 "adapter_config.json", "adapter_model.safetensors", "notes.txt")
    assert export_hf.main([str(adapter), str(out), "--base", tiny_qwen3]) is None
    assert "adapter_config.json" not in os.listdir(out) and (out / "notes.txt").read_text() == "old"
    assert set(os.listdir(out)) - set(output_dirs.read_manifest(str(out))["written"]) == {".manifest.json",
                                                                                         "notes.txt"}


def test_an_export_sweeps_what_a_killed_export_left(tiny_qwen3, tmp_path):
    """A kill -9 mid-export leaves its staging folder beside the folder (and, before staging, an 80 MB temp file
    inside it): the next export removes both, its writer being dead; a user's temp-named file stays."""
    args = base_args(tiny_qwen3, max_seq_len=32, lora_rank=4, lora_layers="0-2", p_adapter_layers="0-0")
    save_adapter(build_model(tiny_qwen3, args), str(tmp_path / "adapter"))
    dead, out = dead_pid(), tmp_path / "export"
    assert export_hf.main([str(tmp_path / "adapter"), str(out), "--base", tiny_qwen3]) is None
    output_dirs.make_staging(str(tmp_path / f".tmp{dead}.export"), export_hf.TOOL)
    make_entries(tmp_path, f".tmp{dead}.export/.tmp{dead}.moa_adapter.safetensors", f".tmp{dead}.mine.txt")
    make_entries(out, f".tmp{dead}.moa_adapter.safetensors")
    assert export_hf.main([str(tmp_path / "adapter"), str(out), "--base", tiny_qwen3]) is None
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".tmp")) == [f".tmp{dead}.mine.txt"]
    assert not [n for n in os.listdir(out) if n.startswith(".tmp")]
