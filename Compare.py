"""Train and evaluate several methods, MoA and the paper's baselines, on the same data with the
same budget, and print one table like the paper's: method, trainable parameters, accuracy per
data set, training tokens/s.

    python Compare.py                                  # every method on the tiny demo, in minutes
    python Compare.py --methods sparse soft lora molora --max_steps 400
    python Compare.py --recipe math --llama_path <8B dir> --data_path $MOA/datasets/math_14k/train.json \\
        --test_data ../shared/data/math --max_steps 0 --ranks 8

Each method is one Math.py run (the recipe, then the method's settings from
Utils/settings.METHOD_PRESETS, then --max_steps and the flags after `--`, which may not
override a preset or a flag of Compare.py's own; a model setting among them that does nothing in a method,
as --p_adapter_size in LoRA's, is left out of that method's run, saying so) in
<output_dir>/<method>/, then one Infer.py evaluation in <output_dir>/<method>/eval/; the
base model alone is scored once as a reference row. A method whose evaluation already
exists with the same command is not run again, and an interrupted training continues from
its checkpoint, so rerunning the command after a stop picks up where it was. Each run's
output goes to <output_dir>/<method>/compare.log; a method whose run fails is a row marked failed with the
last error line of its run, the other methods still run, and the exit code is 5. The table's footer states the
steps each method trained, from its run's log.txt (a recipe's epochs may end before --max_steps). The table is
printed and written to <output_dir>/compare.md and compare.json. The output folder is Compare.py's own: its manifest lists what
it wrote, and a file there that no run of the tools wrote is never replaced (Utils/output_dirs.py).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from Data.test_sets import data_files, load_test_sets
from Utils.jittor_env import StopForwarder, Stopped, stop_exit_status
from Utils.output_dirs import check_claimable, check_output_dir, check_tool, read_manifest, record_written
from Models.ModelArgs import ModelArgs, idle_settings
from Utils.settings import (EVERY_LAYER_SPANS, METHOD_PRESETS, RECIPES, ArgumentParser, add_arguments, given,
                            recipe_values, setting_fields)
from Utils.file_io import atomic_write, read_json_object, write_json

# Data.test_sets imports Jittor (through Utils.misc), whose SIGCHLD handler ends this process when a child dies by a
# signal; a failed run must be reported instead.
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
REPO = os.path.dirname(os.path.abspath(__file__))
BASE_ROW = "base"
FAILED_EXIT = 5  # the table is written, and some method's row is marked failed


def get_args_parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="methods: " + ", ".join(f"{k} = {v}" for k, v in METHOD_PRESETS.items()))
    p.add_argument("--methods", nargs="+", choices=list(METHOD_PRESETS), default=list(METHOD_PRESETS), metavar="METHOD",
                   help=f"methods to compare, in table order, from {', '.join(METHOD_PRESETS)} (default: all)")
    p.add_argument("--recipe", default="demo", help=f"the recipe every method starts from: {', '.join(RECIPES)} "
                   "or a JSON file of settings (default: demo)")
    p.add_argument("--max_steps", type=int, default=800, help="optimizer steps per method, the shared budget; "
                   "0 = the recipe's epochs (default: 800)")
    p.add_argument("--max_examples", type=int, default=150, help="test examples per data set; 0 = all (default: 150)")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks per training run (default: 2)")
    p.add_argument("--llama_path", default=None, help="the base model folder, Meta's or Hugging Face's (default: the "
                   "recipe's, the tiny demo base)")
    p.add_argument("--data_path", default=None, help="training JSON (default: the synthetic math problems)")
    p.add_argument("--test_data", nargs="+", default=None, help="test files or dirs for Infer.py (default: each "
                   "run's synthetic test split)")
    p.add_argument("--output_dir", default="./output/compare", help="one sub-folder per method (default: "
                   "./output/compare)")
    p.add_argument("--overwrite", action="store_true", help="rerun every method, replacing earlier results")
    p.add_argument("math_flags", nargs="*", help="after `--`: more Math.py flags for every method (not one a "
                   "method's preset or this command sets: the table's rows would not be what they say); a model "
                   "setting that does nothing in a method is left out of its run")
    return p


SETTINGS = {f.name for f in setting_fields(ModelArgs)}
# Math.py flags Compare.py sets itself for every run
OWN_FLAGS = ("recipe", "max_steps", "output_dir", "llama_path", "data_path", "overwrite", "resume")


def check_math_flags(args):
    """Refuse flags after `--` that would override what a row's label promises (a method's preset) or what
    this command sets, or that do nothing in every method compared."""
    named = {token[2:].split("=")[0] for token in args.math_flags if token.startswith("--")}
    named |= {name[3:] for name in named if name.startswith("no-")}
    clash = [(f"--{name}", f"the {method} preset") for method in args.methods for name in METHOD_PRESETS[method]
             if name in named] + [(f"--{name}", "Compare.py itself") for name in OWN_FLAGS if name in named]
    if clash:
        flag, owner = clash[0]
        raise ValueError(f"{flag} after `--` would override {owner}, and the table would show the row under a "
                         "method it no longer is: set it through Compare.py's own flags or leave it out")
    left_out = [method_flags(args, method)[1] for method in args.methods]
    nowhere = [name for name in left_out[0] if all(name in idle for idle in left_out)]
    if nowhere:
        raise ValueError(f"--{nowhere[0]} after `--` does nothing in any method compared ({left_out[0][nowhere[0]]} "
                         f"in {args.methods[0]}): leave it out")


def settings_parser() -> ArgumentParser:
    """The model settings among Math.py's flags (the rest pass through as they are)."""
    parser = ArgumentParser(prog="Compare.py --", add_help=False, allow_abbrev=False)
    add_arguments(parser, ModelArgs)
    return parser


