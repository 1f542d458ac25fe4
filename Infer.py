"""Evaluate a MoA adapter (or the base alone) on math or commonsense test sets: generate, score, dump router weights.

    python Infer.py                          # newest ./output/*/adapter, its base, the synthetic test set
    python Infer.py --adapter_path output/run/adapter --data_path ../shared/data/math --save_weights
    python Infer.py --no_adapter --llama_path assets/tiny-math-base
    mpirun -np 2 python Infer.py ...         # rank r takes examples r::world; rank 0 merges and scores

Ranks hand their results to rank 0 through part files in --output_dir (one
machine, or a shared file system). As root, mpirun itself needs
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (or --allow-run-as-root).
Greedy results do not depend on the batch size, the batching or the number of ranks.

Writes into --output_dir: <dataset>_predictions.jsonl per data set, scores.json
(accuracy per data set and their average) and, with --save_weights,
type_weight.pkl, token_weight.pkl and heatmaps (structure: Utils/plots.py).
The results of one evaluation, never a mix: everything is written into a staging folder
beside --output_dir and replaces it as a whole once every data set is scored. A folder
holding anything else than these results is refused (it is not an evaluation folder).
Exit codes: 0 done, 2 bad input (one line on stderr), 4 a file could not be written (disk
full, permissions), 130 / 143 stopped by SIGINT / SIGTERM (nothing written).
"""
import Utils.jittor_env  # must precede numpy and jittor (see block_stop_signals)

if __name__ == "__main__":
    Utils.jittor_env.block_stop_signals()

import argparse
import glob
import json
import os
import pickle
import shutil
import sys
from collections import namedtuple

from tqdm import tqdm

from Data.dataset import load_examples
from Data.prompts import format_prompt
from Data.scoring import extract_answer, is_correct, scoring_rule
from Models.ModelArgs import BASE_FIELDS, ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.adapters import ADAPTER_WEIGHTS, adapter_config_path, load_adapter, read_adapter_config
from Models.formats.base_model import base_args, build_model, open_tokenizer
from Models.generate import check_kv_cache_memory, generate
from Data.tiny_base import ensure_default_base
from Models.formats.pth import CheckpointError
from Utils import misc, output_dirs
from Utils.jittor_env import StopFlag
from Utils.misc import print_main
from Utils.settings import GenerationArgs, add_arguments, given

SPLIT_NAMES = ("test", "val", "validation", "train")
# One data set of the run: examples[first:first + count] of the joined list, scored by `rule`.
TestSet = namedtuple("TestSet", "name path rule first count")


class Stopped(Exception):
    """SIGINT or SIGTERM arrived during generation."""

def get_args_parser():
    p = argparse.ArgumentParser(description="Generate answers with a MoA adapter, score them, dump router weights.")
    p.add_argument("--adapter_path", default=None,
                   help="our adapter dir (adapter.pth + adapter_params.json) or the authors' adapter.pth; "
                        "default: the newest ./output/*/adapter")
    p.add_argument("--output_root", default="./output", help="where training runs live (for the defaults)")
    p.add_argument("--llama_path", default=None,
                   help="the base: a Meta dir (params.json, consolidated.*.pth, tokenizer.model) or a Hugging Face "
                        "one (config.json, *.safetensors, tokenizer.json); default: the run's args.json "
                        "llama_path, else the tiny demo base")
    p.add_argument("--no_adapter", action="store_true", help="evaluate the base alone (no experts)")
    p.add_argument("--data_path", nargs="+", default=None,
                   help="test files (JSON lists in the LLM-Adapters schema) or dirs holding test.json or "
                        "sub-dirs with test.json; default: the run's synthetic test set, else 300+ generated problems")
    p.add_argument("--output_dir", default=None,
                   help="predictions, scores and plots; default: <run dir>/eval (or eval_base with --no_adapter)")
    p.add_argument("--max_examples", type=int, default=None, help="evaluate only the first N examples of each data set")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each batch draws from (seed, rank, batch))")
    p.add_argument("--batch_size", type=int, default=8, help="prompts generated together per rank")
    p.add_argument("--save_weights", action="store_true",
                   help="save type_weight.pkl / token_weight.pkl and draw router heatmaps")
    p.add_argument("--plot_examples", type=int, default=3, help="examples drawn in the token_weight heatmap")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="use the GPU when there is one, or cpu")
    add_arguments(p.add_argument_group("decoding (default: the run's recipe in its args.json, else as shown)"),
                  GenerationArgs)
    moa = p.add_argument_group("MoA settings: an adapter.pth without adapter_params.json beside it needs the "
                               "ones it was trained with; beside an adapter_params.json (ours or the authors') "
                               "its settings are used and a flag that differs from them is refused. "
                               "--max_seq_len bounds prompt + generation (default: the adapter's max_seq_len, "
                               "else 2048); longer prompts are refused. --precision may differ from training")
    add_arguments(moa, ModelArgs, optional=True)
    return p


