"""Nothing lost, nothing silent: output folders owned by one run, every bad input refused before work
starts with one line and a documented exit code, interrupts and full disks that keep what was written."""
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
from conftest import REPO

import Math
from Data.prompts import format_prompt
from Models.generate import check_kv_cache_memory, kv_cache_bytes
from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.pth import load_pth
from Utils import misc, output_dirs

PYTHON = sys.executable
TINY = ["--max_seq_len", "256", "--batch_size", "4", "--lora_rank", "4", "--p_adapter_size", "8", "--swi_x", "2",
        "--warmup_epochs", "0", "--log_interval", "1", "--eval_interval", "1", "--lr", "1e-2"]


def argv(tiny_base, synthetic_data, out, *extra):
    return [str(a) for a in ["--llama_path", tiny_base, "--data_path", synthetic_data["train"],
                             "--val_data_path", synthetic_data["val"],
                             "--output_dir", out, *TINY, *extra]]


def train(tiny_base, synthetic_data, out, *extra):
    return Math.main(argv(tiny_base, synthetic_data, out, *extra))


def log_lines(out):
    with open(os.path.join(out, "log.txt")) as f:
        return [json.loads(line) for line in f]


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


def one_error_line(err, *needles):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


# ---- one run per folder ---------------------------------------------------------------

def test_a_new_run_never_replaces_another_runs_files(tiny_base, synthetic_data, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1) == 0
    first = snapshot(out)
    first_id = {r["run"] for r in log_lines(out)}
    assert len(first_id) == 1 and "" not in first_id
    capsys.readouterr()
    assert train(tiny_base, synthetic_data, out, "--max_steps", 2) == 2
    one_error_line(capsys.readouterr().err, out, "another run's files", "--resume auto", "--overwrite")
    assert snapshot(out) == first  # nothing touched, log.txt included

    assert train(tiny_base, synthetic_data, out, "--max_steps", 2, "--resume", "auto") == 0  # continuing it is fine
    ids = [r["run"] for r in log_lines(out)]
    assert ids[0] in first_id and len(set(ids)) == 2  # every line says which run wrote it
    assert json.load(open(os.path.join(out, "args.json")))["run_id"] == ids[-1]

    os.makedirs(os.path.join(out, "eval"))
    with open(os.path.join(out, "eval", "scores.json"), "w") as f:
        f.write("{}")  # an evaluation of the adapter about to be replaced
    assert train(tiny_base, synthetic_data, out, "--max_steps", 1, "--overwrite") == 0  # replacing it must be asked for
    assert not os.path.exists(os.path.join(out, "eval"))
    ids = {r["run"] for r in log_lines(out)}
    assert len(ids) == 1 and not ids & first_id  # nothing of the earlier runs is left to mix in
    assert load_pth(os.path.join(out, "checkpoint-latest.pth"))["global_step"] == 1


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


def test_two_runs_started_into_one_folder(tiny_base, synthetic_data, tmp_path):
    """Two real Math.py processes at once: one trains, the other stops with exit 2 and writes nothing."""
    out = str(tmp_path / "run")
    cmd = [PYTHON, str(REPO / "Math.py"), *argv(tiny_base, synthetic_data, out, "--max_steps", 2)]
    logs = [tmp_path / f"stderr{i}.txt" for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w")) for log in logs]
    codes = [p.wait(timeout=600) for p in procs]
    errs = [log.read_text() for log in logs]
    assert sorted(codes) == [0, 2], (codes, errs)
    refused = errs[codes.index(2)]
    # while the other lives: the lock; had it already ended: its files
    assert ("is in use by another run" in refused or "another run's files" in refused) \
        and "Traceback" not in refused, refused
    assert len({r["run"] for r in log_lines(out)}) == 1
    assert [r["step"] for r in log_lines(out) if r["event"] == "train"] == [1, 2]


# ---- interrupts ------------------------------------------------------------------------

def test_kill_9_during_a_checkpoint_write_then_resume_is_bit_exact(tiny_base, synthetic_data, tmp_path):
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert train(tiny_base, synthetic_data, straight, "--max_steps", 3) == 0
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
    proc = subprocess.run([PYTHON, "-c", script, *argv(tiny_base, synthetic_data, killed, "--max_steps", 3)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [n for n in os.listdir(killed) if n.startswith(misc.TMP_PREFIX)]
    assert len(leftovers) == 1 and leftovers[0].endswith("checkpoint-latest.pth")
    assert load_pth(os.path.join(killed, "checkpoint-latest.pth"))["global_step"] == 1  # the last whole one

    assert train(tiny_base, synthetic_data, killed, "--max_steps", 3, "--resume", "auto") == 0
    assert not [n for n in os.listdir(killed) if n.startswith(misc.TMP_PREFIX)]  # removed at the start
    a = load_pth(os.path.join(straight, "adapter", "adapter.pth"))
    b = load_pth(os.path.join(killed, "adapter", "adapter.pth"))
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    ca, cb = (load_pth(os.path.join(d, "checkpoint-latest.pth")) for d in (straight, killed))
    assert ca["global_step"] == cb["global_step"] == 3
    assert all(ca["optimizer"]["m"][k].tobytes() == cb["optimizer"]["m"][k].tobytes() for k in a)


def test_sigint_checkpoints_and_exits_130(tiny_base, synthetic_data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, str(REPO / "Math.py"), *argv(tiny_base, synthetic_data, str(out), "--epochs", 50)],
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
    steps = [r["step"] for r in log_lines(out) if r["event"] == "train"]
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
    for make, needles in cases:
        out = tmp_path / "out"
        extra = make()
        # later flags win
        assert Math.main(argv(tiny_base, synthetic_data, str(out), "--max_steps", 1, *extra)) == 2, extra
        one_error_line(capsys.readouterr().err, *needles)
        assert not out.exists()  # nothing written before the input is known to be good


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
