"""The code sandbox's tests share these (tests/test_sandbox.py, tests/test_sandbox_resources.py): programs run
through the scorer, then a check that none of their processes is left."""
import os
from pathlib import Path

from Utils import sandbox
from Utils.sandbox import processes

LIMITS = sandbox.SandboxLimits(exec_timeout=1.0)  # wall clock: 5 s
SQUARE = "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n"
CORRECT, WRONG = "def f(x):\n    return x * x\n", "def f(x):\n    return 0\n"


def sandboxed_processes(marker=None, scorer=None) -> list:
    """Live processes of the sandboxes of process `scorer` (default: this one): one of its uids (as root), or
    its TOKEN_PREFIX and pid or `marker` on the command line (other scorers on the machine have theirs)."""
    scorer = scorer or os.getpid()
    found, ours = [], f"{processes.TOKEN_PREFIX}{scorer}-".encode()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        marked = ours in cmdline or (marker is not None and marker.encode() in cmdline)
        if state != "Z" and (marked or uid in processes.uid_range(scorer)):
            found.append((int(name), cmdline.replace(b"\0", b" ")[:80]))
    return found


def run(mode, program, tests=SQUARE, entry_point="f", limits=LIMITS, marker=None):
    result = sandbox.run_many([sandbox.Job(program, tests, entry_point)], limits, mode)[0]
    assert sandboxed_processes(marker) == [], "a sandboxed process was left behind"
    return result


def observed(expected):
    """Tests that pass exactly when the program's f() returns `expected` (what a probe saw)."""
    return f"def check(candidate):\n    seen = candidate()\n    assert seen == {expected!r}, seen\n"
