"""Utils/misc.py: distributed setup, print gating, atomic saves, meters, early stopping."""
import json
import math
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

from Utils import misc
from Utils.misc import EarlyStopper, MetricLogger, SmoothedValue, save_on_master

REPO = Path(__file__).resolve().parents[1]


def test_init_distributed_single_process():
    args = SimpleNamespace(device="cpu")
    misc.init_distributed_mode(args)
    assert (args.rank, args.world_size, args.distributed, args.gpu) == (0, 1, False, 0)
    assert misc.get_rank() == 0 and misc.get_world_size() == 1 and misc.is_main_process()


def test_print_gating(capsys):
    misc.setup_for_distributed(False)
    misc.print_main("hidden")
    print("shown")  # print itself is never patched
    misc.setup_for_distributed(True)
    misc.print_main("master")
    assert capsys.readouterr().out == "shown\nmaster\n"


def test_save_on_master_atomic(tmp_path):
    path = tmp_path / "sub" / "state.pkl"
    assert save_on_master({"a": 1}, path) == path
    assert pickle.loads(path.read_bytes()) == {"a": 1}
    save_on_master(lambda p: open(p, "w").write("text"), tmp_path / "x.txt")
    assert (tmp_path / "x.txt").read_text() == "text"

    def failing_writer(p):
        open(p, "w").write("partial")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        save_on_master(failing_writer, path)
    assert pickle.loads(path.read_bytes()) == {"a": 1}  # old file intact
    assert sorted(os.listdir(path.parent)) == ["state.pkl"]  # no temp file left


def test_save_on_master_temp_keeps_extension(tmp_path):
    seen = []
    save_on_master(lambda p: (seen.append(p), open(p, "w").close()), tmp_path / "ckpt.pth")
    assert seen[0].endswith(".pth") and seen[0] != str(tmp_path / "ckpt.pth")


def test_smoothed_value_stats():
    meter = SmoothedValue(window_size=3)
    assert math.isnan(meter.median) and math.isnan(meter.global_avg)
    for v in [1.0, 2.0, 3.0, 10.0]:
        meter.update(v)
    meter.update(4.0, n=2)
    assert meter.value == 4.0 and meter.max == 10.0
    assert meter.median == 4.0 and meter.avg == pytest.approx(17 / 3)
    assert meter.count == 6 and meter.global_avg == pytest.approx(24 / 6)
    meter.synchronize_between_processes()  # one process: unchanged
    assert meter.count == 6 and meter.total == pytest.approx(24.0)
    assert str(meter) == "4.0000 (4.0000)"


def test_metric_logger(capsys):
    import jittor as jt
    logger = MetricLogger()
    logger.update(loss=2.0, lr=None)
    logger.update(loss=jt.array(4.0))
    assert logger.loss.global_avg == pytest.approx(3.0) and "lr" not in logger.meters
    with pytest.raises(AttributeError):
        logger.nope
    items = list(logger.log_every(range(5), print_freq=2, header="Epoch: [0]"))
    assert items == list(range(5))
    out = capsys.readouterr().out
    assert "Epoch: [0]  [0/5]  eta:" in out and "[4/5]" in out and "loss: 3.0000" in out
    assert "Total time" in out and "[1/5]" not in out
    logger.synchronize_between_processes()
    assert logger.loss.count == 2


def test_progress_eta_leaves_out_the_first_item(capsys, monkeypatch):
    """The ETA counts the items left at the mean time of the items after the first, whose compiling (100 s here,
    2 s each after) would inflate it; at the first item it says nothing."""
    now = [0.0]
    monkeypatch.setattr(misc, "time", SimpleNamespace(time=lambda: now[0]))
    for i in MetricLogger().log_every(range(5), print_freq=1, header="Epoch: [0]"):
        now[0] += 100.0 if i == 0 else 2.0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("eta: ")[1].split()[0] for line in lines[:5]] == ["-", "0:00:06", "0:00:04", "0:00:02",
                                                                          "0:00:00"]


def test_early_stopper_patience_and_min_delta():
    stopper = EarlyStopper(patience=2, min_delta=0.1)
    assert stopper.step(1.0) == (True, False)
    assert stopper.step(0.95) == (False, False)  # better, but not by min_delta
    assert stopper.step(0.8) == (True, False)
    assert stopper.step(0.75) == (False, False)
    assert stopper.step(float("nan")) == (False, True)
    never = EarlyStopper(patience=None)
    assert all(never.step(5.0) == (i == 0, False) for i in range(10))


