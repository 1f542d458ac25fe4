"""Jittor's environment (Utils/jittor_env.py) and the changes scripts/jittor_patches.sh makes to its sources."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


def test_patches_apply_once_and_compile(tmp_path):
    """scripts/jittor_patches.sh on a copy of the installed Jittor's sources, twice: each change once, and the patched
    files compile with Jittor's include paths. The compile progress starts by clearing a terminal's line (it wrote
    "\\n", an empty line after every finished one), still "\\n" into a file."""
    import jittor
    patched_files = ("parallel_compiler.cc", "pyjt/py_caller.cc", "jit_compiler.cc", "op_compiler.cc")
    for name in patched_files:
        copy = tmp_path / "jittor" / "src" / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((Path(jittor.__file__).parent / "src" / name).read_text())
    import jittor_utils
    keyed = tmp_path / "jittor_utils" / "__init__.py"
    keyed.parent.mkdir()
    keyed.write_text(Path(jittor_utils.__file__).read_text().replace(
        'os.environ.get("jittor_cache_host", platform.node())', "platform.node()").replace(
        "    # moa-jittor: cache host", "    # (was)"))  # as Jittor ships it
    for _ in range(2):
        subprocess.run(["bash", str(REPO / "scripts" / "jittor_patches.sh"), str(tmp_path)], check=True)
    assert keyed.read_text().count('platform.platform() + os.environ.get("jittor_cache_host", platform.node())') == 1
    src = tmp_path / "jittor" / "src"
    progress = (src / "parallel_compiler.cc").read_text()
    assert progress.count('std::cerr << (isatty(2) ? "\\r\\033[K" : "\\n");') == 1
    assert progress.count("#include <unistd.h>") == 1 and 'std::cerr << "\\n";' not in progress
    compiler = (src / "jit_compiler.cc").read_text()
    assert compiler.count('#include "jit_prelude.h"') == 1 and compiler.count("jit_prelude_flag(") == 1
    for header in ("jit_prelude.h", "kernel_lock.h"):
        assert (src / header).read_text() == (REPO / "scripts" / "jittor_patches" / header).read_text()
    assert compiler.count("kernel_lock hold(cache_path, kernel_byte(jit_src_path));") == 1
    for name in ("parallel_compiler.cc", "op_compiler.cc"):
        assert (src / name).read_text().count("#ifndef __linux__  // moa-jittor: kernel locks") == 1
    includes = [flag.replace('"', "") for flag in jittor.compiler.cc_flags.split() if flag.startswith("-I")]
    for name in patched_files:
        compiled = subprocess.run(["g++", "-fsyntax-only", "-std=c++14", f"-I{src}", *includes, str(src / name)],
                                  capture_output=True, text=True)
        assert compiled.returncode == 0, f"{name}: {compiled.stderr[-2000:]}"


def test_kernels_compile_through_the_precompiled_prelude():
    """The compile-time patch (scripts/jittor_patches.sh) on the installed Jittor: a CPU op compiles in one g++ call
    that reads Jittor's headers from the precompiled prelude in the cache folder (GCC's -H marks a precompiled header
    it used with "!"; a stale or mismatched one would be read as text, slowly), while an op whose source asks for
    assembly rewrites ("@begin": a broadcast fill) still goes through Jittor's utils/asm_tuner.py."""
    import jittor as jt
    marker = "0.03125f"  # Jittor drops an op source's comments; a constant names this one
    doubled = jt.code((2,), "float32", [jt.array([1.5, 2.5])],
                      cpu_src=f"for (int i = 0; i < in0_shape0; i++) @out(i) = 2 * @in0(i) + {marker};")
    filled = jt.full((3, 40), 0.8125)
    assert doubled.numpy().tolist() == [3.03125, 5.03125] and float(filled.numpy().sum()) == 97.5
    jit = Path(jt.flags.cache_path) / "jit"
    code = [path for path in jit.glob("code__*.cc") if marker in path.read_text()]
    fills = [path for path in jit.glob("*broadcast_to*.cc") if "@begin" in path.read_text()]  # the fill among them
    assert len(code) == 1 and fills, (code, fills)
    command = (jit / (code[0].name[:-3] + ".so.key")).read_text().splitlines()[0]
    prelude = Path(jt.flags.cache_path) / "jit_prelude.h"
    assert command.startswith('"') and f'-include "{prelude}"' in command and "asm_tuner" not in command, command
    check = re.sub(r' -o "[^"]*"', " -fsyntax-only -H", command)
    headers = subprocess.run(check, shell=True, capture_output=True, text=True).stderr.splitlines()
    assert headers and headers[0] == f"! {prelude}.gch", headers[:5]
    for fill in fills:
        assert "asm_tuner.py" in (jit / (fill.name[:-3] + ".so.key")).read_text().splitlines()[0]


