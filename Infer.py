"""Evaluate a MoA adapter (or the base alone) on math or commonsense test sets: generate, score, dump router weights.

    python Infer.py                          # newest ./output/*/adapter, its base, the synthetic test set
    python Infer.py --adapter_path output/run/adapter --data_path ../shared/data/math --save_weights
    python Infer.py --no_adapter --llama_path assets/tiny-math-base
    python Infer.py --adapter_path output/code/adapter --data_path ../shared/data/code   # HumanEval, MBPP: pass@k
    python Infer.py --data_path ../shared/data/code --samples samples.jsonl --output_dir eval  # no model
    mpirun -np 2 python Infer.py ...         # rank r takes examples r::world; rank 0 merges and scores

Ranks hand their results to rank 0 through part files in --output_dir (one
machine, or a shared file system). As root, mpirun itself needs
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (or --allow-run-as-root).
Greedy results do not depend on the batch size, the batching or the number of ranks.

Writes into --output_dir: <dataset>_predictions.jsonl per data set, scores.json
(accuracy per data set and their average; pass@k for code sets, whose programs run in
Utils/sandbox/: see docs/code.md) and, with --save_weights,
type_weight.pkl, token_weight.pkl (structure: Utils/weight_pickles.py), heatmaps and router_report.html,
the router report, a page that opens from disk in a browser (Utils/router_report.py).
The results of one evaluation, never a mix: everything is written into a staging folder
beside --output_dir and replaces it as a whole once every data set is scored; its manifest
(.manifest.json) lists them. A folder holding anything its manifest does not list is refused
(it is not an evaluation folder), and so is a mount point; a symlink's target is replaced.
Exit codes: 0 done, 2 bad input (one line on stderr), 3 non-finite logits (NaN or inf: the base or
adapter overflows in --precision; names the example; nothing written), 4 a file could not be written (disk
full, permissions), 130 / 143 / 138 stopped by SIGINT / SIGTERM / SIGUSR1 (while generating: nothing written; while
the code sets' programs run: what was scored and every completion kept in <output_dir>.stopped).
"""
import Utils.jittor_env  # must precede numpy and jittor (see block_stop_signals)

if __name__ == "__main__":
    Utils.jittor_env.block_stop_signals()

import glob
import os
import shutil
import sys

from tqdm import tqdm

from Data import code_task
from Data.prompts import format_prompt
from Data.test_sets import (TestSet, check_prompt_lengths, data_files, default_test_set, example_name,
                            load_test_sets, print_scores, score_and_write, stopped_dir, stopped_message)
from Models.ModelArgs import ModelArgs, check_flags_do_something
from Models.formats.adapters import (ADAPTER_WEIGHTS, NonFiniteAdapter, NotAnAdapter, check_adapter_exists,
                                     load_adapter, read_adapter_config, recorded_base, settings_file,
                                     settings_from_flags)
from Models.formats.base_model import adapter_settings, base_args, base_settings, build_model, open_tokenizer
from Models.generate import NonFiniteLogits, auto_batch_size, generate
from Models.memory import check_memory
from Data.tiny_base import ensure_default_base
from Models.formats import CheckpointError
from Models.Tokenizer import decode_until_unknown
from Utils import misc, output_dirs, sandbox
from Utils.jittor_env import StopFlag, Stopped, stop_exit_status
from Utils.file_io import read_json_object
from Utils.misc import print_main
from Utils.settings import ArgumentParser, GenerationArgs, add_arguments, check_values, count_or_auto, given

