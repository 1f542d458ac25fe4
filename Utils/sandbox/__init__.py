"""Run untrusted Python programs (model-written code) against their tests so that they can neither harm
the machine nor write their own verdict (the threat model: docs/code.md).

One Job runs as two sandboxed processes, each under its own supervisor (sandboxed/launch.py): the
program's (candidate.py) and the tests' (checker.py), joined by two pipes that carry only data
(wire.py). The tests' process writes the verdict to its supervisor's report pipe, read here; the
program's process has no descriptor of it and cannot reach that process (another process, uid or PID
namespace; no ptrace; no signal to it). Each supervisor reports how its process ended and its CPU time,
and kills everything that process started before it reports.

Isolation, chosen once per process (isolation()):
- "bwrap": each supervisor is the init of its own bubblewrap namespaces (mount, pid, network, ipc, uts):
  a read-only system of /usr and the Python installation, no /proc, a fresh size-capped tmpfs working
  directory, no network; the processes below get the filters of the floor too where the kernel has them.
- "landlock" (the floor, where bubblewrap cannot make its namespaces): the supervisor is a child
  subreaper in a fresh private working directory; its process confines itself with Landlock (reads below
  the system and Python folders, writes only in the working directory) and seccomp (no exec, no socket,
  no ptrace, no namespaces).
Neither: SandboxUnavailable, and nothing runs. Both: setrlimit caps (CPU, address space, processes,
file size, open files), as root an unprivileged uid per process, a clean environment, stdout discarded,
stderr kept up to OUTPUT_CAP, at most one Job per core at once (the processes: processes.py).
"""
import concurrent.futures
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import threading
from collections import namedtuple
from dataclasses import dataclass

from Utils.jittor_env import Stopped
from .processes import MAX_ENTRIES, TOKEN_PREFIX, UIDS_PER_RUN, Supervised, is_root, uid_range, watch
from .sandboxed import confine, launch
from Utils.settings import check_fields, setting

PASSED, FAILED, TIMED_OUT, CRASHED = "passed", "failed", "timed out", "crashed"

# What to run: the program; the tests, in a namespace of the program's names after `given` (code of the
# problem's, such as HumanEval's prompt, run with the tests); then check(entry_point) when entry_point is
# not None; shadows: the builtins' names the program's own may replace for the tests.
Job = namedtuple("Job", "program tests entry_point shadows given", defaults=(None, (), ""))
# status: PASSED, FAILED, TIMED_OUT or CRASHED; error: the error's last line ("" for a pass); exit_code: the
# program's process's (subprocess's convention: -N for signal N); stderr: the program's, up to OUTPUT_CAP
Result = namedtuple("Result", "status error exit_code stderr")


