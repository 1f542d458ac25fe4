"""Run untrusted Python programs (model-written code and its tests) so that they can neither harm the
machine nor pass without their tests having run to the end.

Two isolation levels, chosen at run time (`isolation()`):
- "bwrap": bubblewrap (Debian package bubblewrap) puts each program in its own mount, pid, network,
  ipc and uts namespaces: the file system is read-only and holds only the system's libraries and
  the Python installation, the working directory is a fresh, empty, size-capped tmpfs, there is no
  network (a namespace of its own, with only its own loopback), no other process is visible, and the
  whole namespace dies with the program.
- "rlimit" (the floor, wherever bubblewrap is missing or its namespaces are refused): a plain child
  process in a fresh empty working directory, with the audit hook below as the only barrier to the
  network and to writes elsewhere.
Everywhere: a session and process group of its own, killed with every process it forked on a wall
clock or CPU limit; setrlimit caps on CPU time, address space, processes, file size and open files;
as root, an unprivileged uid per worker slot (UID_BASE + slot), so the process limit counts only
that program's processes; a clean environment (nothing inherited); stdout discarded and stderr kept
up to OUTPUT_CAP; at most one program per core at once. The harness (Utils/sandbox_harness.py)
installs an audit hook and writes the verdict with a per-run secret; see docs/code.md for what each
layer stops and what it does not.
"""
import concurrent.futures
import json
import math
import os
import queue
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import namedtuple
from dataclasses import dataclass

from Utils.settings import check_fields, setting

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
PASSED, FAILED, TIMED_OUT, CRASHED = "passed", "failed", "timed out", "crashed"
TOKEN_PREFIX = "moa-sandbox-"  # + a random tail on every sandboxed command line: how leftovers are found
UID_BASE = 2_000_000_000  # as root, worker slot i runs its programs as uid UID_BASE + i (no such user exists)
WORKDIR = "/sandbox"  # the working directory inside bubblewrap
WORKDIR_MB, FILE_MB = 64, 16  # the tmpfs working directory (bwrap); any one file a program writes
OUTPUT_CAP = 16384  # bytes of stderr kept; past it the pipe is closed (the program's writes fail)
VERDICT_CAP = 4096
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # + HOME and TMPDIR = the working directory
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# What to run: the program, then the tests in a namespace of the program's names, then check(entry_point)
# when entry_point is not None; shadows: the builtins' names the program may redefine for the tests.
Job = namedtuple("Job", "program tests entry_point shadows", defaults=(None, ()))
# status: PASSED, FAILED, TIMED_OUT or CRASHED; error: the error's last line ("" for a pass)
Result = namedtuple("Result", "status error exit_code stderr")


@dataclass
class SandboxLimits:
    """What one sandboxed program may use (Infer.py's code execution flags)."""
    exec_timeout: float = setting(3.0, "CPU seconds a program and its tests may use (the authors' 3 s); the wall "
                                       "clock allows 3x that plus 2 s", above=0)
    exec_memory_mb: int = setting(1024, "address space of each sandboxed process, MiB", at_least=1)
    exec_processes: int = setting(8, "processes and threads a program may have at once", at_least=1)
    exec_workers: int = setting(0, "programs run at once; 0 = one per core (never more than the cores)", at_least=0)

    def __post_init__(self):
        check_fields(self)

    @property
    def wall_seconds(self) -> float:
        return 3 * self.exec_timeout + 2

    def workers(self) -> int:
        cores = len(os.sched_getaffinity(0))
        return min(self.exec_workers or cores, cores)


# ---- which isolation ---------------------------------------------------------------------

_chosen = {}  # {"mode": ..., "reason": ...}, decided once per process


def is_root() -> bool:
    return os.geteuid() == 0


def python_for(mode: str) -> str:
    """The interpreter the programs run on: this one's base installation; for the floor as root
    (an unprivileged uid must reach it) the system's python3 when ours lies in a private folder."""
    ours = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if mode == "rlimit" and is_root() and not world_readable(ours):
        system = shutil.which("python3", path="/usr/bin:/bin")
        if system and world_readable(os.path.realpath(system)):
            return os.path.realpath(system)
        raise FileNotFoundError(f"no Python interpreter an unprivileged uid can run ({ours} lies in a private folder)")
    return ours


def world_readable(path: str) -> bool:
    """Every folder above `path` searchable, and `path` readable, by any user."""
    path = os.path.realpath(path)
    parts = path.split("/")
    folders = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in folders) and bool(os.stat(path).st_mode & stat.S_IROTH)