def get_args_parser():
    p = ArgumentParser(description="Generate answers with a MoA adapter, score them, dump router weights.")
    p.add_argument("--adapter_path", default=None,
                   help="our adapter dir (adapter.pth + adapter_params.json) or the authors' adapter.pth; "
                        "default: the newest ./output/*/adapter")
    p.add_argument("--output_root", default="./output", help="where training runs live, for the defaults of "
                   "--adapter_path and --output_dir (default: ./output)")
    p.add_argument("--llama_path", default=None,
                   help="the base: a Meta dir (params.json, consolidated.*.pth, tokenizer.model) or a Hugging Face "
                        "one (config.json, *.safetensors, tokenizer.json); default: the run's args.json "
                        "llama_path, else the tiny demo base")
    p.add_argument("--no_adapter", action="store_true", help="evaluate the base alone (no experts)")
    p.add_argument("--data_path", nargs="+", default=None,
                   help="test files (JSON lists in the LLM-Adapters schema) or dirs holding test.json or "
                        "sub-dirs with test.json; default: the test split the run recorded (<run>/data/test.json, "
                        "a run on synthetic data)")
    p.add_argument("--output_dir", default=None,
                   help="predictions, scores and plots; default: <run dir>/eval (or eval_base with --no_adapter)")
    p.add_argument("--max_examples", type=int, default=None, help="evaluate only the first N examples of each data set")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each batch draws from (seed, rank, batch))")
    p.add_argument("--batch_size", type=count_or_auto, default="auto",
                   help="prompts generated together per rank, or auto: the most whose KV cache and decoding buffers "
                        "fit in the memory left after loading the model (at most 64 with a bf16 base, 16 otherwise)")
    p.add_argument("--save_weights", action="store_true",
                   help="save type_weight.pkl / token_weight.pkl, draw router heatmaps and write "
                        "router_report.html (the router report: opens from disk in a browser)")
    p.add_argument("--plot_examples", type=int, default=3, help="examples of each data set drawn token by token "
                   "(the per-token heatmaps, the router report)")
    p.add_argument("--plot_tokens", type=int, default=160, help="most tokens per example in the token_weight "
                   "heatmap: all of a longer example's answer and the end of its prompt, at least a third of them")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="use the GPU when there is one, or cpu")
    p.add_argument("--samples", default=None,
                   help="no model: score this human-eval samples file (a {task_id, completion} per line, several "
                        "per task allowed) on the code data sets of --data_path into --output_dir")
    code = p.add_argument_group("code data sets (HumanEval, MBPP): completions become programs run in a sandbox "
                                "(docs/code.md)")
    add_arguments(code, code_task.CodeArgs)
    add_arguments(code, sandbox.SandboxLimits)
    add_arguments(p.add_argument_group("decoding (default: the run's recipe in its args.json, else as shown)"),
                  GenerationArgs)
    moa = p.add_argument_group("MoA settings: an adapter.pth without adapter_params.json beside it needs the "
                               "ones it was trained with; beside an adapter_params.json (ours or the authors') "
                               "its settings are used and a flag that differs from them is refused. "
                               "--max_seq_len bounds prompt + generation (default: the adapter's max_seq_len, "
                               "else 2048); longer prompts are refused. --precision may differ from training")
    add_arguments(moa, ModelArgs, optional=True, exclude=("recompute",))  # training only
    return p


# ---- where things are ---------------------------------------------------------------

def newest_adapter(output_root):
    found = glob.glob(os.path.join(output_root, "*", "adapter", ADAPTER_WEIGHTS))
    return os.path.dirname(max(found, key=os.path.getmtime)) if found else None


def resolve_run(args):
    """(adapter path or None, run dir or None, run's args.json dict, llama_path)."""
    newest = newest_adapter(args.output_root)
    adapter = None if args.no_adapter else args.adapter_path or newest
    if not args.no_adapter and adapter is None:
        raise FileNotFoundError(f"no adapter under {args.output_root}/*/adapter: train one with Math.py, "
                                "pass --adapter_path, or use --no_adapter")
    # the run whose test split, base and decoding apply: the adapter's, also when --no_adapter scores its base
    located = args.adapter_path or (None if args.no_adapter and args.llama_path else newest)
    if located is not None:
        check_adapter_exists(located)
    folder = None if located is None else located if os.path.isdir(located) else os.path.dirname(located)
    run_dir = os.path.dirname(os.path.abspath(folder)) if folder else None
    run_args_path = os.path.join(run_dir, "args.json") if run_dir else None
    run_args = read_json_object(run_args_path, "run settings") if run_args_path and os.path.isfile(run_args_path) \
        else {}
    llama_path = args.llama_path or (recorded_base(located, run_args, run_args_path) if located else
                                     ensure_default_base())
    return adapter, run_dir, run_args, llama_path


def model_overrides(args, adapter, llama_path):
    """ModelArgs fields for the model: the adapter's config (ours or the authors'), then the MoA flags given."""
    return {**adapter_settings(adapter, llama_path), **given(args, ModelArgs)}