def method_flags(args, method: str) -> tuple:
    """(the flags after `--` for `method`'s Math.py, {setting: why} of those left out): a model setting that does
    nothing in that method's model (Models/ModelArgs.IDLE_SETTINGS, which Math.py refuses when given) applies to
    the other methods only, as --p_adapter_size does nothing in LoRA's."""
    given_settings, rest = settings_parser().parse_known_args(args.math_flags)
    shared = given(given_settings, ModelArgs)
    preset = METHOD_PRESETS[method]
    recipe = recipe_values(args.recipe, preset.get("variant", shared.get("variant")))
    values = {**{name: "all" for name in EVERY_LAYER_SPANS}, **recipe, **preset, **shared}
    spans = [int(n) for name in ("lora_layers", "p_adapter_layers", "prompt_layers")
             for n in re.findall(r"\d+", str(values.get(name, "")))]
    try:  # the base's shape is not needed: which layers have experts, not how many layers there are
        model = ModelArgs(**{k: v for k, v in values.items() if k in SETTINGS}, n_layers=max([1, *spans]))
    except (TypeError, ValueError):  # Math.py refuses it, naming where each setting came from
        return list(args.math_flags), {}
    left_out = {k: why for k, why in idle_settings(model).items() if k in shared}
    return rest + preset_flags({k: v for k, v in shared.items() if k not in left_out}), left_out


def preset_flags(settings: dict) -> list:
    flags = []
    for name, value in settings.items():
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def commands(args, method: str, trained: str = None) -> dict:
    """The Math.py and Infer.py command lines of one method (the base row: Infer.py alone, reading the base and
    the test split from the run of method `trained`, the first method's by default)."""
    run = os.path.join(args.output_dir, method)
    python = sys.executable
    common = ["--llama_path", args.llama_path] if args.llama_path else []
    infer = [python, "Infer.py", "--output_dir", os.path.join(run, "eval")]
    infer += ["--max_examples", str(args.max_examples)] if args.max_examples else []
    infer += ["--data_path", *args.test_data] if args.test_data else []
    if method == BASE_ROW:  # any method's run knows the base and the test split
        first = os.path.join(args.output_dir, trained or args.methods[0])
        return {"infer": infer + ["--adapter_path", os.path.join(first, "adapter"), "--no_adapter"]}
    math = [python, "Math.py", "--recipe", args.recipe, *preset_flags(METHOD_PRESETS[method]), *common,
            "--max_steps", str(args.max_steps), "--output_dir", run]
    math += ["--data_path", args.data_path] if args.data_path else []
    math += [*method_flags(args, method)[0], *(["--overwrite"] if args.overwrite else ["--resume", "auto"])]
    if args.ranks > 1:
        math = ["mpirun", "--oversubscribe", "-np", str(args.ranks), *math]
    return {"math": math, "infer": infer + ["--adapter_path", os.path.join(run, "adapter")]}


class MethodFailed(RuntimeError):
    """A method's Math.py or Infer.py run exited with an error: its row is marked failed, the others still run."""
    def __init__(self, what: str, returncode: int, log_path: str, said: str):
        super().__init__(f"{what} failed (exit {returncode}; its output is in {log_path}): {said}")
        self.said = said


