"""The sandbox's processes (Utils/sandbox/ runs a Job as two of them): the supervisor's command line,
bubblewrap's arguments, the uids and working folders they get, and the watch over their pipes.

A supervisor (sandboxed/launch.py) is started as `sh -c 'ulimit -S -s 8192; exec python ...'`
(under bubblewrap, as its namespaces' init) in a session of its own; it reads its request from an
unlinked file on stdin and holds the read end of a control pipe, whose closing (by the scorer, or by
its death) ends it. Its stdout is its report (and, for the tests' process, the verdict line before it),
its stderr what its process wrote there.
"""
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from .sandboxed import confine, launch

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxed")  # the code run inside
TOKEN_PREFIX = "moa-sandbox-"  # + the scorer's pid and a random tail, on each supervisor's command line (for ps)
UID_BASE, UIDS_PER_RUN = 2_000_000_000, 1024  # as root: a block of uids per scorer process, two per worker slot
WORKDIR, MOUNTED_PACKAGE = "/sandbox", "/moa/sandboxed"  # inside bubblewrap
WORKDIR_MB, FILE_MB = 64, 16  # the tmpfs working directory (bwrap); any one file a program writes
# files and folders in bubblewrap's tmpfs folders together: their kernel memory (about 1 KiB each) is not
# counted by a tmpfs's size, and an empty folder costs a process 5 us (launch.wait_for kills the work past it)
MAX_ENTRIES = 65536
# bubblewrap's own /dev/shm (16 MiB): multiprocessing's locks (sem_open) live there; on the floor /dev/shm is
# the machine's, and stays out of reach
PRIVATE_SHM, SHM_MB = "/dev/shm", 16
OUTPUT_CAP, REPORT_CAP = 16384, 4096  # bytes of stderr kept (past it the program's writes fail), of a report
GRACE = 5.0  # seconds past the wall clock before the supervisors themselves are killed
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # + HOME and TMPDIR = the working directory
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("/dev/urandom", "/dev/zero")  # readable under Landlock (and /dev/null, also writable)
# The stack limit of a fresh process (8 MiB) before the interpreter starts: glibc sizes every thread's stack
# by the limit it finds at start, and the scorer's is Jittor's 512 MiB (one thread per 512 MiB of address space)
FRESH_STACK = ["/bin/sh", "-c", 'ulimit -S -s 8192 2>/dev/null; exec "$@"', "sh"]


def is_root() -> bool:
    return os.geteuid() == 0


def uid_range(scorer: int = None) -> range:
    """As root, the uids the scorer process `scorer` (default: this one) gives its sandboxed processes (its
    pid picks the block, so that two scorers at once share neither processes nor their limits)."""
    first = UID_BASE + ((scorer or os.getpid()) % 2 ** 21) * UIDS_PER_RUN
    return range(first, first + UIDS_PER_RUN)


def python_for(mode: str) -> str:
    """The interpreter the programs run on: this one's base installation; for the floor as root (an
    unprivileged uid must reach it) the system's python3 when ours lies in a private folder."""
    ours = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if mode == "landlock" and is_root() and not world_readable(ours):
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


def installation(python: str) -> str:
    return os.path.dirname(os.path.dirname(python))  # <prefix>/bin/python3.x