def model_settings(args, adapter, llama_path, max_seq_len):
    """The model's ModelArgs: the adapter's (none with --no_adapter, which takes only --precision and
    --kv_cache) and the flags given."""
    overrides = model_overrides(args, adapter, llama_path) if adapter else {
        k: v for k, v in given(args, ModelArgs).items() if k in ("precision", "kv_cache")}
    batch = args.batch_size if args.batch_size != "auto" else 1  # auto: set once the model is loaded
    try:
        model_args = base_args(llama_path, **{**overrides, "max_seq_len": max_seq_len, "max_batch_size": batch})
        check_flags_do_something(model_args, given(args, ModelArgs))
        return model_args
    except (TypeError, ValueError) as e:  # a field of the wrong type, or a rule the settings together break
        config = settings_file(adapter) if adapter else None
        where = f" (the adapter's settings: {config}, then the flags given)" if config and os.path.isfile(config) \
            else ""
        raise ValueError(f"{e}{where}") from None


def load_model(llama_path, adapter, model_args):
    """The base with the adapter's experts (none with --no_adapter), weights loaded strictly."""
    model = build_model(llama_path, model_args)
    if adapter:
        try:
            load_adapter(model, adapter)
        except CheckpointError as e:
            hint = "" if isinstance(e, (NonFiniteAdapter, NotAnAdapter)) or not settings_from_flags(adapter) else (
                " -- an adapter.pth without adapter_params.json needs the MoA flags it was trained with "
                "(--variant, --lora_layers, --lora_targets, --p_adapter_layers, ...)")
            raise CheckpointError(f"{e}{hint}") from None
    return model


# ---- running ------------------------------------------------------------------------

def generate_share(model, tok, prompts, indices, args, gen, rank, budget_seq_len=None, stop=None, test_sets=None):
    """Generate for the examples `indices` (longest-first batches); {index: result}.
    budget_seq_len: the authors' per-example budget (Models.generate.generate); `stop`, a StopFlag
    polled between batches; `test_sets`, which name an example whose logits are not finite."""
    order = sorted(indices, key=lambda i: -len(prompts[i]))
    results = {}
    # closed however the loop ends: an error line then starts a line of its own
    with tqdm(total=len(order), desc="generate", disable=rank != 0, dynamic_ncols=True) as bar:
        for start in range(0, len(order), args.batch_size):
            if stop is not None and stop.poll():
                raise Stopped(stop.name)
            batch = order[start:start + args.batch_size]
            records = [] if args.save_weights else None
            outputs = generate(model, tok, [prompts[i] for i in batch], gen.max_gen_len, gen.temperature,
                               gen.top_p, (args.seed, rank, start), records=records, batch_size=args.batch_size,
                               budget_seq_len=budget_seq_len,
                               names=[example_name(test_sets, i) for i in batch] if test_sets else None)
            for j, (i, out) in enumerate(zip(batch, outputs)):
                text, unknown = decode_until_unknown(tok, out)
                results[i] = {"generation": text, "token_ids": prompts[i] + out, "n_prompt": len(prompts[i]),
                              "records": records[j] if records is not None else None, "undecodable_id": unknown}
            bar.update(len(batch))
    return results


def check_args(args):
    for flag in ("batch_size", "max_examples", "plot_examples", "plot_tokens", "seed"):
        value = getattr(args, flag)
        if value not in (None, "auto") and value < (0 if flag in ("plot_examples", "seed") else 1):
            raise ValueError(f"--{flag}={value} is too small")
    if args.no_adapter and args.save_weights:
        raise ValueError("--save_weights records the router's choices, and the base alone (--no_adapter) has no "
                         "router: give one of them")


def generation_settings(args, run_args, source="args.json") -> GenerationArgs:
    """The flags given, else what the run's args.json (`source`) recorded (its recipe's), else the defaults;
    a recorded value its setting's rule refuses is an error naming the file and field."""
    flags = given(args, GenerationArgs)
    recorded = check_values(GenerationArgs, {k: v for k, v in run_args.items() if k not in flags}, source)
    return GenerationArgs(**{**recorded, **flags})


def sequence_lengths(args, config, prompts, test_sets, max_gen_len) -> tuple:
    """(context, max_seq_len, budget_seq_len). context: the tokens a prompt and its generation may take,
    --max_seq_len, else the adapter's (what it was trained with), else ModelArgs' default (LLaMA-3's
    params.json states no limit of its own); for code sets --max_seq_len or none, since the authors' code
    evaluation generates max_new_tokens after any prompt. max_seq_len: the KV cache's, the longest prompt
    plus max_gen_len within the context. budget_seq_len: the authors' per-example budget
    min(max_gen_len, budget - prompt) (Models.generate.generate), from --max_seq_len or the adapter's."""
    given_len = given(args, ModelArgs).get("max_seq_len")
    code_only = all(ts.rule in code_task.FIELDS for ts in test_sets)
    trained = None if code_only else (config or {}).get("max_seq_len")
    context = given_len or trained or (None if code_only else ModelArgs.__dataclass_fields__["max_seq_len"].default)
    needed = max(map(len, prompts)) + max_gen_len
    if context is None:
        return None, needed, None
    check_prompt_lengths(prompts, test_sets, context)
    return context, min(context, needed), given_len or trained