def bwrap_prefix(python: str) -> list:
    """bubblewrap's arguments up to the interpreter: namespaces, a read-only system, a tmpfs workdir."""
    args = [shutil.which("bwrap"), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    # root keeps setuid/setgid so the harness can drop to its slot's uid (a user namespace would map
    # the program to root outside, whom the process limit does not bind); others get a user namespace
    args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if is_root() else ["--unshare-user"]
    for folder in SYSTEM_DIRS:
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    prefix = os.path.dirname(os.path.dirname(python))  # <prefix>/bin/python3.x
    if not prefix.startswith("/usr/"):
        parts = prefix.split("/")
        for i in range(2, len(parts)):  # its folders, searchable by the slot's uid (bwrap would make them 0700)
            args += ["--perms", "0755", "--dir", "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
             "--perms", "0777", "--size", str(WORKDIR_MB * 2 ** 20), "--tmpfs", WORKDIR, "--chdir", WORKDIR,
             "--clearenv"]
    for key, value in {**ENV, "HOME": WORKDIR, "TMPDIR": WORKDIR}.items():
        args += ["--setenv", key, value]
    return args + ["--"]


def probe_bwrap():
    """(True, version) when bubblewrap runs a program here with every namespace, else (False, why)."""
    if shutil.which("bwrap") is None:
        return False, "bubblewrap is not installed (apt-get install bubblewrap)"
    try:
        python = python_for("bwrap")
        done = subprocess.run(bwrap_prefix(python) + [python, "-I", "-S", "-c", "pass"], capture_output=True,
                              timeout=30, env=ENV, stdin=subprocess.DEVNULL)
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"bubblewrap failed: {e}"
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return False, f"bubblewrap cannot create its namespaces here: {why}"
    return True, version


def isolation() -> str:
    """"bwrap" when bubblewrap works on this machine, else "rlimit"; decided once per process."""
    if not _chosen:
        works, reason = probe_bwrap()
        _chosen.update(mode="bwrap" if works else "rlimit", reason=reason)
    return _chosen["mode"]


def describe(mode: str) -> str:
    """One line saying what contains the programs, for logs and scores.json."""
    user = f"uid {UID_BASE}+slot" if is_root() else f"uid {os.getuid()}"
    if mode == "bwrap":
        version = _chosen.get("reason") if _chosen.get("mode") == "bwrap" else "bubblewrap"
        return (f"{version}: mount, pid, net, ipc and uts namespaces, read-only system, tmpfs workdir; "
                f"setrlimit; {user}; audit hook")
    why = _chosen.get("reason", "chosen by the caller") if _chosen.get("mode") == "rlimit" else "chosen by the caller"
    return f"setrlimit, own process group, {user} and audit hook only, no namespaces ({why})"


# ---- one program -------------------------------------------------------------------------

def run_one(job: Job, limits: SandboxLimits, mode: str, slot: int = 0) -> Result:
    """Run one Job in the sandbox; its Result."""
    default_sigchld()
    token, secret = TOKEN_PREFIX + secrets.token_hex(8), secrets.token_hex(16)
    uid = UID_BASE + slot if is_root() else None
    python = python_for(mode)
    host_dir = None
    if mode == "bwrap":
        argv, workdir, cwd = bwrap_prefix(python), WORKDIR, "/"
    else:
        host_dir = private_workdir(uid)
        argv, workdir, cwd = [], host_dir, host_dir
    with open(HARNESS) as f:
        argv = argv + [python, "-I", "-S", "-c", f.read(), token]
    request = {**job._asdict(), "shadows": list(job.shadows), "secret": secret, "uid": uid, "workdir": workdir,
               "limits": {"cpu_seconds": math.ceil(limits.exec_timeout), "memory_mb": limits.exec_memory_mb,
                          "processes": limits.exec_processes, "file_mb": FILE_MB}}
    try:
        with tempfile.TemporaryFile() as stdin:  # unlinked: the harness reads it first, then it is gone
            stdin.write(json.dumps(request).encode())
            stdin.seek(0)
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                    env={**ENV, "HOME": workdir, "TMPDIR": workdir}, start_new_session=True)
        try:
            verdict, stderr, wall_killed = watch(proc, limits.wall_seconds)
        finally:
            kill_leftovers(proc, token)
            status, rusage = reap(proc)
    finally:
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)
    return judge(verdict, secret, stderr, status, rusage, wall_killed, limits, mode)