# ---- where things are ---------------------------------------------------------------

def newest_adapter(output_root):
    found = glob.glob(os.path.join(output_root, "*", "adapter", ADAPTER_WEIGHTS))
    return os.path.dirname(max(found, key=os.path.getmtime)) if found else None


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def resolve_run(args):
    """(adapter path or None, run dir or None, run's args.json dict, llama_path)."""
    newest = newest_adapter(args.output_root)
    adapter = None if args.no_adapter else args.adapter_path or newest
    if not args.no_adapter and adapter is None:
        raise FileNotFoundError(f"no adapter under {args.output_root}/*/adapter: train one with Math.py, "
                                "pass --adapter_path, or use --no_adapter")
    # the run whose test split, base and decoding apply: the adapter's, also when --no_adapter scores its base
    located = args.adapter_path or (None if args.no_adapter and args.llama_path else newest)
    if located is not None and not os.path.exists(located):
        raise FileNotFoundError(f"{located}: no such adapter file or directory")
    folder = None if located is None else located if os.path.isdir(located) else os.path.dirname(located)
    run_dir = os.path.dirname(os.path.abspath(folder)) if folder else None
    run_args_path = os.path.join(run_dir, "args.json") if run_dir else None
    run_args = read_json(run_args_path) if run_args_path and os.path.isfile(run_args_path) else {}
    llama_path = args.llama_path or run_args.get("llama_path") or ensure_default_base()
    return adapter, run_dir, run_args, llama_path


def dataset_name(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.dirname(os.path.abspath(path))) if stem in SPLIT_NAMES else stem


def data_files(paths):
    """[(name, file)] from files and dirs (a dir's test.json, or each sub-dir's test.json)."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append((dataset_name(path), path))
        elif os.path.isdir(path):
            inside = [os.path.join(path, "test.json")] if os.path.isfile(os.path.join(path, "test.json")) \
                else sorted(glob.glob(os.path.join(path, "*", "test.json")))
            if not inside:
                raise FileNotFoundError(f"{path}: no test.json in it or in its sub-directories")
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


def load_test_sets(sources, max_examples):
    """[(name, file)] -> (joined examples, [TestSet]); repeated names get a suffix."""
    examples, test_sets, seen = [], [], {}
    for name, source in sources:
        seen[name] = seen.get(name, 0) + 1
        name = name if seen[name] == 1 else f"{name}_{seen[name]}"
        loaded = load_examples(source)
        loaded = loaded[:max_examples] if max_examples else loaded
        rule = scoring_rule(name, [ex["answer"] for ex in loaded], source)  # before any generation
        test_sets.append(TestSet(name, source, rule, len(examples), len(loaded)))
        examples += loaded
    return examples, test_sets


def model_overrides(args, adapter, llama_path):
    """ModelArgs fields for the model: the adapter's config, then the MoA flags given."""
    overrides = {}
    config_path = adapter_config_path(adapter)
    config = read_adapter_config(adapter)  # ours or the authors' (their option names)
    if config is not None:
        base = base_args(llama_path).to_dict()
        other_base = [f"{k}: adapter {config[k]!r}, base {base[k]!r}" for k in BASE_FIELDS
                      if k in config and config[k] != base[k]]
        if other_base:
            raise CheckpointError(f"{config_path}: adapter trained on another base than {llama_path}: "
                                  + "; ".join(other_base))
        overrides = {k: v for k, v in config.items() if k not in BASE_FIELDS}
    return {**overrides, **given(args, ModelArgs)}


def load_model(args, adapter, llama_path, max_seq_len):
    """The base with the adapter's experts (none with --no_adapter), weights loaded strictly."""
    overrides = model_overrides(args, adapter, llama_path) if adapter else {}
    try:
        model_args = base_args(llama_path, **{**overrides, "max_seq_len": max_seq_len,
                                              "max_batch_size": args.batch_size})
        model = build_model(llama_path, model_args)
    except TypeError as e:  # a config field of the wrong type
        raise ValueError(str(e)) from None
    if adapter:
        try:
            load_adapter(model, adapter)
        except CheckpointError as e:
            hint = "" if os.path.isfile(adapter_config_path(adapter)) else (
                " -- an adapter.pth without adapter_params.json needs the MoA flags it was trained with "
                "(--variant, --lora_layers, --lora_targets, --p_adapter_layers, ...)")
            raise CheckpointError(f"{e}{hint}") from None
    return model


# ---- running ------------------------------------------------------------------------