def bwrap_prefix(python: str) -> list:
    """bubblewrap's arguments up to the interpreter: namespaces, a read-only system, a tmpfs workdir, this
    package read-only at MOUNTED_PACKAGE; the command it runs is the namespace's init."""
    args = [shutil.which("bwrap"), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    # root keeps setuid/setgid so that the work can drop to its uid (a user namespace would map it to root
    # outside, whom the process limit does not bind), and kill, so that the supervisor reaches that uid
    args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"] if is_root() \
        else ["--unshare-user"]
    for folder in SYSTEM_DIRS:
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    prefix = installation(python)
    if not prefix.startswith("/usr/"):
        parts = prefix.split("/")
        for i in range(2, len(parts)):  # its folders, searchable by the work's uid (bwrap would make them 0700)
            args += ["--perms", "0755", "--dir", "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", PACKAGE, MOUNTED_PACKAGE, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
             "--dev", "/dev", "--perms", "01777", "--size", str(SHM_MB * 2 ** 20), "--tmpfs", PRIVATE_SHM,
             "--perms", "0777", "--size", str(WORKDIR_MB * 2 ** 20), "--tmpfs", WORKDIR,
             "--chdir", WORKDIR, "--clearenv"]
    for key, value in {**ENV, "HOME": WORKDIR, "TMPDIR": WORKDIR}.items():
        args += ["--setenv", key, value]
    return args + ["--"]


def private_workdir(uid) -> str:
    """A fresh empty folder that only `uid` can use (the floor's working directory)."""
    path = tempfile.mkdtemp(prefix="moa-sandbox-")
    if uid is not None:
        os.chown(path, uid, uid)
    return path


class Supervised:
    """One supervisor process (sandboxed/launch.py) running `role` in the sandbox: its report and
    stderr as they come, and the control pipe whose closing ends it."""

    def __init__(self, role: str, job: dict, requests: int, replies: int, limits, mode: str,
                 uid, token: str):
        python = python_for(mode)
        self.host_dir = None if mode == "bwrap" else private_workdir(uid)
        workdir = WORKDIR if mode == "bwrap" else self.host_dir
        package_parent = os.path.dirname(MOUNTED_PACKAGE if mode == "bwrap" else PACKAGE)
        boot = f"import sys; sys.path.insert(0, {package_parent!r}); from sandboxed import launch; launch.main()"
        argv = (bwrap_prefix(python) if mode == "bwrap" else []) + [*FRESH_STACK, python, "-I", "-S", "-c", boot, token]
        control, self.control = os.pipe()
        request = {"role": role, "job": job, "uid": uid, "workdir": workdir, "wall_seconds": limits.wall_seconds,
                   "readable": [*SYSTEM_DIRS, *DEVICES, installation(python)],
                   "writable": [workdir, *([PRIVATE_SHM] if mode == "bwrap" else [])],
                   "counted": [workdir, PRIVATE_SHM] if mode == "bwrap" else [], "max_entries": MAX_ENTRIES,
                   "remove_workdir": mode != "bwrap",
                   "landlock": mode == "landlock" or confine.landlock_abi() >= 1,
                   "seccomp": mode == "landlock" or confine.seccomp_supported(),
                   "fds": {"control": control, "requests": requests, "replies": replies},
                   "limits": {"cpu_seconds": math.ceil(limits.exec_timeout), "memory_mb": limits.exec_memory_mb,
                              "processes": limits.exec_processes, "file_mb": FILE_MB}}
        try:
            with tempfile.TemporaryFile() as stdin:  # unlinked: the supervisor reads it, then it is gone
                stdin.write(json.dumps(request).encode())
                stdin.seek(0)
                self.proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             pass_fds=(control, requests, replies), start_new_session=True,
                                             cwd="/" if mode == "bwrap" else workdir,
                                             env={**ENV, "HOME": workdir, "TMPDIR": workdir})
        except BaseException:
            os.close(self.control)
            self.remove_workdir()
            raise
        finally:
            os.close(control)
        self.report, self.stderr, self.past_backstop = bytearray(), bytearray(), False
        self.pipes = {self.proc.stdout: (self.report, REPORT_CAP), self.proc.stderr: (self.stderr, OUTPUT_CAP)}

    def stop(self):
        """Close the control pipe: the supervisor kills its process and everything below it, and reports."""
        if self.control is not None:
            os.close(self.control)
            self.control = None

    def finish(self):
        """After its pipes closed (or the backstop): nothing of it left, its exit reaped, its folder gone."""
        self.stop()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pipe in self.pipes:
            pipe.close()
        self.proc.wait()
        self.remove_workdir()

    def remove_workdir(self):
        if self.host_dir is not None:
            launch.remove_workdir(self.host_dir)
            self.host_dir = None

    def verdict_and_work(self):
        """(the verdict line or None, the work's report {"status", "cpu", "how"} or None) from stdout."""
        verdict, work = None, None
        for line in self.report.decode(errors="replace").split("\n"):
            if line.startswith("{"):
                try:
                    work = json.loads(line)
                except ValueError:
                    pass
            elif verdict is None and line:
                verdict = line
        return verdict, work


def watch(sides, limits, stopping) -> bool:
    """Read every side's pipes until all are closed (each supervisor has exited, and so has everything
    below it). The program's side is ended 1 s after the tests' side closed, every side when `stopping`
    is set, and the supervisors are killed GRACE s past the wall clock. True when stopped."""
    program, tests = sides
    sel = selectors.DefaultSelector()
    for side in sides:
        for pipe in side.pipes:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ, side)
    backstop, tests_done, stopped = time.monotonic() + limits.wall_seconds + GRACE, None, False
    try:
        while sel.get_map():
            now = time.monotonic()
            if stopping is not None and stopping.is_set() and not stopped:
                stopped = True
                for side in sides:
                    side.stop()
            if tests_done is None and not any(key.data is tests for key in sel.get_map().values()):
                tests_done = now
            if tests_done is not None and now - tests_done > 1:
                program.stop()
            if now > backstop:
                for side in sides:
                    side.past_backstop = True
                    side.finish()
                break
            for key, _ in sel.select(timeout=0.1):
                buffer, cap = key.data.pipes[key.fileobj]
                read_capped(sel, key.fileobj, buffer, cap)
    finally:
        sel.close()
    return stopped


def read_capped(sel, pipe, buffer: bytearray, cap: int):
    """Everything readable now from `pipe` into `buffer`; at end of file or past `cap`, stop watching it."""
    while True:
        try:
            chunk = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        if chunk:
            buffer += chunk[:cap - len(buffer)]
        if not chunk or len(buffer) >= cap:
            sel.unregister(pipe)
            pipe.close()  # past the cap the writer's writes fail (EPIPE) instead of filling memory
            return
