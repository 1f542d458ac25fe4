"""Nothing lost, nothing silent: output folders owned by one run and only what the tools wrote ever removed,
every setting checked where it came from, every bad input refused before work starts with one line and a
documented exit code, no non-finite adapter ever saved or scored, interrupts and full disks that keep
what was written. Each class of refusal is tested on several inputs."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import REPO, log_records, math_argv, one_error_line, train

import Math
from Data import test_sets
from Data.prompts import format_prompt
from Models.generate import check_kv_cache_memory, kv_cache_bytes
from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.pth import load_pth
from Utils import misc, output_dirs

PYTHON = sys.executable
EVERY_STEP = ("--eval_interval", "1")  # validate and save checkpoint-latest after every step


def snapshot(folder):
    """{relative path: bytes} of every file but the lock."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name != output_dirs.LOCK_NAME:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, folder)] = f.read()
    return found


def exit_code(call):
    """What `call` returns, or the code it exits with."""
    try:
        return call()
    except SystemExit as e:
        return e.code


def tiny_adapter(folder, fill=0.0):
    """Our adapter files (adapter.pth, adapter_params.json) of a one-layer model, every tensor `fill`, written
    without running the model; returns its ModelArgs."""
    from Models.formats.adapters import write_adapter
    from Models.LLaMA_Adapter import LLaMA_adapter
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=61, multiple_of=16, lora_layers="0-1",
                     p_adapter_layers="0-1", p_adapter_size=8, swi_x=2)
    shapes = {name: p.shape for name, p in LLaMA_adapter(args).adapter_parameters().items()}
    write_adapter({name: np.full(shape, fill, np.float32) for name, shape in shapes.items()}, args.to_dict(), str(folder))
    return args


def math_refuses(tiny_base, synthetic_data, out, capsys, extra, needles):
    """Math.main with `extra` flags exits 2 with one `error:` line naming `needles`; `out` is left as it was."""
    before = snapshot(out) if os.path.exists(out) else None
    assert Math.main(math_argv(tiny_base, synthetic_data, str(out), "--max_steps", 1, *extra)) == 2, extra
    one_error_line(capsys.readouterr().err, *needles)
    assert (snapshot(out) if os.path.exists(out) else None) == before, extra


def make_entries(folder, *names, text="old"):
    """Files with `text` in `folder` (a name with a slash makes its folders too)."""
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def infer_base_alone(tiny_base, out, *extra):
    import Infer
    return exit_code(lambda: Infer.main(["--no_adapter", "--llama_path", tiny_base, "--output_dir", str(out),
                                         "--max_gen_len", "2", "--batch_size", "2", "--plot_examples", "0",
                                         *map(str, extra)]))