class SandboxUnavailable(ValueError):
    """Neither bubblewrap nor Landlock and seccomp work here: no program may run."""


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
        cores = min(len(os.sched_getaffinity(0)), UIDS_PER_RUN // 2)
        return min(self.exec_workers or cores, cores)


# ---- which isolation ---------------------------------------------------------------------

_probed = {}  # mode: (works, why), each probed once per process


def probe(mode: str):
    """(True, "") when a correct program passes its tests in `mode` here, else (False, why not)."""
    if mode not in _probed:
        if mode == "bwrap" and shutil.which("bwrap") is None:
            _probed[mode] = False, "bubblewrap is not installed (apt-get install bubblewrap)"
        elif mode == "landlock" and confine.landlock_abi() < 1:
            _probed[mode] = False, "the kernel has no Landlock (Linux 5.13 or later, with landlock among its LSMs)"
        elif mode == "landlock" and not confine.seccomp_supported():
            _probed[mode] = False, f"no seccomp filter is written for {os.uname().machine}"
        else:
            try:
                result = run_one(Job("def f():\n    return 1\n", "def check(f):\n    assert f() == 1\n", "f"),
                                 SandboxLimits(), mode)
                _probed[mode] = (True, "") if result.status == PASSED else \
                    (False, f"a correct program was {result.status}: {result.error}")
            except (OSError, subprocess.SubprocessError) as e:
                _probed[mode] = False, str(e)
    return _probed[mode]


def isolation() -> str:
    """"bwrap" when bubblewrap works here, else "landlock"; SandboxUnavailable when neither does."""
    for mode in ("bwrap", "landlock"):
        if probe(mode)[0]:
            return mode
    raise SandboxUnavailable("no sandbox for the code programs works here: bubblewrap: " + probe("bwrap")[1] +
                             "; Landlock and seccomp: " + probe("landlock")[1])


def describe(mode: str) -> str:
    """One line saying what contains the programs, for logs and scores.json."""
    user = "an unprivileged uid per process" if is_root() else f"uid {os.getuid()}"
    filters = f"Landlock ABI {confine.landlock_abi()}, seccomp" if confine.landlock_abi() else "seccomp"
    if mode == "bwrap":
        return f"bubblewrap: mount, pid, net, ipc and uts namespaces, read-only system, tmpfs workdir; {filters}; " \
               f"setrlimit; {user}; verdict from a separate tests process"
    return f"{filters}, setrlimit, {user}, no namespaces; verdict from a separate tests process"


# ---- one Job -----------------------------------------------------------------------------

def run_one(job: Job, limits: SandboxLimits, mode: str, slot: int = 0, stopping=None):
    """Run one Job in the sandbox; its Result, or None when `stopping` (a threading.Event) was set."""
    default_sigchld()
    token = f"{TOKEN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    uids = (uid_range()[2 * slot], uid_range()[2 * slot + 1]) if is_root() else (None, None)
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    sides = []
    try:
        sides.append(Supervised("candidate", {"program": job.program}, requests_r, replies_w, limits, mode,
                                uids[0], token))
        sides.append(Supervised("checker", {"tests": job.tests, "entry_point": job.entry_point, "given": job.given,
                                            "shadows": list(job.shadows)}, requests_w, replies_r, limits, mode,
                                uids[1], token))
    except BaseException:
        for side in sides:
            side.finish()
        raise
    finally:
        for fd in (requests_r, requests_w, replies_r, replies_w):
            os.close(fd)
    try:
        stopped = watch(sides, limits, stopping)
    finally:
        for side in sides:
            side.finish()
    if stopped:
        return None
    try:
        return judge(*sides, limits)
    except Exception as error:  # one program's odd ending must not cost the other programs' results
        return Result(CRASHED, f"the scorer could not tell how it ended ({type(error).__name__}: {error})", None, "")


def default_sigchld():
    """Jittor's SIGCHLD handler ends the process when a child dies by a signal: a scorer needs the default
    action (only the main thread may set it; run_many does first)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def how_it_ended(work) -> str:
    code = os.waitstatus_to_exitcode(work["status"])
    if code == launch.CONFINE_FAILED:
        return "the sandbox could not confine it"
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit status {code}"


def signal_name(number: int) -> str:
    """SIGKILL, or "signal 40" for a number Python names not (the real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_stderr_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f": {lines[-1][:300]}" if lines else ""


def judge(program: Supervised, tests: Supervised, limits: SandboxLimits) -> Result:
    """The Result: the tests' verdict when they finished, else which limit or exit ended them."""
    verdict, _ = tests.verdict_and_work()
    _, work = program.verdict_and_work()
    stderr = program.stderr.decode(errors="replace")
    keep = dict(exit_code=os.waitstatus_to_exitcode(work["status"]) if work else None, stderr=stderr)
    if verdict == PASSED:
        return Result(PASSED, "", **keep)
    if verdict is not None and verdict.startswith(FAILED + "\t"):
        return Result(FAILED, verdict.split("\t", 1)[1], **keep)
    limit = math.ceil(limits.exec_timeout)
    ends = [side.verdict_and_work()[1] for side in (program, tests)]
    if any(side.past_backstop for side in (program, tests)) or any(end["how"] == "wall" for end in ends if end):
        return Result(TIMED_OUT, f"wall clock limit of {limits.wall_seconds:g} s", **keep)
    if any(end["how"] == "entries" for end in ends if end):
        return Result(FAILED, f"more than {MAX_ENTRIES} files and folders in its working directory", **keep)
    for side, end in zip((program, tests), ends):
        if end is None:  # a supervisor that failed (it writes why on its stderr)
            return Result(CRASHED, "the sandbox failed" + last_stderr_line(side.stderr.decode(errors="replace")),
                          **keep)
    for end in ends:
        sig = -os.waitstatus_to_exitcode(end["status"])
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and end["cpu"] >= limit):
            return Result(TIMED_OUT, f"CPU time limit of {limit} s", **keep)
    if verdict is not None and verdict.startswith("gone\t"):
        return Result(CRASHED, f"ended before its tests finished ({how_it_ended(work)})" + last_stderr_line(stderr),
                      **keep)
    return Result(CRASHED, f"the tests' process ended ({how_it_ended(ends[1])})" +
                  last_stderr_line(tests.stderr.decode(errors="replace")), **keep)


# ---- many Jobs -----------------------------------------------------------------------------

def run_many(jobs, limits: SandboxLimits, mode: str = None, progress=None, stop=None) -> list:
    """Run every Job of `jobs`, at most limits.workers() at once; their Results in order. `mode` forces an
    isolation level ("bwrap" or "landlock"); `progress` is called per result; `stop` (a
    Utils.jittor_env.StopFlag) is polled every 0.1 s: when it fires, the running programs are ended, no
    other starts, and Stopped is raised, holding the results of those that finished (None for the others)."""
    mode = mode or isolation()
    default_sigchld()
    workers = max(1, min(limits.workers(), len(jobs)))
    slots, stopping = queue.Queue(), threading.Event()
    for slot in range(workers):
        slots.put(slot)

    def one(job):
        if stopping.is_set():
            return None
        slot = slots.get()
        try:
            result = run_one(job, limits, mode, slot, stopping)
        finally:
            slots.put(slot)
        if result is not None and progress is not None:
            progress()
        return result

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending = [pool.submit(one, job) for job in jobs]
        futures = list(pending)
        try:
            while pending:
                _, pending = concurrent.futures.wait(pending, timeout=0.1)
                if stop is not None and stop.poll():
                    stopping.set()
        except BaseException:  # KeyboardInterrupt where the stop signals are not blocked
            stopping.set()
            raise
    results = [future.result() for future in futures]
    if stopping.is_set():  # None for the programs that did not finish
        raise Stopped(stop.name, done=results)
    return results