def test_early_stopper_state_round_trip():
    stopper = EarlyStopper(patience=3)
    for loss in [1.0, 0.5, 0.6]:
        stopper.step(loss)
    restored = EarlyStopper(patience=3)
    restored.load_state_dict(pickle.loads(pickle.dumps(stopper.state_dict())))
    assert (restored.best, restored.bad_rounds) == (0.5, 1)
    assert restored.step(0.7) == stopper.step(0.7) == (False, False)
    assert restored.step(0.7) == stopper.step(0.7) == (False, True)


def test_numpy_says_nothing_of_the_subnormals_jittor_flushes():
    """Jittor's kernels (-Ofast) set the CPU to treat subnormals as zero in the whole process; numpy's finfo found
    none and warned about it on every Infer.py run (matplotlib asks). Preparing Jittor's environment silences it."""
    program = """
import Utils.jittor_env, jittor as jt, numpy as np
(jt.array(np.ones(4, np.float32)) * 2).sync()
print(np.finfo(np.float64).eps, np.nextafter(0.0, 1.0) == 0)
"""
    run = subprocess.run([sys.executable, "-W", "default", "-c", program], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "True"  # the smallest subnormal reads as zero: what numpy warned about
    assert "smallest subnormal" not in run.stderr, run.stderr


def test_compile_progress_patch_clears_the_line_in_a_terminal(tmp_path):
    """scripts/jittor_patches.sh on a copy of the installed Jittor's sources: the progress starts
    by clearing a terminal's line (it wrote "\\n", an empty line after every finished one), still "\\n" into a
    file; once only, and the patched file compiles with Jittor's include paths."""
    import jittor
    for name in ("parallel_compiler.cc", "pyjt/py_caller.cc"):
        copy = tmp_path / "jittor" / "src" / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((Path(jittor.__file__).parent / "src" / name).read_text())
    copy = tmp_path / "jittor" / "src" / "parallel_compiler.cc"
    for _ in range(2):
        subprocess.run(["bash", str(REPO / "scripts" / "jittor_patches.sh"), str(tmp_path)], check=True)
    patched = copy.read_text()
    assert patched.count('std::cerr << (isatty(2) ? "\\r\\033[K" : "\\n");') == 1
    assert patched.count("#include <unistd.h>") == 1 and 'std::cerr << "\\n";' not in patched
    includes = [flag for flag in jittor.compiler.cc_flags.split() if flag.startswith("-I")]
    compiled = subprocess.run(["g++", "-fsyntax-only", "-std=c++14", *[f.replace('"', "") for f in includes],
                               str(copy)], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-2000:]


def test_op_compiler_threads_hold_the_interpreter_lock():
    """Ops whose source calls Python (jt.isnan, jt.isfinite: the optimizer step's finite check on a GPU) compiled
    by Jittor's op compiler threads: each call must hold the interpreter's lock (scripts/jittor_patches.sh). Without it
    Python 3.12 segfaults there ("thread_name: 'C10'", docs/gpu.md); Python 3.11 lends the thread the main thread's
    state, which PyGILState_Check tells apart."""
    program = """
import ctypes, json, threading
import Utils.jittor_env, jittor as jt
jt.flags.use_parallel_op_compiler = 16
calls = []
wrapped = jt.python_pass_wrapper
def recorded(*args):
    calls.append([threading.get_ident() != threading.main_thread().ident, ctypes.pythonapi.PyGILState_Check()])
    return wrapped(*args)
jt.python_pass_wrapper = recorded
x = jt.array([1.0, float("nan"), float("inf"), -2.0])
nan, inf = jt.isnan(x), jt.isinf(x)
jt.sync([nan, inf])
print(json.dumps({"calls": calls, "nan": nan.numpy().tolist(), "inf": inf.numpy().tolist()}))
"""
    run = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["nan"] == [False, True, False, False] and seen["inf"] == [False, False, True, False]
    assert any(on_thread for on_thread, _ in seen["calls"]), f"no op was compiled on a compiler thread: {seen}"
    assert all(held == 1 for _, held in seen["calls"]), f"Python called without the interpreter's lock: {seen}"


def test_nccl_is_left_off_where_it_cannot_be_had(monkeypatch, tmp_path):
    """Under mpirun on a GPU machine Jittor downloads NCCL; offline that aborted every rank at import."""
    import socket
    from Utils import jittor_env

    def offline(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")
    monkeypatch.delenv("nccl_lib_path", raising=False)
    monkeypatch.setattr(jittor_env, "NCCL_BUILD", str(tmp_path / "libnccl.so"))
    monkeypatch.setattr(socket, "getaddrinfo", offline)
    assert not jittor_env.nccl_obtainable()
    (tmp_path / "libnccl.so").write_bytes(b"")  # built by an earlier run
    assert jittor_env.nccl_obtainable()
    (tmp_path / "libnccl.so").unlink()
    monkeypatch.setenv("nccl_lib_path", str(tmp_path))  # the user's own NCCL
    assert jittor_env.nccl_obtainable()