def test_each_kernel_compiles_under_its_own_lock():
    """The kernel-lock patch (scripts/jittor_patches/kernel_lock.h): a process compiling a kernel no longer takes the
    lock over the whole cache (the test suite's workers compiled one kernel at a time), and it does lock its kernel's
    byte of <cache_path>/kernels.lock. This process holds one lock, then the other, over a whole file (a POSIX record
    lock, which an open file description lock respects) while another compiles a kernel seen nowhere before."""
    import fcntl
    import time
    import uuid
    import jittor as jt
    from jittor_utils import lock as jittor_lock

    def compile_new_kernel():
        constant = f"{uuid.uuid4().int % 10**6}.5f"
        program = ("import Utils.jittor_env, jittor as jt\n"
                   "print('imported', flush=True)\n"
                   f"print(jt.code((1,), 'float32', [], cpu_src='@out(0) = {constant};').item())")
        run = subprocess.Popen([sys.executable, "-c", program], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        assert run.stdout.readline() == "imported\n", run.communicate()
        return constant, run

    with open(jittor_lock.lock_path, "a+") as whole_cache:
        fcntl.lockf(whole_cache, fcntl.LOCK_EX)
        try:
            constant, run = compile_new_kernel()
            out, err = run.communicate(timeout=120)  # waited forever for the cache's lock before the patch
        finally:
            fcntl.lockf(whole_cache, fcntl.LOCK_UN)
    assert run.returncode == 0 and float(out.split()[-1]) == float(constant[:-1]), err[-2000:]

    with open(Path(jt.flags.cache_path) / "kernels.lock", "a+") as kernel_bytes:
        fcntl.lockf(kernel_bytes, fcntl.LOCK_EX)
        try:
            constant, run = compile_new_kernel()
            time.sleep(3)
            waiting = run.poll() is None
        finally:
            fcntl.lockf(kernel_bytes, fcntl.LOCK_UN)
        out, err = run.communicate(timeout=300)
    assert waiting, f"compiled a kernel without its lock: {out} {err[-2000:]}"
    assert run.returncode == 0 and float(out.split()[-1]) == float(constant[:-1]), err[-2000:]


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


def test_resume_hints_name_the_launcher_and_what_mpirun_made_of_the_signal(monkeypatch):
    """Under OpenMPI (its environment) the hint starts with mpirun and its rank count; a SIGTERM there may be a
    Ctrl-C to mpirun, which OpenMPI turns into SIGTERM for its ranks."""
    from Utils.jittor_env import launcher, stop_origin
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert launcher() == "" and stop_origin("SIGTERM") == ""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert launcher() == "mpirun -np 3 " and stop_origin("SIGUSR1") == ""
    assert "a Ctrl-C or SIGTERM to mpirun" in stop_origin("SIGTERM") and "SIGUSR1" in stop_origin("SIGTERM")


def cache_path_on(hostname=None) -> str:
    """Jittor's cache folder as a process sees it (on a host of another name: a UTS namespace of its own)."""
    program = [sys.executable, "-c", "import Utils.jittor_env, jittor_utils; print(jittor_utils.cache_path)"]
    if hostname:
        program = ["unshare", "--uts", "sh", "-c", f"hostname {hostname} && exec {shlex.join(program)}"]
    run = subprocess.run(program, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()[-1]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare to "
                    "run a process under another host name")
def test_ranks_stop_by_the_signal_one_of_them_received():
    """mpirun forwards SIGUSR1 to each host in turn: a rank that has not received it yet when the ranks vote at a step
    boundary stops with them, and by SIGUSR1 (exit 138), not by the SIGTERM it was never sent (143: a 2-host run
    exited so)."""
    from Utils.jittor_env import STOP_SIGNALS, StopFlag, stop_exit_status
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        sent, waiting = StopFlag(), StopFlag()
        assert not waiting.agree([a + b for a, b in zip(sent.votes(), waiting.votes())])  # nothing sent yet
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this thread, which blocks it
        votes = [a + b for a, b in zip(sent.votes(), waiting.votes())]  # the first rank to poll consumes it
        assert votes == [float(s == signal.SIGUSR1) for s in STOP_SIGNALS]
        assert sent.agree(votes) and waiting.agree(votes)
        assert [stop_exit_status(flag.name) for flag in (sent, waiting)] == [138, 138]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_the_cache_is_keyed_by_the_cpu_not_the_host_name():
    """Nodes of one kind sharing a home share Jittor's compiled cache (each compiled everything again, minutes, into
    a folder named after it); a machine with other instruction sets keys another folder."""
    assert cache_path_on("node-a") == cache_path_on("node-b") == cache_path_on()
    from Utils import jittor_env
    assert re.fullmatch(r"cpu[0-9a-f]{8}", jittor_env.cpu_identity())


def test_onednn_links_made_by_another_rank_meanwhile(monkeypatch, tmp_path):
    """Two ranks of a cold host link oneDNN at once: one found a link missing, the other made it, and the first's
    symlink raised FileExistsError (a traceback, the job aborted)."""
    from Utils import jittor_env
    folder = tmp_path / "dnnl"
    monkeypatch.setattr(jittor_env, "ONEDNN_DIR", str(folder))
    if not jittor_env.ensure_onednn():
        pytest.skip("no system oneDNN (libdnnl-dev) to link")
    (folder / "lib" / "libmkldnn.so").unlink()
    monkeypatch.setattr(os.path, "lexists", lambda path: False)  # each link "missing" when looked at
    assert jittor_env.ensure_onednn()
    assert (folder / "lib" / "libmkldnn.so").resolve().is_file() and (folder / "include" / "dnnl.hpp").exists()


def test_nccl_from_an_installed_wheel(monkeypatch, tmp_path):
    """Under mpirun on a GPU Jittor builds NCCL from downloaded sources; an installed nvidia-nccl wheel's library
    serves instead, linked under the name Jittor loads."""
    from Utils import jittor_env
    site = tmp_path / "site"
    for part in ("lib/libnccl.so.2", "include/nccl.h"):
        (site / "nvidia" / "nccl" / part).parent.mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / "nccl" / part).write_bytes(b"")
    monkeypatch.setattr(jittor_env, "NCCL_DIR", str(tmp_path / "nccl"))
    assert jittor_env.wheel_nccl() is None or str(site) not in jittor_env.wheel_nccl()[0]
    monkeypatch.syspath_prepend(str(site))
    for _ in range(2):  # a second rank finds the link made
        include, library = jittor_env.wheel_nccl()
        assert include == str(site / "nvidia" / "nccl" / "include")
        assert Path(library, "libnccl.so").resolve() == (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