def code_settings(args, stop=None):
    """(--code_fences, SandboxLimits, `stop`) from the flags given: how the code sets' programs run."""
    return code_task.CodeArgs(**given(args, code_task.CodeArgs)).code_fences, \
        sandbox.SandboxLimits(**given(args, sandbox.SandboxLimits)), stop


def run(args, stop=None):
    check_args(args)
    code = code_settings(args, stop)
    if args.samples:
        return score_samples(args, code)
    misc.init_distributed_mode(args)
    rank, world = misc.get_rank(), misc.get_world_size()
    adapter, run_dir_path, run_args, llama_path = resolve_run(args)
    requested = os.path.abspath(args.output_dir or (
        os.path.join(run_dir_path, "eval_base" if args.no_adapter else "eval") if run_dir_path
        else os.path.join(args.output_root, "eval_base")))
    sources = data_files(args.data_path) if args.data_path else default_test_set(run_dir_path)
    # the folder replaced at the end (a symlink's target), refused now if that cannot be done safely
    inputs = [("--adapter_path", adapter), ("--llama_path", llama_path), *(("--data_path", p) for _, p in sources)]
    output_dir = replaced_eval_dir(requested, inputs)
    gen = generation_settings(args, run_args, os.path.join(run_dir_path, "args.json") if run_dir_path else None)
    examples, test_sets = load_test_sets(sources, args.max_examples, gen.samples_per_task)
    params = base_settings(llama_path)
    tok = open_tokenizer(llama_path, params.vocab_size)
    prompts = [tok.encode(format_prompt(ex), bos=True, eos=False) for ex in examples]
    config = read_adapter_config(adapter) if adapter else None
    context, max_seq_len, budget_seq_len = sequence_lengths(args, config, prompts, test_sets, gen.max_gen_len)
    model_args = model_settings(args, adapter, llama_path, max_seq_len)
    # auto: at least one row, whose cache must fit beside the model too
    check_memory(model_args, llama_path, 1 if args.batch_size == "auto" else args.batch_size, max_seq_len)
    if any(ts.rule in code_task.FIELDS for ts in test_sets):
        sandbox.isolation()  # no sandbox works here: refused before the first token
    model = load_model(llama_path, adapter, model_args)
    if args.batch_size == "auto":
        args.batch_size = model_args.max_batch_size = auto_batch_size(model_args, max_seq_len,
                                                                      len(range(rank, len(examples), world)))
    precision = precision_record(model_args, config, adapter)
    for line in precision["warnings"]:
        print_main(f"warning: {line}", file=sys.stderr)
    print_main(f"[infer] base {llama_path}; adapter {adapter or '(none)'}; {len(examples)} examples in "
               f"{len(test_sets)} data set(s); {world} rank(s); max_seq_len {max_seq_len} "
               f"(context {context or 'the prompts'}); batch size {args.batch_size}")
    staging = output_dirs.staging_dir(output_dir, os.getpid())  # rank 0's: the others send it their results
    if rank == 0:
        output_dirs.remove_stale_temp(os.path.dirname(output_dir), recursive=False)
        output_dirs.make_staging(staging)
    try:
        local = generate_share(model, tok, prompts, range(rank, len(examples), world), args, gen, rank,
                               budget_seq_len, stop, test_sets)
        results = misc.gather_on_main(local)
        if rank != 0:
            return None
        summary = write_results(args, staging, test_sets, examples, results, tok, model, run_dir_path,
                                {"adapter": adapter, "llama_path": llama_path, **vars(gen),
                                 "budget_seq_len": budget_seq_len, "max_seq_len": max_seq_len,
                                 "seed": args.seed, "world_size": world, **precision}, code,
                                (stopped_dir(output_dir), inputs))
        output_dirs.swap_in(staging, output_dir)
    finally:
        if rank == 0 and os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    print_scores(summary, output_dir)
    return summary


