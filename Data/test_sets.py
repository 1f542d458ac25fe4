"""The test sets an evaluation runs: found from files and folders, loaded and checked before any
generation, scored into prediction rows, and written: <set>_predictions.jsonl and scores.json (into the
staging folder Infer.py swaps in), or what a stopped code scoring keeps; the scores printed, and what a stop
left said."""
import glob
import os
from collections import namedtuple

from Data import code_task
from Data.dataset import load_examples
from Data.scoring import checked_labels, extract_answer, is_correct, scoring_rule
from Utils import output_dirs, sandbox
from Utils.jittor_env import Stopped
from Utils.file_io import write_json, write_jsonl
from Utils.misc import print_main

SPLIT_NAMES = ("test", "val", "validation", "train")
TEST_FILES = ("test.json", "test.jsonl")  # a math or commonsense set; a code set (HumanEval, MBPP)
# One data set of the run: examples[first:first + count] of the joined list, scored by `rule`.
TestSet = namedtuple("TestSet", "name path rule first count")
STOPPED_SAMPLES = "samples.jsonl"  # in <output_dir>.stopped: the completions of a stopped code scoring


def dataset_name(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.dirname(os.path.abspath(path))) if stem in SPLIT_NAMES else stem


def data_files(paths):
    """[(name, file)] from files and dirs (a dir's test.json or test.jsonl, or each sub-dir's)."""
    files = []
    for path in paths:
        if os.path.exists(path) and not os.path.isdir(path):  # a file, or a FIFO (read by polling)
            files.append((dataset_name(path), path))
        elif os.path.isdir(path):
            inside = [f for f in (os.path.join(path, name) for name in TEST_FILES) if os.path.isfile(f)] \
                or sorted(f for name in TEST_FILES for f in glob.glob(os.path.join(path, "*", name)))
            if not inside:
                raise FileNotFoundError(f"{path}: no test.json or test.jsonl in it or in its sub-directories")
            files += [(dataset_name(f), f) for f in inside]
        else:
            raise FileNotFoundError(f"{path}: no such test file or directory")
    return files


def default_test_set(run_dir):
    """The test split the run recorded (Math.py writes <run>/data/test.json for its synthetic data)."""
    path = os.path.join(run_dir, "data", "test.json") if run_dir else None
    if path is None or not os.path.isfile(path):
        where = f"{path} does not exist" if path else "no training run was found"
        raise FileNotFoundError(f"no recorded test split ({where}): pass --data_path with the test files; "
                                "a regenerated set could overlap what the adapter trained on")
    return [("synthetic", path)]


def load_test_sets(sources, max_examples, samples_per_task=1):
    """[(name, file)] -> (joined examples, [TestSet]); two files of one name are refused (their results
    would share one file). A code set's problems give samples_per_task examples each, its rule is its
    kind (humaneval, mbpp); every other set's labels are checked against its scoring rule before any
    generation."""
    examples, test_sets, seen = [], [], {}
    for name, source in sources:
        if name in seen:
            raise ValueError(f"{seen[name]} and {source} are both data set '{name}' (a file is named by its stem, "
                             "a test.json by its folder): their results would overwrite each other; rename one")
        seen[name] = source
        if code_task.is_code_file(source):
            rule, problems = code_task.load_problems(source, max_examples)
            loaded = code_task.examples_for(rule, problems, samples_per_task)
        else:
            loaded = load_examples(source)
            loaded = loaded[:max_examples] if max_examples else loaded
            rule = scoring_rule(name, [ex["answer"] for ex in loaded], source)  # before any generation
            for ex, label in zip(loaded, checked_labels(rule, [ex["answer"] for ex in loaded], source, name)):
                ex["answer"] = label
        test_sets.append(TestSet(name, source, rule, len(examples), len(loaded)))
        examples += loaded
    return examples, test_sets


def example_name(test_sets, i: int) -> str:
    """Example i of the joined examples as a message names it: its place in its data set, and the file."""
    ts = next(ts for ts in test_sets if ts.first <= i < ts.first + ts.count)
    return f"example {i - ts.first} of data set '{ts.name}' ({ts.path})"


def check_prompt_lengths(prompts, test_sets, context):
    """Refuse prompts that leave no room to generate within the context, naming the first of them."""
    too_long = [(ts, i) for ts in test_sets for i in range(ts.first, ts.first + ts.count) if len(prompts[i]) >= context]
    if too_long:
        ts, i = too_long[0]
        raise ValueError(f"{ts.path}: example {i - ts.first} of data set '{ts.name}' has a prompt of {len(prompts[i])} "
                         f"tokens, no room to generate within max_seq_len {context} ({len(too_long)} prompt(s) in "
                         "all): raise --max_seq_len or leave them out")


def score_set(test_set, examples, generations, code=None):
    """(prediction rows, score) of one set: accuracy by its rule (math, commonsense), or pass@k of its
    programs run in the sandbox (code; `code` is (--code_fences, SandboxLimits, a StopFlag or None))."""
    name, path, rule, first, count = test_set
    if rule in code_task.FIELDS:
        return code_task.score_examples(rule, examples[first:first + count], generations, *code, path=path)
    rows, correct = [], 0
    for i, generation in zip(range(first, first + count), generations):
        ex = examples[i]
        ok = is_correct(rule, generation, ex["answer"])
        correct += ok
        rows.append({"index": i - first, "instruction": ex["instruction"], "input": ex["input"],
                     "answer": ex["answer"], "generation": generation,
                     "prediction": extract_answer(rule, generation), "correct": ok})
    return rows, {"accuracy": correct / count, "correct": correct, "total": count, "rule": rule, "path": path}