@pytest.fixture
def addsub(tmp_path):
    from Data.synthetic import make_splits
    make_entries(tmp_path / "AddSub", "test.json", text=json.dumps(make_splits(4, 0, 2, seed=0)[2]))
    return str(tmp_path / "AddSub" / "test.json")


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
    holder = subprocess.Popen([PYTHON, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from Utils.output_dirs import RunDir
        RunDir({out!r}, "holder-1").claim(None, False)
        print("locked", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
    cmd = [PYTHON, str(REPO / "Math.py"), *math_argv(tiny_base, synthetic_data, out, "--max_steps", 2)]
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


# ---- interrupts ------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_then_resume_is_bit_exact(tiny_base, synthetic_data, tmp_path):
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert train(tiny_base, synthetic_data, straight, "--max_steps", 3, *EVERY_STEP) == 0
    # the real Math.py, SIGKILLed halfway through writing its second checkpoint-latest.pth
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        import Utils.jittor_env
        Utils.jittor_env.block_stop_signals()
        import Models.formats.pth as torch_write
        import Math
        real, saves = torch_write.atomic_write, []
        def dying(path, write):
            if path.endswith("checkpoint-latest.pth"):
                saves.append(path)
                if len(saves) == 2:
                    tmp = os.path.join(os.path.dirname(path), Math.misc.temp_name(os.path.basename(path)))
                    write(tmp)
                    os.truncate(tmp, os.path.getsize(tmp) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(path, write)
        torch_write.atomic_write = dying
        sys.exit(Math.main(sys.argv[1:]))
        """)
    proc = subprocess.run([PYTHON, "-c", script, *math_argv(tiny_base, synthetic_data, killed, "--max_steps", 3, *EVERY_STEP)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [n for n in os.listdir(killed) if n.startswith(misc.TMP_PREFIX)]
    assert len(leftovers) == 1 and leftovers[0].endswith("checkpoint-latest.pth")
    assert load_pth(os.path.join(killed, "checkpoint-latest.pth"))["global_step"] == 1  # the last whole one

    assert train(tiny_base, synthetic_data, killed, "--max_steps", 3, "--resume", "auto", *EVERY_STEP) == 0
    assert not [n for n in os.listdir(killed) if n.startswith(misc.TMP_PREFIX)]  # removed at the start
    a = load_pth(os.path.join(straight, "adapter", "adapter.pth"))
    b = load_pth(os.path.join(killed, "adapter", "adapter.pth"))
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    ca, cb = (load_pth(os.path.join(d, "checkpoint-latest.pth")) for d in (straight, killed))
    assert ca["global_step"] == cb["global_step"] == 3
    assert all(ca["optimizer"]["m"][k].tobytes() == cb["optimizer"]["m"][k].tobytes() for k in a)


@pytest.mark.slow
def test_sigint_checkpoints_and_exits_130(tiny_base, synthetic_data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, str(REPO / "Math.py"), *math_argv(tiny_base, synthetic_data, str(out), "--epochs", 50)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None:  # until the first step is logged: SIGINT then falls inside the loop
            if (out / "log.txt").exists() and (out / "log.txt").read_text().count("\n") >= 1:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "stopped by SIGINT" in output and "Traceback" not in output and "quick exit" not in output
    steps = [r["step"] for r in log_records(out) if r["event"] == "train"]
    assert load_pth(out / "checkpoint-latest.pth")["global_step"] == steps[-1] >= 1
    assert not [n for n in os.listdir(out) if n.startswith(misc.TMP_PREFIX)]


# ---- bad input: one line, exit 2, nothing written ------------------------------------------

def edited_base(tiny_base, copy, **params):
    copy.mkdir()
    for name in os.listdir(tiny_base):
        os.symlink(os.path.join(tiny_base, name), copy / name)
    os.remove(copy / "params.json")
    with open(os.path.join(tiny_base, "params.json")) as f:
        (copy / "params.json").write_text(json.dumps({**json.load(f), **params}))
    return str(copy)


def test_bad_input_table(tiny_base, synthetic_data, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    n_words = Tokenizer(os.path.join(tiny_base, "tokenizer.model")).n_words
    cases = [  # (how to break it, what the one line must name)
        (lambda: ["--llama_path", edited_base(tiny_base, tmp_path / "str_dim", dim="128")],
         ["params.json", "dim", "'128'"]),
        (lambda: ["--output_dir", str(a_file)], [str(a_file), "is a file"]),
        (lambda: ["--output_dir", str(a_file / "run")], [str(a_file / "run"), "which is a file"]),
        (lambda: ["--llama_path", edited_base(tiny_base, tmp_path / "small_vocab", vocab_size=n_words - 1)],
         ["tokenizer.model", f"{n_words} token ids", f"vocab_size {n_words - 1}", "params.json"]),
        (lambda: ["--max_seq_len", "100"], ["validation set", synthetic_data["val"], "no example keeps a target token",
                                            "--max_seq_len 100"]),
        (lambda: ["--overwrite", "--resume", "auto"], ["--overwrite", "--resume"]),
    ]
    for make, needles in cases:  # later flags win; nothing written before the input is known to be good
        math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, make(), needles)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cut_examples_are_counted(tiny_base, synthetic_data, tmp_path, capsys):
    tok = Tokenizer(os.path.join(tiny_base, "tokenizer.model"))
    with open(synthetic_data["train"]) as f:
        rows = json.load(f)
    lengths = [len(tok.encode(format_prompt(r), bos=True, eos=False)) + len(tok.encode(r["output"], bos=False, eos=True))
               for r in rows]
    longer = sum(n > 180 for n in lengths)
    assert 0 < longer < len(rows)  # the data straddles the limit, so the count means something
    assert train(tiny_base, synthetic_data, str(tmp_path / "run"), "--max_steps", 1, "--max_seq_len", 180) == 0
    assert f"training: {longer} of {len(rows)} examples are longer than --max_seq_len 180" in capsys.readouterr().out


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
    assert not [n for n in os.listdir(out) if n.startswith(misc.TMP_PREFIX)]


def test_kv_cache_memory_check():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97)
    assert kv_cache_bytes(args, 8, 100_000) == 8 * 2 * 2 * 2 * 16 * 100_000 * 4 == 409_600_000
    check_kv_cache_memory(args, 8, 100_000, available=409_600_000)  # fits exactly
    with pytest.raises(ValueError, match=r"needs 0\.38 GiB, more than the 0\.38 GiB available.*--batch_size"):
        check_kv_cache_memory(args, 8, 100_000, available=409_599_999)
    # LLaMA-3-8B's shape: 32 layers, 8 kv heads of 128; batch 8 x 8192 tokens is 16 GiB in fp32
    big = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256)
    assert kv_cache_bytes(big, 8, 8192) == 16 * 2**30


def test_stale_temp_files_of_dead_writers_only():
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moa-stale-{os.getpid()}")
    os.makedirs(os.path.join(folder, "adapter"), exist_ok=True)
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    names = {f".tmp{dead_pid}.checkpoint-latest.pth": False, f"adapter/.tmp{dead_pid}.adapter.pth": False,
             misc.temp_name("scores.json"): True, "keep.tmp": True, ".tmpx.notours": True}
    for name in names:
        with open(os.path.join(folder, name), "w") as f:
            f.write("x")
    removed = misc.remove_stale_temp(folder)
    assert sorted(os.path.relpath(p, folder) for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert all(os.path.exists(os.path.join(folder, n)) == keep for n, keep in names.items())
    np.testing.assert_equal(len(os.listdir(folder)), 4)  # adapter/ and the three kept


# ---- settings: every value checked by its setting's declared rule, naming where it came from -----------

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
    for extra, field in [(["--precision", "bf16"], "precision"), (["--lora_alpha", "4"], "lora_alpha"),
                         (["--gamma_grad", "ste"], "gamma_grad"), (["--lr", "2e-2"], "lr")]:
        assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto", *extra) == 2, extra
        one_error_line(capsys.readouterr().err, "another configuration", f"{field}: ")
        assert snapshot(out) == saved  # args.json not rewritten
    # what a resumed run may change: its length, its logging, the decoding recorded for Infer.py
    assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto", "--log_interval", "5") == 0
    assert json.loads((out / "args.json").read_text())["log_interval"] == 5


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
    for extra, needles in cases:
        out = [] if "--output_dir" in extra else ["--output_dir", str(tmp_path / "cmp")]
        assert exit_code(lambda: Compare.main(out + extra)) == 2, extra
        one_error_line(capsys.readouterr().err, *needles)
        assert not (tmp_path / "cmp").exists()  # refused before any run


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
        assert infer_base_alone(tiny_base, out, "--data_path", addsub) == 2, names
        one_error_line(capsys.readouterr().err, str(out), "not an evaluation's results")
        assert snapshot(out) == before
    mount = tmp_path / "mount"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: p == str(mount) or real_ismount(p))
    assert infer_base_alone(tiny_base, mount, "--data_path", addsub) == 2
    one_error_line(capsys.readouterr().err, str(mount), "mount point")
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
    assert not [n for n in os.listdir(tmp_path) if n.startswith(misc.TMP_PREFIX)]


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
    assert exit_code(lambda: Infer.main(["--adapter_path", str(tmp_path / "run" / "adapter"), "--data_path", addsub,
                                         "--llama_path", tiny_base, "--output_dir", str(tmp_path / "eval")])) == 2
    one_error_line(capsys.readouterr().err, "adapter.pth", name, "NaN or inf")
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_non_finite_weights_stop_the_run_before_they_are_saved(tiny_base, synthetic_data, tmp_path, monkeypatch,
                                                               capsys):
    """Each way to non-finite numbers: exit 3 naming the step, nothing saved, checkpoint-latest the last finite."""
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
    cases = [(lambda: monkeypatch.setattr(AdamW, "step", poison_at(1)), [], "adapter weight(s) are not finite", 1, None),
             (lambda: monkeypatch.setattr(AdamW, "step", poison_at(3)), [], "adapter weight(s) are not finite", 3, 2),
             (lambda: monkeypatch.setattr(engine_finetune, "evaluate", nan_validation_at(2)), [],
              "validation loss is nan", 2, 1),
             (lambda: None, ["--lr", "1e30"], "validation loss is nan", 1, None)]  # a real overflow: huge weights
    for i, (patch, extra, message, step, saved_step) in enumerate(cases):
        out = tmp_path / f"run{i}"
        patch()
        assert train(tiny_base, synthetic_data, out, "--max_steps", 5, *EVERY_STEP, *extra) == 3, message
        err = capsys.readouterr().err
        one_error_line(err, message, f"at step {step} ", "checkpoint-latest.pth holds the last finite state")
        monkeypatch.undo()
        assert not (out / "adapter").exists()
        if (out / "adapter-best").exists():  # an earlier step's: finite (read_adapter refuses anything else)
            read_adapter(str(out / "adapter-best"))
        latest = out / "checkpoint-latest.pth"
        assert (load_pth(latest)["global_step"] if latest.exists() else None) == saved_step


# ---- data sets: every set and label scored by its rule, or refused before the first token -----------------

def test_labels_are_normalised_or_refused_by_their_rule():
    from Data.scoring import checked_labels
    good = [("boolq", ["True", "false", " FALSE ", "true"], ["true", "false", "false", "true"]),
            ("AQuA", ["b", " C", "E"], ["B", "C", "E"]),
            ("gsm8k", ["1,234", " 5 ", "-2.5", "3.0", "1,000,000"], ["1234", "5", "-2.5", "3.0", "1000000"]),
            ("piqa", ["solution2", "Solution1"], ["solution2", "solution1"]),
            ("winogrande", ["option1"], ["option1"]), ("synthetic", ["42"], ["42"])]
    for rule, labels, expected in good:
        assert checked_labels(rule, labels, "f.json", rule) == expected
    bad = [("boolq", ["true", "yes"], 1), ("piqa", ["solution1", "1"], 1), ("AQuA", ["A", "F"], 1),
           ("AQuA", ["AB"], 0), ("AddSub", ["3", "twelve"], 1), ("gsm8k", ["1.2.3"], 0), ("SVAMP", [""], 0),
           ("winogrande", ["option3"], 0), ("ARC-Easy", ["answer1", "A"], 1), ("hellaswag", ["ending5"], 0)]
    for rule, labels, index in bad:
        with pytest.raises(ValueError, match=f"f.json: example {index} of data set 'x' has the label"):
            checked_labels(rule, labels, "f.json", "x")


def test_two_data_sets_of_one_name_are_refused(tmp_path):
    make_entries(tmp_path, "a.json", "a/test.json", "a_2.json", "b/test.json", "root/b/test.json", "c/d/test.json",
                 "d.json", text=json.dumps([{"instruction": "q", "input": "", "output": "o", "answer": "1"}]))
    for paths, first, second in [(["a.json", "a", "a_2.json"], "a.json", "a/test.json"),
                                 (["b", "root"], "b/test.json", "root/b/test.json"),
                                 (["d.json", "c"], "d.json", "c/d/test.json"), (["a.json", "a.json"], "a.json", "a.json")]:
        with pytest.raises(ValueError, match="are both data set") as info:
            test_sets.load_test_sets(test_sets.data_files([str(tmp_path / p) for p in paths]), None)
        assert str(tmp_path / first) in str(info.value) and str(tmp_path / second) in str(info.value)
    found = test_sets.data_files([str(tmp_path / p) for p in ("a.json", "a_2.json", "b")])
    examples, sets = test_sets.load_test_sets(found, 1)
    assert [s.name for s in sets] == ["a", "a_2", "b"] and len(examples) == 3


def test_labels_are_checked_before_the_first_token_and_scored_normalised(tiny_base, tmp_path, monkeypatch, capsys):
    import Infer

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran before the labels were checked")
    monkeypatch.setattr(Infer, "generate", no_generation)
    rows = lambda name, *answers: json.dumps([{"instruction": f"{name} q{i}", "input": "", "output": "o",  # noqa: E731
                                               "answer": a} for i, a in enumerate(answers)])
    for name, answers, index in [("boolq", [True, "maybe"], 1), ("piqa", ["solution1", 1], 1), ("AQuA", ["F"], 0),
                                 ("AddSub", ["1,2,3.4.5"], 0)]:
        make_entries(tmp_path / "bad", f"{name}/test.json", text=rows(name, *answers))
        assert infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", tmp_path / "bad" / name) == 2
        one_error_line(capsys.readouterr().err, str(tmp_path / "bad" / name / "test.json"), f"example {index}",
                       f"data set '{name}'")
    # the authors' known variants, scored by what they mean: JSON booleans, a lower-case letter, "1,234"
    sets = {"boolq": ([True, False], "true"), "AQuA": (["b", "B"], "B"), "AddSub": (["1,234", "7"], "1234")}
    for name, (answers, _) in sets.items():
        make_entries(tmp_path / "good", f"{name}/test.json", text=rows(name, *answers))
    monkeypatch.setattr(Infer, "generate", lambda model, tok, prompts, *a, **k: [  # one answer to both questions
        tok.encode(next(said for name, (_, said) in sets.items() if f"\n{name} q" in tok.decode(p)), bos=False,
                   eos=False) for p in prompts])
    summary = infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", *(tmp_path / "good" / n for n in sets))
    assert {n: s["correct"] for n, s in summary["datasets"].items()} == {"boolq": 1, "AQuA": 2, "AddSub": 1}


def test_a_training_set_without_a_target_token_is_refused(tiny_base, synthetic_data, tmp_path, capsys):
    long = tmp_path / "long.json"
    long.write_text(json.dumps([{"instruction": "many words " * 200, "input": "", "output": "x", "answer": "1"}] * 8))
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--data_path", str(long)],
                 ["training set", str(long), "no example keeps a target token", "--max_seq_len 256"])
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys,
                 ["--data_path", str(long), "--val_data_path", str(long)], ["validation set", str(long)])


# ---- bases: a tensor in several shards is one tensor, or refused ---------------------------------------------

def test_duplicate_tensors_across_shards(tiny_meta, tmp_path):
    from Models.formats.base_model import build_model
    from Models.formats.pth import CheckpointError, save_pth
    full = load_pth(tiny_meta / "consolidated.00.pth")
    runtime = dict(max_seq_len=16, max_batch_size=1, precision="fp32")
    single = build_model(str(tiny_meta), ModelArgs.from_params_json(str(tiny_meta), **runtime))

    def base(name, shards):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "params.json").write_text((tiny_meta / "params.json").read_text())
        for i, shard in enumerate(shards):
            save_pth(shard, folder / f"consolidated.0{i}.pth", bf16=True)
        return str(folder)
    same = build_model(base("same", [full, dict(full)]), single.args)  # two equal copies: read once
    assert all(np.array_equal(v.numpy(), same.base_parameters()[n].numpy()) for n, v in single.base_parameters().items())
    other = {**full, "layers.1.attention.wv.weight": full["layers.1.attention.wv.weight"] + 1}
    halves = [{k: (v if "norm" in k else np.array_split(v, 2, axis=0)[i]) for k, v in full.items()} for i in range(2)]
    halves[1]["norm.weight"] = halves[1]["norm.weight"] * 2  # a replicated norm that differs between the shards
    for name, shards, tensor in [("other", [full, other], "layers.1.attention.wv.weight"),
                                 ("three", [full, full, other], "layers.1.attention.wv.weight"),
                                 ("split", halves, "norm.weight")]:
        folder = base(name, shards)
        with pytest.raises(CheckpointError, match=f"hold different copies of '{tensor}'") as info:
            build_model(folder, single.args)
        assert os.path.join(folder, "consolidated.00.pth") in str(info.value)


# ---- bounded reading: sizes checked before a byte is read; a blocked read still ends on Ctrl-C -------------

def rezipped(source, target, deflate=(), replace=None):
    """`source` (a torch zip) copied to `target`, the records named in `deflate` compressed and those in
    `replace` ({name suffix: bytes}) swapped for other bytes."""
    import zipfile
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = next((v for k, v in (replace or {}).items() if info.filename.endswith(k)), None)
            data = src.read(info) if data is None else data
            method = zipfile.ZIP_DEFLATED if any(info.filename.endswith(d) for d in deflate) else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), data, compress_type=method)
    return str(target)


def test_a_records_declared_size_is_checked_before_it_is_read(tmp_path):
    import tracemalloc
    from Models.formats.pth import CheckpointError, save_pth
    plain = tmp_path / "plain.pth"
    save_pth({"w": np.zeros(16 << 20, np.float32)}, plain)  # 64 MB of zeros: deflate makes them about 64 KB
    import pickle
    huge_pickle = b"\x80\x02" + pickle.dumps("x" * (64 << 20), protocol=2)[2:]  # a 64 MB string as data.pkl
    cases = [(rezipped(plain, tmp_path / "bomb.pth", deflate=["data/0"]), "storage '0' declares", False),
             (rezipped(plain, tmp_path / "bomb.pth", deflate=["data/0"]), "compressed or has", True),
             (rezipped(plain, tmp_path / "pkl.pth", deflate=["data.pkl"], replace={"data.pkl": huge_pickle}),
              "data.pkl' declares", False),
             (rezipped(plain, tmp_path / "order.pth", replace={"byteorder": b"little" * 4096}),
              "byteorder' declares 24576 bytes", False),
             (rezipped(plain, tmp_path / "short.pth", replace={"data/0": b"\0" * 64}), "has 64 bytes, expected", False)]
    for path, message, lazy in cases:
        tracemalloc.start()
        with pytest.raises(CheckpointError, match=message) as info:
            load_pth(path, lazy=lazy)["w"].numpy() if lazy else load_pth(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert path in str(info.value) and peak < 8 << 20, (message, peak)  # never the 64 MB it declares
    fifo = tmp_path / "fifo.pth"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):  # no writer: an open would block
        load_pth(fifo)


def wait_for_open(proc, path, timeout=120):
    """Until process `proc` holds `path` open (it is blocked reading it), or it ends."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        fds = f"/proc/{proc.pid}/fd"
        try:
            if any(os.readlink(os.path.join(fds, fd)) == str(path) for fd in os.listdir(fds)):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"process never opened {path}")


@pytest.mark.slow
@pytest.mark.parametrize("program, stop, code", [("Math.py", signal.SIGINT, 130), ("Math.py", signal.SIGTERM, 143),
                                                 ("Infer.py", signal.SIGTERM, 143)])
def test_a_stop_signal_ends_a_run_blocked_on_its_input(tiny_base, synthetic_data, tmp_path, program, stop, code):
    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)  # a writer that never comes
    out = tmp_path / "out"
    args = (math_argv(tiny_base, {**synthetic_data, "train": str(fifo)}, out) if program == "Math.py" else
            ["--no_adapter", "--llama_path", tiny_base, "--data_path", str(fifo), "--output_dir", str(out)])
    proc = subprocess.Popen([PYTHON, str(REPO / program), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_open(proc, fifo)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)  # the poll interval is 0.2 s
    finally:
        proc.kill()
    assert proc.returncode == code, err
    one_error_line(err, f"stopped by {signal.Signals(stop).name}", "nothing was written")
    assert not out.exists()


@pytest.mark.slow
def test_bench_scripts_refuse_bad_arguments_in_one_line(tmp_path):
    cases = [(["bench/scale.py", "--n_layers", "0"], ["--n_layers 0"]),
             (["bench/scale.py", "--variants", "sparse,dense"], ["--variants", "dense"]),
             (["bench/scale.py", "--llama_path", str(tmp_path)], ["--llama_path", "neither params.json", "nor config.json"]),
             (["bench/scale.py", "--tmp_dir", str(tmp_path / "none")], ["--tmp_dir"]),
             (["bench/bench.py", "--lora_rank", "0"], ["--lora_rank must be at least 1"]),
             (["bench/bench.py", "--max_threshold", "nan"], ["--max_threshold must be a finite number"]),
             (["bench/bench.py", "--config", "huge"], ["--config", "invalid choice"]),
             (["bench/bench.py", "--preset", "dora"], ["--preset", "invalid choice"]),
             (["bench/side_by_side.py", "--configs", "huge"], ["--configs"]),
             (["bench/side_by_side.py", "--against", "peft"], ["REFVENV"]),
             (["bench/side_by_side.py", "--against", "peft", "--variants", "soft"], ["--variants", "plain LoRA"]),
             (["bench/peft_bench.py", "--lora_targets", "Q,W"], ["--lora_targets", "Q,W"]),
             (["bench/peft_bench.py", "--lora_rank", "0"], ["--lora_rank must be at least 1"])]
    for argv, needles in cases:
        done = subprocess.run([PYTHON, str(REPO / argv[0]), *argv[1:]], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "REFVENV": ""})
        assert done.returncode == 2, (argv, done.stderr)
        one_error_line(done.stderr, *needles)


def test_side_by_side_gives_no_ratios_for_different_work(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the bench scripts import bench/common.py by name
    from common import describe_optimizer
    from side_by_side import SAME_WORK, same_work
    ours = {"trainable_params": "118784", "base_params": "5048576", "train_tokens": "2048", "loss_tokens": "2040",
            "decode_tokens": "256", "optimizer": describe_optimizer("AdamW", [(118784, 1e-4, (0.9, 0.95), 1e-8, 0.05)]),
            "lora_rank": "8", "lora_alpha": "8", "lora_targets": "Q,K,V,O,FFN_UP,FFN_DOWN"}
    assert set(ours) == set(SAME_WORK)
    assert same_work(dict(ours), ours)[0] == []
    no_decay = describe_optimizer("AdamW", [(118784, 1e-4, (0.9, 0.95), 1e-8, 0.0)])
    differs, line = same_work({**ours, "optimizer": no_decay, "loss_tokens": "2048"}, ours)
    assert differs == ["loss_tokens", "optimizer"]
    assert line.startswith("DIFFERENT WORK") and "loss_tokens=2048|ours:2040" in line