def precision_record(model_args, config, adapter) -> dict:
    """scores.json's precisions: the model's, and the one the adapter trained in (its adapter_params.json's; None
    where its files say none: the authors', peft's) with a warning when --precision made them differ."""
    trained = (config or {}).get("precision")
    return {"precision": model_args.precision, "kv_cache": model_args.kv_cache, "adapter_precision": trained,
            "warnings": [] if trained in (None, model_args.precision) else [
                f"evaluated in {model_args.precision}, the adapter trained in {trained} ({settings_file(adapter)})"
                f": its scores may differ from those in {trained}"]}


def replaced_eval_dir(path: str, inputs: list) -> str:
    """output_dirs.eval_dir, saying when the folder holds an earlier evaluation, which this one replaces."""
    output_dir = output_dirs.eval_dir(path, inputs)
    if os.path.isfile(os.path.join(output_dir, "scores.json")):
        print_main(f"{output_dir} holds an earlier evaluation's results: this one replaces them once it is scored")
    return output_dir


def score_samples(args, code):
    """--samples: run a human-eval samples file's completions on the code sets of --data_path, no model."""
    if not args.data_path or not args.output_dir:
        raise ValueError("--samples needs --data_path (the code data sets it answers) and --output_dir")
    sources = data_files(args.data_path)
    inputs = [("--samples", args.samples), *(("--data_path", path) for _, path in sources)]
    output_dir = replaced_eval_dir(os.path.abspath(args.output_dir), inputs)
    code_task.check_code_sets([path for _, path in sources])
    loaded, all_sets = load_test_sets(sources, None)
    answers = code_task.examples_from_samples(args.samples, [(ts.name, ts.path, loaded[ts.first:ts.first + ts.count])
                                                             for ts in all_sets], args.max_examples)
    examples, test_sets = [], []
    for ts, answered in zip(all_sets, answers):
        if answered:  # a set no sample answers is left out
            test_sets.append(TestSet(ts.name, ts.path, ts.rule, len(examples), len(answered)))
            examples += answered
    sandbox.isolation()
    output_dirs.remove_stale_temp(os.path.dirname(output_dir), recursive=False)
    with output_dirs.replacing(output_dir) as staging:
        summary = score_and_write(test_sets, examples, {i: {"generation": ex["completion"]} for i, ex in
                                                        enumerate(examples)}, staging,
                                  {"samples": os.path.abspath(args.samples)}, code, (stopped_dir(output_dir), inputs))
    print_scores(summary, output_dir)
    return summary


def write_results(args, folder, test_sets, examples, results, tok, model, run_dir_path, meta, code, keep):
    """Predictions, scores, weight pickles and plots into `folder` (rank 0); returns the scores. A stopped
    code scoring keeps what was scored as `keep` says (Data.test_sets.score_and_write)."""
    summary = score_and_write(test_sets, examples, results, folder, meta, code, keep)
    log_path = os.path.join(run_dir_path, "log.txt") if run_dir_path else None
    from Utils import plots, router_report, weight_pickles  # matplotlib only on rank 0
    type_data = token_data = expert_data = None
    if args.save_weights:
        type_data, token_data, expert_data = weight_pickles.weight_pickles(test_sets, tok, results, model)
        misc.save_on_master(type_data, os.path.join(folder, "type_weight.pkl"))
        misc.save_on_master(token_data, os.path.join(folder, "token_weight.pkl"))
        if expert_data is not None:
            misc.save_on_master(expert_data, os.path.join(folder, "expert_weight.pkl"))
        router_report.write_evaluation_report(folder, type_data, token_data, args.plot_examples, meta["adapter"])
    pngs = plots.plot_all(folder, type_data, token_data, log_path, args.plot_examples, expert_data, args.plot_tokens)
    if pngs:
        print_main("[infer] plots: " + ", ".join(
            f"{name}.png" + (f" (colours {scale[0]:.4g} to {scale[1]:.4g})" if scale else "")
            for name, (_, scale) in sorted(pngs.items())))
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
            sys.stderr.write(f"error: {stopped_message(e)}\n")
        sys.exit(stop_exit_status(str(e)))
    except NonFiniteLogits as e:  # on the rank that met them: another rank's examples may be finite
        sys.stderr.write(f"error: {e}; stopping, nothing written\n")
        sys.exit(3)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        if misc.get_rank() == 0:
            sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except OSError as e:  # the inputs were read before; a write failed
        if misc.get_rank() == 0:
            sys.stderr.write(f"error: cannot write {e.filename or args.output_dir or 'the output folder'}: "
                             f"{e.strerror or e}\n")
        sys.exit(4)


if __name__ == "__main__":
    main()