def score_and_write(test_sets, examples, results, output_dir, meta, code=None, keep=None):
    """Predictions JSONL per data set, scores.json (each set's score and their average); returns the scores.
    code: (--code_fences, SandboxLimits, StopFlag or None) for the code sets, whose accuracy is their pass@1;
    when its StopFlag fires, what was scored is kept as `keep` says, (folder, the run's inputs) (see
    keep_stopped_scoring), and Stopped raised."""
    scores, scored = {}, {}
    for ts in test_sets:
        indices = range(ts.first, ts.first + ts.count)
        try:
            rows, scores[ts.name] = score_set(ts, examples, [results[i]["generation"] for i in indices], code)
        except Stopped as e:  # the rows of the programs that ran, and of the sets scored before
            e.done = {**scored, ts.name: e.done}
            if keep is not None:
                keep_stopped_scoring(e, *keep, test_sets, examples, results, meta)
            raise
        scored[ts.name] = rows
        marked = [(row, results[i]["undecodable_id"]) for row, i in zip(rows, indices)
                  if results[i].get("undecodable_id") is not None]
        for row, unknown in marked:  # its generation is the text before that id
            row["undecodable_id"] = unknown
        if marked:
            scores[ts.name]["undecodable"] = len(marked)
            print_main(f"[infer] {ts.name}: {len(marked)} generation(s) reached a token id outside the tokenizer "
                       "and keep the text before it (undecodable_id in the predictions)")
        write_jsonl(rows, os.path.join(output_dir, f"{ts.name}_predictions.jsonl"))
    summary = {"datasets": scores, "average": sum(s["accuracy"] for s in scores.values()) / len(scores), **meta}
    if code is not None and any(ts.rule in code_task.FIELDS for ts in test_sets):
        summary["sandbox"] = {"isolation": sandbox.isolation(), "how": sandbox.describe(sandbox.isolation()),
                              **vars(code[1])}
    write_json(summary, os.path.join(output_dir, "scores.json"))
    return summary


def stopped_dir(output_dir: str) -> str:
    """Where a code scoring stopped before its end keeps what it scored: beside --output_dir, which keeps
    the earlier complete results."""
    return output_dir + ".stopped"


def keep_stopped_scoring(stopped, kept, inputs, test_sets, examples, results, meta):
    """A stop while the code sets' programs ran (`stopped`, whose .done holds each set's rows scored so far):
    those rows and every code set's completions (a samples file that `Infer.py --samples` scores later)
    go into the folder `kept`, replacing an earlier stop's unless it holds one of the run's `inputs`
    ([(flag, path)]) or what the tools did not write; stopped.kept names it, or stopped.not_kept says why
    it could not be written."""
    done = stopped.done
    samples = [{"task_id": examples[i]["task"]["task_id"], "completion": results[i]["generation"]}
               for ts in test_sets if ts.rule in code_task.FIELDS for i in range(ts.first, ts.first + ts.count)]
    try:
        output_dirs.eval_dir(kept, inputs)
        with output_dirs.replacing(kept) as staging:
            for name, rows in done.items():
                write_jsonl(rows, os.path.join(staging, f"{name}_predictions.jsonl"))
            code_task.write_samples(os.path.join(staging, STOPPED_SAMPLES), samples)
            scored = {ts.name: {"scored": len(done.get(ts.name, ())), "total": ts.count} for ts in test_sets}
            write_json({"stopped_by": str(stopped), "scored": scored, **meta}, os.path.join(staging, "stopped.json"))
    except (OSError, ValueError) as e:
        stopped.not_kept = str(e)
        return
    stopped.kept = kept


def stopped_message(e: Stopped) -> str:
    """What an evaluation stopped by `e` leaves: nothing, or what keep_stopped_scoring kept of a code scoring."""
    if e.done is None:
        return f"stopped by {e} before the evaluation was done; nothing was written"
    scored = sum(map(len, e.done.values()))
    where = (f"kept in {e.kept}: the {scored} scored rows in <set>_predictions.jsonl and every completion in "
             f"{STOPPED_SAMPLES}, which --samples scores" if e.kept else f"{scored} scored rows not kept: {e.not_kept}")
    return (f"stopped by {e} while the code sets' programs ran, before the evaluation was done; --output_dir "
            f"is left as it was; {where}")


def print_scores(summary, output_dir):
    """score_and_write's summary, a line per data set, then the average and where scores.json is."""
    for name, s in summary["datasets"].items():
        passes = "".join(f"  {k} {100 * v:6.2f}%" for k, v in s.items() if k.startswith("pass@"))
        print_main(f"  {name:<12} {100 * s['accuracy']:6.2f}%  ({s['correct']}/{s['total']}){passes}")
    print_main(f"  {'average':<12} {100 * summary['average']:6.2f}%   -> {output_dir}/scores.json")
    if "sandbox" in summary:
        print_main(f"  programs ran in: {summary['sandbox']['how']}")