def generate_share(model, tok, prompts, indices, args, gen, rank, budget_seq_len=None, stop=None):
    """Generate for the examples `indices` (longest-first batches); {index: result}.
    budget_seq_len: the authors' per-example budget (Models.generate.generate); `stop`, a StopFlag
    polled between batches."""
    order = sorted(indices, key=lambda i: -len(prompts[i]))
    results = {}
    bar = tqdm(total=len(order), desc="generate", disable=rank != 0, dynamic_ncols=True)
    for start in range(0, len(order), args.batch_size):
        if stop is not None and stop.poll():
            raise Stopped(stop.name)
        batch = order[start:start + args.batch_size]
        records = [] if args.save_weights else None
        outputs = generate(model, tok, [prompts[i] for i in batch], gen.max_gen_len, gen.temperature,
                           gen.top_p, (args.seed, rank, start), records=records, batch_size=args.batch_size,
                           budget_seq_len=budget_seq_len)
        for j, (i, out) in enumerate(zip(batch, outputs)):
            results[i] = {"generation": tok.decode(out), "token_ids": prompts[i] + out, "n_prompt": len(prompts[i]),
                          "records": records[j] if records is not None else None}
        bar.update(len(batch))
    bar.close()
    return results


def gather_results(local, output_dir, rank, world):
    """Rank 0 gets every rank's {index: result}: each writes a part file, a barrier, rank 0 reads them."""
    if world == 1:
        return local
    part = os.path.join(output_dir, f".part{rank}.pkl")
    with open(part, "wb") as f:
        pickle.dump(local, f)
    misc.all_reduce_sum([1.0])  # barrier: every part is written
    if rank != 0:
        return None
    merged = {}
    for r in range(world):
        path = os.path.join(output_dir, f".part{r}.pkl")
        with open(path, "rb") as f:
            merged.update(pickle.load(f))
        os.remove(path)
    return merged


def write_jsonl(path, rows):
    def write(tmp):
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    misc.atomic_write(path, write)


def score_and_write(test_sets, examples, results, output_dir, meta):
    """Predictions JSONL per data set, scores.json (accuracy per data set and the average); returns scores."""
    scores = {}
    for name, path, rule, first, count in test_sets:
        rows, correct = [], 0
        for i in range(first, first + count):
            ex, generation = examples[i], results[i]["generation"]
            ok = is_correct(rule, generation, ex["answer"])
            correct += ok
            rows.append({"index": i - first, "instruction": ex["instruction"], "input": ex["input"],
                         "answer": ex["answer"], "generation": generation,
                         "prediction": extract_answer(rule, generation), "correct": ok})
        write_jsonl(os.path.join(output_dir, f"{name}_predictions.jsonl"), rows)
        scores[name] = {"accuracy": correct / count, "correct": correct, "total": count, "rule": rule, "path": path}
    summary = {"datasets": scores, "average": sum(s["accuracy"] for s in scores.values()) / len(scores), **meta}
    misc.write_json(summary, os.path.join(output_dir, "scores.json"))
    return summary


def check_args(args):
    for flag in ("batch_size", "max_examples", "plot_examples"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "plot_examples" else 1):
            raise ValueError(f"--{flag}={value} is too small")


def generation_settings(args, run_args) -> GenerationArgs:
    """The flags given, else what the run's args.json recorded (its recipe's), else the defaults."""
    recorded = {k: run_args[k] for k in ("max_gen_len", "temperature", "top_p") if k in run_args}
    return GenerationArgs(**{**recorded, **given(args, GenerationArgs)})


def model_context(args, config) -> int:
    """The tokens a prompt and its generation may take: --max_seq_len, else the adapter's (what it was
    trained with), else ModelArgs' default. LLaMA-3's params.json states no limit of its own."""
    given_len = given(args, ModelArgs).get("max_seq_len")
    return given_len or (config or {}).get("max_seq_len") or ModelArgs.__dataclass_fields__["max_seq_len"].default


def check_prompt_lengths(prompts, test_sets, context):
    """Refuse prompts that leave no room to generate within the context, naming the first of them."""
    too_long = [(ts, i) for ts in test_sets for i in range(ts.first, ts.first + ts.count) if len(prompts[i]) >= context]
    if too_long:
        ts, i = too_long[0]
        raise ValueError(f"{ts.path}: example {i - ts.first} of data set '{ts.name}' has a prompt of {len(prompts[i])} "
                         f"tokens, no room to generate within max_seq_len {context} ({len(too_long)} prompt(s) in "
                         "all): raise --max_seq_len or leave them out")