def run_logged(command: list, log_path: str, what: str, stops: StopForwarder):
    """Run one command with its output appended to log_path, passing stop signals on to it and waiting for
    it (then Stopped); a failure (MethodFailed) names the method, the log and the last error line this run
    wrote there (not an earlier run's)."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        start = log.tell()
        returncode = stops.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if stops.signal is not None:
        raise Stopped(f"{stops.name}; {what} stopped with exit {returncode} (its output is in {log_path}): "
                      "rerun the command to continue")
    if returncode:
        with open(log_path, errors="replace") as f:
            f.seek(start)
            lines = [line.strip() for line in f if line.strip()]
        said = next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "")
        raise MethodFailed(what, returncode, log_path, said or "(no output)")


def end_record(run: str) -> dict:
    """The last 'end' line Math.py wrote into the run's log.txt, its tokens/s the last process's that timed a step
    (a rerun that resumes a finished training trains none)."""
    with open(os.path.join(run, "log.txt")) as f:
        ends = [r for r in map(json.loads, f) if r.get("event") == "end"]
    timed = [r for r in ends if r.get("timed_steps")] or ends
    return {**ends[-1], "train_tokens_per_s": timed[-1]["train_tokens_per_s"]}


def evaluate_method(args, method: str, stops: StopForwarder, trained: str = None) -> dict:
    """Train (or continue) and evaluate one method unless the same command already did; its table row."""
    run = os.path.join(args.output_dir, method)
    os.makedirs(run, exist_ok=True)
    cmds = commands(args, method, trained)
    done_path, scores_path = os.path.join(run, "compare.json"), os.path.join(run, "eval", "scores.json")
    if not args.overwrite and os.path.isfile(done_path) and os.path.isfile(scores_path):
        earlier = read_json_object(done_path, "compare record")
        if earlier.get("commands") == cmds:
            print(f"[compare] {method}: done earlier with the same command, reused")
            return earlier["row"]
    started = time.time()
    log_path = os.path.join(run, "compare.log")
    if "math" in cmds:
        for name, why in method_flags(args, method)[1].items():
            print(f"[compare] {method}: --{name} left out: {why}")
        print(f"[compare] {method}: training ({os.path.relpath(log_path)})", flush=True)
        run_logged(cmds["math"], log_path, f"{method}: Math.py", stops)
    print(f"[compare] {method}: evaluating", flush=True)
    run_logged(cmds["infer"], log_path, f"{method}: Infer.py", stops)
    scores = read_json_object(scores_path, "scores")
    row = {"method": method, "accuracy": {k: v["accuracy"] for k, v in scores["datasets"].items()},
           "average": scores["average"]}
    if "math" in cmds:
        end = end_record(run)
        row.update(trainable_params=end["trainable_params"], steps=end["step"],
                   train_tokens_per_s=end["train_tokens_per_s"])
    write_json({"commands": cmds, "row": row}, done_path)
    print(f"[compare] {method}: average {100 * row['average']:.1f}% ({time.time() - started:.0f} s)", flush=True)
    return row


def table(rows: list) -> str:
    """The markdown table; a failed method's row says so, with its run's last error line."""
    datasets = list(dict.fromkeys(name for row in rows for name in row.get("accuracy", {})))
    head = ["method", "trainable params", *datasets, "average", "train tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        if "failed" in row:
            said = row["failed"].replace("|", "\\|")
            cells = [row["method"], "-", *["failed"] * len(datasets), f"failed: {said}", "-"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [row["method"], f"{row['trainable_params']:,}" if "trainable_params" in row else "-"]
        cells += [f"{100 * row['accuracy'][d]:.1f}" if d in row["accuracy"] else "-" for d in datasets]
        cells += [f"{100 * row['average']:.1f}",
                  f"{row['train_tokens_per_s']:.0f}" if row.get("train_tokens_per_s") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def footer(args, rows: list) -> str:
    """What the table's rows ran: the steps each method trained as its run's log.txt records them (a recipe's
    epochs may end before the --max_steps budget), not the budget asked for."""
    trained = ", ".join(f"{row['method']} {row['steps']}" for row in rows if "steps" in row) or "none"
    budget = f"--max_steps {args.max_steps}" if args.max_steps else "the recipe's epochs"
    failed = [row["method"] for row in rows if "failed" in row]
    return (f"recipe {args.recipe}, {args.ranks} rank(s); optimizer steps trained (from each run's log.txt): "
            f"{trained} (budget: {budget}, or the recipe's epochs where they end first)"
            + (f"; failed: {', '.join(failed)} (each one's log: <output_dir>/<method>/compare.log)" if failed else "")
            + f"; {args.max_examples or 'all'} test examples per data set; accuracy in %; train tokens/s over the "
            "steps that compiled nothing (a step meeting a new batch shape builds Jittor's kernels)")


def main(argv=None):
    """Exit codes: 0 done, 2 bad arguments, 5 the table written with some method's row marked failed (an
    `error:` line for each, naming its log; the other methods ran), 4 the table could not be written, 130 / 143 /
    138 stopped by SIGINT / SIGTERM / SIGUSR1 (passed on to the run in progress, which stops as the tools do;
    rerunning the command continues)."""
    args = get_args_parser().parse_args(argv)
    if args.max_steps < 0 or args.max_examples < 0 or args.ranks < 1:
        get_args_parser().error("--max_steps and --max_examples must be >= 0 and --ranks >= 1")
    with StopForwarder() as stops:
        return compare_methods(args, stops)


def check_test_data(args):
    """The test sets as Infer.py will load them, before any method trains (Infer.py runs after the training)."""
    if not args.test_data:
        if args.data_path:
            raise ValueError(f"--data_path {args.data_path} without --test_data: Math.py records a test split only "
                             "for its synthetic data, so the methods could not be scored; give --test_data")
        return
    try:
        load_test_sets(data_files(args.test_data), args.max_examples or None)
    except FileNotFoundError as e:
        raise ValueError(f"--test_data {e}") from None


def claim_output_dir(args):
    """The output folder is Compare.py's (its manifest, Utils/output_dirs.py): refuse another tool's folder (a
    training run's) and a name this command writes that holds something no run of the tools wrote."""
    check_output_dir(args.output_dir)
    check_tool(args.output_dir, "Compare.py")
    tool = read_manifest(args.output_dir).get("tool") if os.path.isdir(args.output_dir) else None
    names = ["compare.md", "compare.json", *args.methods, BASE_ROW]
    # what a Compare.py of before manifests wrote here is its own too
    earlier = earlier_entries(args.output_dir, names) if tool is None and os.path.isdir(args.output_dir) else []
    check_claimable(args.output_dir, [n for n in names if n not in earlier])
    os.makedirs(args.output_dir, exist_ok=True)
    record_written(args.output_dir, "Compare.py", names)


def earlier_entries(folder: str, names: list) -> list:
    """Of `names` in `folder`, what a Compare.py of before manifests wrote, told by content: a method's or the
    base row's folder holding its compare.log, and the table (compare.json of a note and rows, and compare.md
    beside it)."""
    found = [n for n in names if os.path.isfile(os.path.join(folder, n, "compare.log"))]
    try:
        table = read_json_object(os.path.join(folder, "compare.json"), "comparison table")
    except (OSError, ValueError):
        return found
    return found + ["compare.json", "compare.md"] if {"note", "rows"} <= set(table) else found


def compare_methods(args, stops: StopForwarder) -> int:
    """Every method's row, then the table (main's exit codes)."""
    rows = []
    try:
        check_math_flags(args)
        check_test_data(args)
        claim_output_dir(args)
        for method in [*args.methods, BASE_ROW]:
            trained = next((row["method"] for row in rows if "failed" not in row), None)
            if method == BASE_ROW and trained is None:
                rows.append({"method": BASE_ROW, "failed": "no method trained: the base row reads the base and "
                             "test split of a finished run"})
                continue
            try:
                rows.append(evaluate_method(args, method, stops, trained))
            except MethodFailed as e:  # the other methods still run; the exit code says one failed
                print(f"error: {e}", file=sys.stderr)
                rows.append({"method": method, "failed": e.said})
    except Stopped as e:
        print(f"error: stopped by {e}", file=sys.stderr)
        return stop_exit_status(stops.name)
    except (RuntimeError, ValueError) as e:  # RunDirError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {e.filename or args.output_dir}: {e.strerror or e}", file=sys.stderr)
        return 4
    text, note = table(rows), footer(args, rows)
    try:
        atomic_write(os.path.join(args.output_dir, "compare.md"),
                     lambda tmp: Path(tmp).write_text(text + "\n\n" + note + "\n"))
        write_json({"note": note, "rows": rows}, os.path.join(args.output_dir, "compare.json"))
    except OSError as e:
        print(f"error: cannot write {e.filename or args.output_dir}: {e.strerror or e}", file=sys.stderr)
        return 4
    print("\n" + text + "\n\n" + note)
    return FAILED_EXIT if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
