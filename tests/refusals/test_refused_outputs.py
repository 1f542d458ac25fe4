"""Output folders: one run per folder and only what the tools wrote (their manifests) ever replaced or removed;
an evaluation's results replaced whole; a full or read-only disk is one line (exit 4) and keeps what was written;
no non-finite adapter ever saved or scored (exit 3 in training). The temp sweep: test_owned_files.py."""
import errno
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import (REPO, assert_refused, exit_code, infer_base_alone, log_records, make_entries, math_argv,
                      math_refuses, one_error_line, python_program, snapshot, tiny_adapter, train)

from Data.synthetic import make_splits
from Models.ModelArgs import ModelArgs
from Models.formats.pth import load_pth
from Utils import file_io, output_dirs

EVERY_STEP = ("--eval_interval", "1")  # validate and save checkpoint-latest after every step
LOCK_HOLDER = """
import sys; sys.path.insert(0, sys.argv[1])
from Utils.output_dirs import RunDir
RunDir(sys.argv[2], "holder-1").claim(None, False)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    """Two tiny data sets, math-scored, under names of their own folders."""
    root = tmp_path_factory.mktemp("sets")
    paths = {}
    for i, name in enumerate(("AddSub", "SVAMP")):
        make_entries(root / name, "test.json", text=json.dumps(make_splits(4, 0, 2, seed=i)[2]))
        paths[name] = str(root / name / "test.json")
    return paths


# ---- one run per folder ---------------------------------------------------------------

@pytest.mark.slow
def test_a_new_run_never_replaces_another_runs_files(tiny_base, synthetic_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 0
    first = snapshot(out)
    first_id = {r["run"] for r in log_records(out)}
    assert len(first_id) == 1 and "" not in first_id
    capsys.readouterr()
    assert train(tiny_base, synthetic_data, out, "--max_steps", 2) == 2
    one_error_line(capsys.readouterr().err, out, "another run's files", "--resume auto", "--overwrite")
    assert snapshot(out) == first  # nothing touched, log.txt included

    assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto") == 0  # continuing it is fine
    ids = [r["run"] for r in log_records(out)]
    assert ids[0] in first_id and len(set(ids)) == 2  # every line says which run wrote it
    assert json.load(open(os.path.join(out, "args.json")))["run_id"] == ids[-1]

    os.makedirs(os.path.join(out, "eval"))
    with open(os.path.join(out, "eval", "scores.json"), "w") as f:
        f.write("{}")  # an evaluation of the adapter about to be replaced, as Infer.py leaves it
    output_dirs.record_written(os.path.join(out, "eval"), output_dirs.INFER, ["scores.json"])
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")  # no manifest lists it: never removed
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1, "--overwrite") == 0  # replacing it must be asked for
    assert not os.path.exists(os.path.join(out, "eval"))
    assert open(os.path.join(out, "notes.txt")).read() == "mine"
    ids = {r["run"] for r in log_records(out)}
    assert len(ids) == 1 and not ids & first_id  # nothing of the earlier runs is left to mix in
    assert load_pth(os.path.join(out, "checkpoint-latest.pth"))["global_step"] == 1


@pytest.mark.slow
def test_a_live_run_holds_its_folder(tiny_base, synthetic_data, tmp_path, capsys):
    """The lock: a second run is refused while the first lives; a killed holder leaves nothing stuck."""
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(REPO), out], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 2
        one_error_line(capsys.readouterr().err, "is in use by another run", f"{holder.pid} holder-1")
        assert sorted(os.listdir(out)) == [output_dirs.LOCK_NAME]  # the refused run wrote nothing
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 0


@pytest.mark.slow
def test_two_runs_started_into_one_folder(tiny_base, synthetic_data, tmp_path):
    """Two real Math.py processes at once: one trains, the other stops with exit 2 and writes nothing."""
    out = str(tmp_path / "run")
    cmd = python_program("Math.py", *math_argv(tiny_base, synthetic_data, out, "--max_steps", 2))
    logs = [tmp_path / f"stderr{i}.txt" for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w")) for log in logs]
    codes = [p.wait(timeout=600) for p in procs]
    errs = [log.read_text() for log in logs]
    assert sorted(codes) == [0, 2], (codes, errs)
    refused = errs[codes.index(2)]
    # while the other lives: the lock; had it already ended: its files
    assert ("is in use by another run" in refused or "another run's files" in refused) \
        and "Traceback" not in refused, refused
    assert len({r["run"] for r in log_records(out)}) == 1
    assert [r["step"] for r in log_records(out) if r["event"] == "train"] == [1, 2]


# ---- what a run removes or overwrites: only what a manifest of the tools lists ----------------------------

def test_overwrite_removes_only_what_the_tools_wrote(tmp_path):
    run = tmp_path / "run"
    make_entries(run, "args.json", "log.txt", "checkpoint-latest.pth", "adapter/adapter.pth",  # an earlier run's
                 "eval/scores.json",  # an evaluation wholly the tools' (its own manifest)
                 "eval_mine/scores.json", "eval_mine/notes.txt",  # an evaluation the user added to
                 "notes.txt", "figs/a.png", "mine.pth")  # the user's
    output_dirs.record_written(str(run), "Math.py", ["args.json", "log.txt", "checkpoint-latest.pth", "adapter",
                                                     "tensorboard"])  # tensorboard: listed, never written
    for folder in ("eval", "eval_mine"):
        output_dirs.record_written(str(run / folder), output_dirs.INFER, ["scores.json"])
    claim = output_dirs.RunDir(str(run), "r2")
    claim.claim(None, True)
    claim.release()
    assert sorted(os.listdir(run)) == [".lock", ".manifest.json", "eval_mine", "figs", "mine.pth", "notes.txt"]
    assert sorted(os.listdir(run / "eval_mine")) == [".manifest.json", "notes.txt", "scores.json"]
    assert output_dirs.read_manifest(str(run))["written"] == []


def test_a_run_refuses_to_write_over_or_remove_what_it_did_not_make(tiny_base, synthetic_data, tmp_path, capsys):
    run = tmp_path / "run"
    make_entries(run, "adapter/adapter.pth", "data/train.json", "args.json", "recipe.json")
    output_dirs.record_written(str(run), "Math.py", ["adapter", "data", "args.json", "recipe.json"])
    (run / "recipe.json").write_text(json.dumps({"epochs": 1}))
    cases = [  # inputs of the run inside what --overwrite removes: refused before any work
        (["--overwrite", "--init_adapter", str(run / "adapter")], [str(run / "adapter"), "--init_adapter"]),
        (["--overwrite", "--init_adapter", str(run / "adapter" / "adapter.pth")], [str(run / "adapter")]),
        (["--overwrite", "--data_path", str(run / "data" / "train.json")], [str(run / "data"), "train.json"]),
        (["--overwrite", "--recipe", str(run / "recipe.json")], [str(run / "recipe.json"), "--recipe"]),
    ]
    (tmp_path / "link").symlink_to(run / "data")  # the same input through a link
    cases.append((["--overwrite", "--data_path", str(tmp_path / "link" / "train.json")], [str(run / "data")]))
    for extra, needles in cases:
        math_refuses(tiny_base, synthetic_data, run, capsys, extra, ["--overwrite would delete", *needles])
    mine = tmp_path / "mine"  # names a run writes, held by files no manifest lists: refused, --overwrite or not
    for i, name in enumerate(["log.txt", "tensorboard/events", "checkpoint-best.pth", "adapter-best/x"]):
        make_entries(mine / str(i), name, text="mine")
        for extra in ([], ["--overwrite"]):
            math_refuses(tiny_base, synthetic_data, mine / str(i), capsys, extra,
                         [str(mine / str(i)), name.split("/")[0], "no run of the tools wrote"])


def test_an_evaluation_replaces_only_an_evaluations_folder(tiny_base, addsub, tmp_path, monkeypatch, capsys):
    cases = [  # (what the folder holds, what its manifest lists and who wrote it)
        (["a.png", "b.png"], None), (["scores.json", "AddSub_predictions.jsonl"], None),
        (["scores.json", "notes.txt"], ("Infer.py", ["scores.json"])),
        (["args.json", "log.txt"], ("Math.py", ["args.json", "log.txt"])),  # a training run's folder
    ]
    for i, (names, manifest) in enumerate(cases):
        out = tmp_path / f"out{i}"
        make_entries(out, *names)
        if manifest:
            output_dirs.record_written(str(out), *manifest)
        before = snapshot(out)
        assert_refused(capsys, lambda: infer_base_alone(tiny_base, out, "--data_path", addsub), str(out),
                       "not an evaluation's results")
        assert snapshot(out) == before
    mount = tmp_path / "mount"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: p == str(mount) or real_ismount(p))
    assert_refused(capsys, lambda: infer_base_alone(tiny_base, mount, "--data_path", addsub), str(mount), "mount point")
    with pytest.raises(output_dirs.RunDirError, match="this run reads"):  # an input inside what is replaced
        output_dirs.eval_dir(str(tmp_path / "eval"), [("--data_path", str(tmp_path / "eval" / "test.json"))])


def test_a_symlinked_evaluation_folder_is_followed(tiny_base, addsub, tmp_path, monkeypatch):
    import Infer
    monkeypatch.setattr(Infer, "generate", lambda model, tok, prompts, *a, **k: [[] for _ in prompts])
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    for _ in range(2):  # into the empty target, then replacing the evaluation it holds
        assert infer_base_alone(tiny_base, link, "--data_path", addsub)["datasets"]["AddSub"]["total"] == 2
        assert link.is_symlink() and sorted(os.listdir(link)) == [".manifest.json", "AddSub_predictions.jsonl",
                                                                  "scores.json"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(file_io.TMP_PREFIX)]


@pytest.mark.slow
def test_results_are_replaced_whole_never_mixed(tiny_base, two_sets, tmp_path, capsys):
    out = tmp_path / "eval"
    summary = infer_base_alone(tiny_base, out, "--data_path", two_sets["AddSub"], two_sets["SVAMP"])
    assert sorted(summary["datasets"]) == ["AddSub", "SVAMP"]
    assert sorted(os.listdir(out)) == [".manifest.json", "AddSub_predictions.jsonl", "SVAMP_predictions.jsonl",
                                       "scores.json"]
    summary = infer_base_alone(tiny_base, out, "--data_path", two_sets["AddSub"])
    # the earlier evaluation's SVAMP results go with it: scores.json and the predictions always agree
    assert sorted(os.listdir(out)) == [".manifest.json", "AddSub_predictions.jsonl", "scores.json"]
    assert json.loads((out / ".manifest.json").read_text()) == {
        "tool": "Infer.py", "written": ["AddSub_predictions.jsonl", "scores.json"]}
    assert sorted(json.loads((out / "scores.json").read_text())["datasets"]) == ["AddSub"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(file_io.TMP_PREFIX)]  # no staging left

    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert_refused(capsys, lambda: infer_base_alone(tiny_base, out, "--data_path", two_sets["SVAMP"]), str(out),
                   "notes.txt", "not an evaluation's results")
    assert snapshot(out) == before


def test_conversions_never_write_over_their_source_or_the_users_files(tmp_path, monkeypatch, capsys):
    from scripts import authors_adapter
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    tiny_adapter(ours)
    convert = lambda *argv: exit_code(lambda: authors_adapter.main([*map(str, argv)]))  # noqa: E731
    assert convert("export", ours, theirs / "adapter.pth") is None
    base = tmp_path / "base"
    make_entries(base, "params.json", text=json.dumps({k: v for k, v in json.loads(
        (ours / "adapter_params.json").read_text()).items() if k in ("dim", "n_layers", "n_heads", "vocab_size",
                                                                         "multiple_of")}))
    before = {folder: snapshot(folder) for folder in (ours, theirs)}
    for argv, needles in [(("export", ours, ours / "theirs.pth"), [str(ours / "adapter_params.json"), "reads"]),
                          (("export", ours, ours / "adapter.pth"), [str(ours / "adapter.pth")]),
                          (("export", ours, theirs), [str(theirs), "is a folder", "name the .pth file"]),
                          (("export", tmp_path / "nothing", tmp_path / "x.pth"), ["nothing", "no such adapter"]),
                          (("import", theirs / "adapter.pth", theirs, "--llama_path", base), ["theirs", "reads"])]:
        assert convert(*argv) == 2, argv
        one_error_line(capsys.readouterr().err, *needles)
        assert {folder: snapshot(folder) for folder in (ours, theirs)} == before
    users = tmp_path / "users"
    make_entries(users, "adapter_params.json", text="mine")
    assert convert("export", ours, users / "adapter.pth") == 2
    one_error_line(capsys.readouterr().err, "adapter_params.json", "no run of the tools wrote")
    assert (users / "adapter_params.json").read_text() == "mine" and not (users / "adapter.pth").exists()
    assert convert("export", ours, theirs / "adapter.pth") is None  # its own earlier export: replaced
    for failure in (errno.ENOSPC, errno.EROFS):  # a full or read-only disk: one line, exit 4, the earlier files
        def failing(*args, failure=failure):
            raise OSError(failure, os.strerror(failure))
        monkeypatch.setattr(os, "replace", failing)
        assert convert("export", ours, theirs / "adapter.pth") == 4
        one_error_line(capsys.readouterr().err, str(theirs / "adapter.pth"), os.strerror(failure))
        monkeypatch.undo()
        assert snapshot(theirs) == before[theirs]


# ---- full disks and temporary files ------------------------------------------------------------------

@pytest.mark.slow
def test_full_disk_is_one_line_and_keeps_what_was_written(tiny_base, synthetic_data, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 0
    saved = snapshot(out)
    real_fsync = os.fsync

    def full_disk(fd):
        if "checkpoint-latest" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", full_disk)
    capsys.readouterr()
    assert train(tiny_base, synthetic_data, out, "--max_steps", 3, "--resume", "auto") == 4
    one_error_line(capsys.readouterr().err, os.path.join(out, "checkpoint-latest.pth"), "No space left on device")
    assert snapshot(out)["checkpoint-latest.pth"] == saved["checkpoint-latest.pth"]  # the last whole one
    assert not [n for n in os.listdir(out) if n.startswith(file_io.TMP_PREFIX)]


@pytest.mark.slow
def test_a_failed_write_keeps_the_earlier_results(tiny_base, two_sets, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    infer_base_alone(tiny_base, out, "--data_path", two_sets["AddSub"])
    before = snapshot(out)
    real_fsync = os.fsync

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("scores.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", full_disk)
    capsys.readouterr()
    both = ["--data_path", two_sets["AddSub"], two_sets["SVAMP"]]
    assert_refused(capsys, lambda: infer_base_alone(tiny_base, out, *both), "scores.json", "No space left on device",
                   code=4)
    assert snapshot(out) == before  # the SVAMP predictions already written stayed in the staging folder
    assert not [n for n in os.listdir(tmp_path) if n.startswith(file_io.TMP_PREFIX)]


# ---- finite weights: no non-finite adapter is ever written or scored ---------------------------------------

def test_nonfinite_count_fused_equals_plain():
    import jittor as jt
    from Models.kernels.finite import nonfinite_count
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (64, 33), (1,)] * 20  # 80 tensors: two fused ops
    for bad in [{}, {0: [np.nan]}, {79: [np.inf]}, {2: [-np.inf, np.nan, np.inf]}, {5: [np.nan], 70: [np.nan] * 4}]:
        arrays = [rng.standard_normal(s).astype(np.float32) * 1e30 for s in shapes]  # large but finite
        for index, values in bad.items():
            arrays[index].reshape(-1)[:len(values)] = values
        tensors = [jt.array(a) for a in arrays]
        expected = sum(len(v) for v in bad.values())
        assert nonfinite_count.fused(tensors).item() == nonfinite_count.plain(tensors).item() == expected, bad


def test_a_non_finite_adapter_is_refused_everywhere(tiny_base, addsub, tmp_path, capsys):
    from Models.formats.adapters import NonFiniteAdapter, check_finite, export_authors_adapter, read_adapter
    from Models.formats.adapters import write_adapter
    from Models.LLaMA_Adapter import LLaMA_adapter
    for fill in (np.nan, np.inf, -np.inf):
        tiny_adapter(tmp_path / "bad", fill=fill)
        for read in (lambda: read_adapter(str(tmp_path / "bad")),
                     lambda: export_authors_adapter(str(tmp_path / "bad"), str(tmp_path / "theirs" / "adapter.pth"))):
            with pytest.raises(NonFiniteAdapter, match=r"adapter.pth: \d+ adapter tensor\(s\) hold NaN or inf"):
                read()
        assert not (tmp_path / "theirs").exists()
    arrays = {"a": np.ones(3, np.float32), "b": np.array([1, np.nan], np.float32)}
    with pytest.raises(NonFiniteAdapter, match=r"'b' \(1 of 2\)"):
        check_finite(arrays, "x")
    args = ModelArgs.from_params_json(tiny_base, lora_layers="0-2", p_adapter_layers="0-2")  # Infer.py scores none
    arrays = {n: np.zeros(p.shape, np.float32) for n, p in LLaMA_adapter(args).adapter_parameters().items()}
    name = sorted(arrays)[3]
    arrays[name][0] = np.inf
    write_adapter(arrays, args.to_dict(), str(tmp_path / "run" / "adapter"))
    import Infer
    argv = ["--adapter_path", str(tmp_path / "run" / "adapter"), "--data_path", addsub, "--llama_path", tiny_base,
            "--output_dir", str(tmp_path / "eval")]
    assert_refused(capsys, lambda: Infer.main(argv), "adapter.pth", name, "NaN or inf")
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_non_finite_weights_stop_the_run_before_they_are_saved(tiny_base, synthetic_data, tmp_path, monkeypatch,
                                                               capsys):
    """Each way to non-finite numbers (weights, the training loss, the validation loss): exit 3 naming the step,
    nothing saved, checkpoint-latest the last finite."""
    import engine_finetune
    from Models.formats.adapters import read_adapter
    from Models.kernels.adamw import AdamW
    real_step, real_evaluate = AdamW.step, engine_finetune.evaluate

    def poison_at(step):
        def stepping(self, *args):
            real_step(self, *args)
            if self.updates == step:  # one weight of the update goes bad
                p = self.param_groups[0]["params"][0]
                p.update(p * float("nan"))
        return stepping
    val_calls = []

    def nan_validation_at(call):
        return lambda model, ds: val_calls.append(1) or (float("nan") if len(val_calls) == call else
                                                         real_evaluate(model, ds))
    real_reduce, reductions = engine_finetune.all_reduce_sum, []

    def nan_loss_at(step):
        def reduce(values):
            result = real_reduce(values)
            if len(values) > 2:  # the per-step reduction (validation sums two values)
                reductions.append(1)
                if len(reductions) == step:
                    result[0] = math.nan
            return result
        return reduce
    # an update that fails from finite gradients names the tensor and advises no setting
    poisoned = ("adapter weights not finite after the update", "of them, largest |gradient|",
                "their gradients were finite, so the update itself failed")
    cases = [(lambda: monkeypatch.setattr(AdamW, "step", poison_at(1)), [], poisoned, 1, None),
             (lambda: monkeypatch.setattr(AdamW, "step", poison_at(3)), [], poisoned, 3, 2),
             (lambda: monkeypatch.setattr(engine_finetune, "evaluate", nan_validation_at(2)), [],
              "validation loss is nan", 2, 1),
             (lambda: monkeypatch.setattr(engine_finetune, "all_reduce_sum", nan_loss_at(4)), [],
              "training loss is nan", 4, 3),
             (lambda: None, ["--lr", "1e30"], "validation loss is nan", 1, None)]  # a real overflow: huge weights
    for i, (patch, extra, message, step, saved_step) in enumerate(cases):
        out = tmp_path / f"run{i}"
        patch()
        assert train(tiny_base, synthetic_data, out, "--max_steps", 5, *EVERY_STEP, *extra) == 3, message
        err = capsys.readouterr().err
        kept = "no checkpoint was saved yet" if saved_step is None else "checkpoint-latest.pth holds the last finite state"
        one_error_line(err, *((message,) if isinstance(message, str) else message), f"at step {step} ", kept)
        lr_acted = step > 1 or "validation" in str(message)  # a validation loss is after its step's update
        assert ("lower --blr/--lr" in err) == (isinstance(message, str) and lr_acted), err  # only where it can help
        monkeypatch.undo()
        assert not (out / "adapter").exists()
        if (out / "adapter-best").exists():  # an earlier step's: finite (read_adapter refuses anything else)
            read_adapter(str(out / "adapter-best"))
        latest = out / "checkpoint-latest.pth"
        assert (load_pth(latest)["global_step"] if latest.exists() else None) == saved_step