def run(args, stop=None):
    check_args(args)
    misc.init_distributed_mode(args)
    rank, world = misc.get_rank(), misc.get_world_size()
    adapter, run_dir_path, run_args, llama_path = resolve_run(args)
    output_dir = os.path.abspath(args.output_dir or (
        os.path.join(run_dir_path, "eval_base" if args.no_adapter else "eval") if run_dir_path
        else os.path.join(args.output_root, "eval_base")))
    output_dirs.check_eval_dir(output_dir)
    gen = generation_settings(args, run_args)
    sources = data_files(args.data_path) if args.data_path else default_test_set(run_dir_path)
    examples, test_sets = load_test_sets(sources, args.max_examples)
    params = base_args(llama_path)
    tok = open_tokenizer(llama_path, params.vocab_size)
    prompts = [tok.encode(format_prompt(ex), bos=True, eos=False) for ex in examples]
    config = read_adapter_config(adapter) if adapter else None
    context = model_context(args, config)
    check_prompt_lengths(prompts, test_sets, context)
    max_seq_len = min(context, max(map(len, prompts)) + gen.max_gen_len)
    check_kv_cache_memory(params, args.batch_size, max_seq_len)
    model = load_model(args, adapter, llama_path, max_seq_len)
    print_main(f"[infer] base {llama_path}; adapter {adapter or '(none)'}; {len(examples)} examples in "
               f"{len(test_sets)} data set(s); {world} rank(s); max_seq_len {max_seq_len} (context {context})")
    # the authors give each example min(max_gen_len, max_seq_len - prompt length), max_seq_len from the adapter
    budget_seq_len = given(args, ModelArgs).get("max_seq_len") or (config.get("max_seq_len") if config else None)
    # every rank writes into rank 0's staging folder: its pid names it
    pid0 = int(misc.all_reduce_sum([float(os.getpid()) if rank == 0 else 0.0])[0])
    staging = output_dirs.staging_dir(output_dir, pid0)
    if rank == 0:
        misc.remove_stale_temp(os.path.dirname(output_dir), recursive=False)
    os.makedirs(staging, exist_ok=True)
    try:
        local = generate_share(model, tok, prompts, range(rank, len(examples), world), args, gen, rank,
                               budget_seq_len, stop)
        results = gather_results(local, staging, rank, world)
        if rank != 0:
            return None
        summary = write_results(args, staging, test_sets, examples, results, tok, model, run_dir_path,
                                {"adapter": adapter, "llama_path": llama_path, **vars(gen),
                                 "budget_seq_len": budget_seq_len, "max_seq_len": max_seq_len,
                                 "seed": args.seed, "world_size": world})
        output_dirs.swap_in(staging, output_dir)
    finally:
        if rank == 0 and os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    for name, s in summary["datasets"].items():
        print_main(f"  {name:<12} {100 * s['accuracy']:6.2f}%  ({s['correct']}/{s['total']})")
    print_main(f"  {'average':<12} {100 * summary['average']:6.2f}%   -> {output_dir}/scores.json")
    return summary


def write_results(args, folder, test_sets, examples, results, tok, model, run_dir_path, meta):
    """Predictions, scores, weight pickles and plots into `folder` (rank 0); returns the scores."""
    summary = score_and_write(test_sets, examples, results, folder, meta)
    log_path = os.path.join(run_dir_path, "log.txt") if run_dir_path else None
    from Utils import plots  # matplotlib only on rank 0
    type_data = token_data = expert_data = None
    if args.save_weights:
        type_data, token_data, expert_data = plots.weight_pickles(test_sets, tok, results, model)
        misc.save_on_master(type_data, os.path.join(folder, "type_weight.pkl"))
        misc.save_on_master(token_data, os.path.join(folder, "token_weight.pkl"))
        if expert_data is not None:
            misc.save_on_master(expert_data, os.path.join(folder, "expert_weight.pkl"))
    pngs = plots.plot_all(folder, type_data, token_data, log_path, tuple(range(args.plot_examples)), expert_data)
    if pngs:
        print_main("[infer] plots: " + ", ".join(sorted(os.path.basename(p) for p in pngs.values())))
    return summary


def main(argv=None):
    if os.environ.get("DISABLE_MULTIPROCESSING") == "1":  # set by block_stop_signals: the pool, not the threads
        import jittor as jt
        jt.flags.use_parallel_op_compiler = 16
    args = get_args_parser().parse_args(argv)
    try:
        return run(args, StopFlag())
    except Stopped as e:
        if misc.get_rank() == 0:
            sys.stderr.write(f"error: stopped by {e} before every example was generated; nothing was written\n")
        sys.exit(130 if str(e) == "SIGINT" else 143)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        if misc.get_rank() == 0:
            sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except OSError as e:  # the inputs were read before; a write failed
        if misc.get_rank() == 0:
            sys.stderr.write(f"error: cannot write {e.filename}: {e.strerror or e}\n")
        sys.exit(4)


if __name__ == "__main__":
    main()