def default_sigchld():
    """Jittor's SIGCHLD handler ends the process when a child dies by a signal, as a timed-out program
    does: a scorer needs the default action (only the main thread may set it; run_many does first)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def private_workdir(uid) -> str:
    """A fresh empty folder that only the program's uid can use (the floor's working directory)."""
    path = tempfile.mkdtemp(prefix="moa-sandbox-")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def watch(proc, wall_seconds: float):
    """Read the verdict (stdout) and stderr, each up to its cap, until the program exits or the wall
    clock runs out; (verdict bytes, stderr bytes, whether the wall clock ran out)."""
    deadline = time.monotonic() + wall_seconds
    verdict, stderr = (proc.stdout, bytearray(), VERDICT_CAP), (proc.stderr, bytearray(), OUTPUT_CAP)
    pipes = {pipe[0].fileno(): pipe for pipe in (verdict, stderr)}
    sel = selectors.DefaultSelector()
    for fd in pipes:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): poll the exit every 10 ms
        pass
    wall_killed = exited = False
    try:
        while not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                wall_killed = True
                break
            for key, _ in sel.select(timeout=min(left, 0.01) if pidfd is None else left):
                if key.fd == pidfd:
                    exited = True
                else:
                    read_capped(sel, *pipes[key.fd])
            exited = exited or (pidfd is None and proc.poll() is not None)
        for fd, pipe in pipes.items():  # what the pipes still hold (a forked child may keep them open)
            if fd in sel.get_map():
                read_capped(sel, *pipe)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return bytes(verdict[1]), bytes(stderr[1]), wall_killed


def read_capped(sel, pipe, buffer: bytearray, cap: int):
    """Everything readable now from `pipe` into `buffer`; at end of file or past `cap`, close it."""
    while True:
        try:
            chunk = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        if chunk:
            buffer += chunk[:cap - len(buffer)]
        if not chunk or len(buffer) >= cap:
            sel.unregister(pipe.fileno())
            pipe.close()  # past the cap the program's writes fail (EPIPE) instead of filling memory
            return


def kill_leftovers(proc, token: str):
    """SIGKILL the program's process group, then every process still carrying the run's token on its
    command line (a forked child keeps the harness's; one that left the group with setsid included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(100):  # a fork bomb may fork while we sweep: until a sweep finds nothing
        found = [pid for pid in processes_with(token) if pid != proc.pid]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def processes_with(token: str) -> list:
    """Pids whose command line holds `token` (zombies have none and are not counted)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def reap(proc):
    """(exit code as subprocess reports it, rusage) of the killed or finished program."""
    proc.stdout.close()
    proc.stderr.close()
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, rusage


def judge(verdict: bytes, secret: str, stderr: bytes, exit_code: int, rusage, wall_killed: bool,
          limits: SandboxLimits, mode: str) -> Result:
    """The Result: the harness's verdict line when it carries the secret, else why there is none."""
    cpu = rusage.ru_utime + rusage.ru_stime  # the program's own only without bwrap (which does not reap it)
    keep = dict(exit_code=exit_code, stderr=stderr.decode(errors="replace"))
    for line in verdict.decode(errors="replace").splitlines():
        fields = line.split("\t", 2)
        if fields[0] == secret and len(fields) >= 2 and fields[1] in (PASSED, FAILED):
            return Result(fields[1], fields[2] if len(fields) == 3 else "", **keep)
    # bwrap reports a program killed by signal s as exit status 128 + s; subprocess as -s
    sig = -exit_code if exit_code < 0 else exit_code - 128 if mode == "bwrap" and exit_code > 128 else None
    limit = math.ceil(limits.exec_timeout)
    if wall_killed:
        return Result(TIMED_OUT, f"wall clock limit of {limits.wall_seconds:g} s", **keep)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limit):
        return Result(TIMED_OUT, f"CPU time limit of {limit} s", **keep)
    lines = [line.strip() for line in keep["stderr"].splitlines() if line.strip()]
    how = f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() else f"exit status {exit_code}"
    return Result(CRASHED, f"ended before its tests finished ({how})" + (f": {lines[-1][:300]}" if lines else ""),
                  **keep)


# ---- many programs -----------------------------------------------------------------------

def run_many(jobs, limits: SandboxLimits, mode: str = None, progress=None) -> list:
    """Run every Job of `jobs`, at most limits.workers() at once; their Results in order. `mode` forces an
    isolation level ("bwrap" or "rlimit"); `progress` is called per result."""
    mode = mode or isolation()
    default_sigchld()
    workers = max(1, min(limits.workers(), len(jobs)))
    slots = queue.Queue()
    for slot in range(workers):
        slots.put(slot)

    def one(job):
        slot = slots.get()
        try:
            return run_one(job, limits, mode, slot)
        finally:
            slots.put(slot)
            if progress is not None:
                progress()

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))
