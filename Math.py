"""Fine-tune MoA adapters on math word problems (LLM-Adapters schema).

    python Math.py                                     # tiny demo: default base, synthetic data, Sparse MoA
    mpirun -np 2 python Math.py --batch_size 16 ...    # data parallel over MPI ranks
    python Math.py --resume auto --output_dir out      # continue exactly where out/ stopped, with its args.json
    python Math.py --recipe code --data_path codealpaca.json   # code instructions (no answer field needed)

--batch_size is the GLOBAL batch of one micro-step (split over the ranks), so a
run means the same on 1 or N ranks; the authors' --batch_size was per GPU.
An output folder belongs to one run (Utils/output_dirs.py): a new run into another run's folder
needs --resume auto or --overwrite, and two live runs into one folder are refused.
Exit codes: 0 done, 2 bad input (one line on stderr), 3 non-finite loss or adapter weights (nothing
saved), 4 a file could not be written (disk full, permissions), 130 stopped by SIGINT (Ctrl-C), 143
by SIGTERM, 138 by SIGUSR1; each stop saves checkpoint-latest.pth at the next step boundary first (or,
while an input is still being read, stops with nothing written). Under mpirun send SIGUSR1 to mpirun:
it forwards that to every rank, where OpenMPI kills the ranks one second after a SIGTERM.
"""
import Utils.jittor_env  # must precede numpy and jittor (see block_stop_signals)

if __name__ == "__main__":
    Utils.jittor_env.block_stop_signals()

import argparse
import json
import math
import os
import random
import sys

import numpy as np

import jittor as jt

from Data.training_sets import load_data, training_sets, write_synthetic
from engine_finetune import NonFiniteLoss, Progress, RunContext, cut_log, log_line, train
from Models.formats.adapters import NonFiniteAdapter, load_adapter, save_adapter
from Models.formats.pth import load_pth
from Models.formats.training import check_extension, restore_checkpoint, resume_signature
from Models.formats.base_model import base_args, base_settings, build_model, open_tokenizer, settings_file
from Models.memory import check_memory, needs_recompute
from Models.ModelArgs import INSTANCE_METHODS, ModelArgs, check_flags_do_something
from Data.tiny_base import ensure_default_base
from Utils import file_io, misc, output_dirs
from Models.kernels.adamw import build_optimizer
from Utils.file_io import read_json_object
from Utils.misc import EarlyStopper, all_reduce_sum, print_main
from Utils.jittor_env import StopFlag, Stopped, launcher, stop_exit_status, stop_origin
from Utils.settings import (EVERY_LAYER_SPANS, RECIPES, ArgumentParser, GenerationArgs, TrainArgs, add_arguments,
                            check_record,
                            check_values, given, recipe_values, recipes_help, resume_fixed, setting_fields,
                            with_sources)

DEFAULT_RECIPE = "demo"


class UserError(Exception):
    """Bad input: printed as one line, exit code 2, no stack trace."""


def get_args_parser():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=recipes_help() + f". The defaults shown are the {DEFAULT_RECIPE} recipe's.")
    a = p.add_argument
    a("--recipe", default=None, help="named settings (see below) or a JSON file of settings; the flags "
      f"given override it (default: {DEFAULT_RECIPE}; a resumed run: its args.json's)")
    a("--llama_path", default=None, help="the base: a Meta checkpoint dir (params.json, consolidated.*.pth, "
      "tokenizer.model) or a Hugging Face one (config.json, *.safetensors, tokenizer.json; LLaMA-3.x or Qwen3); "
      "default: the shipped tiny demo base in assets/tiny-math-base")
    a("--data_path", default=None, help="training JSON (LLM-Adapters schema); default: synthetic math problems "
      "written to <output_dir>/data/")
    a("--val_data_path", default=None, help="validation JSON; default: --val_fraction of --data_path "
      "(or the synthetic val split)")
    a("--output_dir", default="./output/math", help="checkpoints, adapter/, log.txt, tensorboard/, args.json "
      "(default: ./output/math)")
    a("--resume", default=None, help="checkpoint to continue from, or 'auto' = <output_dir>/checkpoint-latest.pth "
      "when it exists (else a fresh run that may use a folder holding another run's files). A resumed run takes "
      "every setting, base and data from <output_dir>/args.json; flags given override them, and one that changes "
      "the model or the data is refused")
    a("--overwrite", action="store_true", help="replace the run whose files --output_dir holds: deletes what "
      "its manifest (.manifest.json) lists and the evaluation folders in it first, never anything else "
      "(without it such a folder is refused)")
    a("--init_adapter", default=None, help="start from this adapter (our dir/adapter.pth or the authors' "
      "adapter.pth) with a fresh optimizer")
    a("--device", default="cuda", choices=["cuda", "cpu"],
      help="cuda when available, or force cpu (args.json records the one used)")
    a("--print_settings", action="store_true", help="print every resolved setting at the start (args.json in "
      "--output_dir records them either way; without it one line says where they came from)")
    shown = recipe_values(DEFAULT_RECIPE)
    add_arguments(p.add_argument_group("model and experts"), ModelArgs, shown)
    add_arguments(p.add_argument_group("training"), TrainArgs, shown)
    return p


def fail(message):
    raise UserError(message)


# What a resumed run takes from its args.json unless given, besides the settings (resolve_settings)
RECORDED_FLAGS = ("recipe", "llama_path", "data_path", "val_data_path")
SETTINGS = (ModelArgs, TrainArgs, GenerationArgs)


def recorded_run(args) -> tuple:
    """With --resume, (<output_dir>/args.json, the settings it recorded at the run's start), the flags of
    RECORDED_FLAGS not given taken from it; (None, {}) without --resume or args.json."""
    path = os.path.join(args.output_dir, "args.json")
    if not args.resume:
        return None, {}
    # rank 0's copy: the others' --output_dir may be on their own disks
    recorded = misc.from_rank0(lambda: read_json_object(path, "run settings") if os.path.isfile(path) else None)
    if recorded is None:
        return None, {}
    check_record(path, recorded, SETTINGS)
    # what the run read (a missing base would be the demo's) and every setting it recorded: those its recipe and
    # Math.py's defaults set, and the training loop's; a flag given stands in for a missing one
    flags = {k for k in RECORDED_FLAGS if getattr(args, k) is not None} | set(given(args, ModelArgs)) \
        | set(given(args, TrainArgs))
    recipe = recorded.get("recipe") or args.recipe
    try:
        recipe = recipe_values(recipe, recorded.get("variant")) if recipe else {}
    except ValueError as e:
        fail(f"{path}: field 'recipe': {e}")
    required = dict.fromkeys([*RECORDED_FLAGS, *EVERY_LAYER_SPANS, *recipe, *(f.name for f in setting_fields(TrainArgs))])
    missing = [k for k in required if k not in recorded and k not in flags]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        fail(f"{path}: missing field(s) {missing[:5]}{more}, which the run recorded when it started: restore them "
             "from a copy, or give each as a flag")
    for flag in RECORDED_FLAGS:
        if getattr(args, flag) is None and recorded[flag] is not None:
            setattr(args, flag, recorded[flag])
    return path, recorded


def resolve_settings(args, n_layers, recorded_path=None, recorded=None, sources=None):
    """(ModelArgs settings dict, TrainArgs, GenerationArgs settings for Infer.py): dataclass defaults < the
    recipe < a resumed run's args.json < the flags given, each value checked by its setting's rule where it came
    from. `sources`, a dict, receives {name: (value, where)}: the refusals of the rules joining several settings
    name where each came from."""
    recorded = recorded or {}
    args.recipe = args.recipe or DEFAULT_RECIPE  # not given, nor recorded by a resumed run
    recipe = recipe_values(args.recipe, getattr(args, "variant", None) or recorded.get("variant"))
    sections = {cls: {f.name for f in setting_fields(cls)} for cls in (ModelArgs, TrainArgs, GenerationArgs)}
    unknown = sorted(set(recipe) - set().union(*sections.values()))
    if unknown:
        fail(f"--recipe {args.recipe}: unknown setting(s) {unknown}")
    layers = [("Math.py's default", {name: f"0-{n_layers}" for name in EVERY_LAYER_SPANS}),
              (f"recipe '{args.recipe}'" if args.recipe in RECIPES else args.recipe, recipe),
              (recorded_path, recorded), (None, {**given(args, ModelArgs), **given(args, TrainArgs)})]
    sources = {} if sources is None else sources
    sources.update({f.name: (f.default, "its default") for cls in sections for f in setting_fields(cls)})
    values = {}
    for where, layer in layers:
        for cls in sections:
            checked = check_values(cls, {k: v for k, v in layer.items() if k in sections[cls]}, where)
            values.update(checked)
            sources.update({k: (v, where or f"--{k}") for k, v in checked.items()})
    pick = lambda cls: {k: v for k, v in values.items() if k in sections[cls]}  # noqa: E731
    try:
        train_cfg = TrainArgs(**pick(TrainArgs))
        GenerationArgs(**pick(GenerationArgs))  # recorded for Infer.py: usable there, or refused here
    except ValueError as e:
        fail(with_sources(str(e), sources))
    if train_cfg.batch_size < args.world_size:
        fail(f"--batch_size {train_cfg.batch_size} is smaller than the {args.world_size} MPI ranks: "
             "each rank needs a row")
    if train_cfg.batch_size % args.world_size:
        fail(f"--batch_size {train_cfg.batch_size} is not divisible by the {args.world_size} MPI ranks")
    return pick(ModelArgs), train_cfg, pick(GenerationArgs)


def find_resume(args):
    if args.resume != "auto":
        return args.resume
    latest = os.path.join(args.output_dir, "checkpoint-latest.pth")
    return latest if misc.from_rank0(lambda: os.path.isfile(latest)) else None


def prepare(args, recorded):
    """Everything that can fail on user input, before a single file is written; `recorded`, recorded_run's."""
    tiny_base = args.llama_path is None
    if tiny_base:
        try:
            args.llama_path = ensure_default_base()
        except FileNotFoundError as err:
            fail(str(err))
    params = base_settings(args.llama_path)
    sources = {}
    model_settings, cfg, generation = resolve_settings(args, params.n_layers, *recorded, sources)
    given_flags = {k: v for k, (v, where) in sources.items() if where == f"--{k}"}
    try:  # rules joining settings, then the memory with the adapters' training state, before any data is read
        rows = cfg.batch_size // args.world_size
        model_args = base_args(args.llama_path, **model_settings, max_batch_size=rows)
        if model_args.recompute is None:
            model_args.recompute = needs_recompute(model_args, rows, model_args.max_seq_len)
            if model_args.recompute:
                print_main("--recompute on: with every layer's activations kept a step would not fit in the memory "
                           "left (--no-recompute keeps them)")
        check_memory(model_args, settings_file(args.llama_path), rows, model_args.max_seq_len, training=True)
        check_flags_do_something(model_args, given_flags)
    except ValueError as e:
        fail(with_sources(str(e), sources))
    flags = [f"--{k} {v}" for k, v in given_flags.items()]
    print_main(f"settings: {recorded[0] + ' (the run resumed)' if recorded[0] else 'recipe ' + args.recipe}"
               f"{', then ' + ' '.join(flags) if flags else ''}; base {args.llama_path}"
               f"{' (the tiny demo base: no --llama_path given)' if tiny_base else ''}, data "
               f"{args.data_path or 'synthetic math problems'}; all of them are recorded in "
               f"{os.path.join(args.output_dir, 'args.json')} when the run starts (--print_settings prints them)")
    examples = load_data(args.data_path, args.val_data_path, cfg.val_fraction, cfg.seed)
    tokenizer = open_tokenizer(args.llama_path, model_args.vocab_size)
    # Instance-level routers pool every position, padding included: pad to max_seq_len as the
    # authors' data does, so a sequence's gates do not depend on the length of its batch's longest.
    buckets = [model_args.max_seq_len] if model_args.method in INSTANCE_METHODS else None
    train_ds, val_ds = training_sets(examples, tokenizer, cfg, model_args.max_seq_len, buckets, args.data_path,
                                     args.val_data_path)

    jt.set_seed(cfg.seed)  # the same on every rank: the adapters start identical
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    model = build_model(args.llama_path, model_args)
    model.train()
    counts = model.parameter_counts()
    print_main(f"trainable parameters: {counts['total']:,} (base {counts['base']:,}, frozen); per type: "
               + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if k not in ("total", "base")))

    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    stopper = EarlyStopper(cfg.early_stop_patience)
    signature = resume_signature(args.llama_path, args.data_path, args.val_data_path, cfg, model_args.max_seq_len,
                                 examples)
    progress = Progress()
    resume_path = find_resume(args) if args.resume else None
    if args.resume == "auto" and resume_path is None:
        print_main(f"--resume auto: no checkpoint-latest.pth in {args.output_dir} yet, starting afresh")
    settings = {**run_flags(args), "recipe": args.recipe, **model_settings, **vars(cfg), **generation}
    if resume_path:
        ckpt = restore_checkpoint(resume_path, misc.from_rank0(lambda: load_pth(resume_path)), model, optimizer,
                                  stopper, signature,
                                  resume_fixed({**settings, **model_args.to_dict()}, ModelArgs, TrainArgs),
                                  {name: where for name, (_, where) in sources.items()})
        progress = Progress(int(ckpt["epoch"]), int(ckpt["data_iter_step"]), int(ckpt["global_step"]))
        check_extension(ckpt, cfg, resume_path)
        print_main(f"resumed from {resume_path}: epoch {progress.epoch}, batch {progress.next_batch}, "
                   f"step {progress.global_step}")
    elif args.init_adapter:
        load_adapter(model, args.init_adapter)
        print_main(f"adapter initialised from {args.init_adapter} (fresh optimizer)")
    return model, optimizer, stopper, (train_ds, val_ds), examples, cfg, progress, settings, signature


def run_flags(args) -> dict:
    """The flags args.json records beside the settings, the paths absolute (a resumed run may start elsewhere)."""
    paths = {k: os.path.abspath(getattr(args, k)) if getattr(args, k) else None
             for k in ("llama_path", "data_path", "val_data_path", "output_dir")}
    return {**paths, **{k: getattr(args, k) for k in ("resume", "overwrite", "init_adapter", "device", "world_size")}}


def run_inputs(args) -> list:
    """(flag, path) of what the run reads: never inside what --overwrite removes."""
    return [(f"--{flag}", getattr(args, flag)) for flag in ("data_path", "val_data_path", "init_adapter", "resume",
                                                           "llama_path", "recipe")
            if flag != "recipe" or args.recipe not in RECIPES]


def claim_output_dir(args, run_id):
    """Rank 0 locks and checks the folder (Utils/output_dirs.py); every rank learns whether it may go on."""
    refusal, claim = None, None
    if misc.is_main_process():
        claim = output_dirs.RunDir(args.output_dir, run_id)
        try:
            removed = claim.claim(args.resume, args.overwrite, keep=run_inputs(args))
            if removed:
                print_main(f"removed {len(removed)} temp file(s) of interrupted writes: " + ", ".join(removed))
        except output_dirs.RunDirError as e:
            refusal = str(e)
    if all_reduce_sum([float(refusal is not None)])[0] > 0:
        fail(refusal or "rank 0 refused --output_dir")
    return claim


def write_run_files(claim, output_dir, data_path, settings, examples):
    """args.json (every resolved setting) and, for the synthetic default, the data it trains on (rank 0);
    the manifest lists them, log.txt and tensorboard/ first."""
    if not misc.is_main_process():
        return
    claim.record("args.json", "log.txt", "tensorboard", *(["data"] if data_path is None else []))
    if data_path is None:
        data_dir = os.path.join(output_dir, "data")
        write_synthetic(data_dir, examples)
        settings = {**settings, "synthetic_data": data_dir}
    file_io.write_json(settings, os.path.join(output_dir, "args.json"))


def finetune(args, stop):
    if args.overwrite and args.resume:
        fail("--overwrite replaces the folder's run and --resume continues it: give one of them")
    try:
        main = misc.is_main_process()  # the folder is rank 0's (the others may see another disk there)
        if main:
            output_dirs.check_output_dir(args.output_dir)
            output_dirs.check_owner(args.output_dir, args.resume, args.overwrite)  # early; again under the lock
        recorded = recorded_run(args)
        if main and args.overwrite and os.path.isdir(args.output_dir):
            output_dirs.check_inputs_outside(output_dirs.removable_entries(args.output_dir), run_inputs(args),
                                             "--overwrite")
        prepared = prepare(args, recorded)
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None
    run_id = output_dirs.new_run_id()
    claim = claim_output_dir(args, run_id)
    try:
        return train_and_save(args, stop, run_id, claim, *prepared)
    finally:
        if claim is not None:
            claim.release()


def train_and_save(args, stop, run_id, claim, model, optimizer, stopper, datasets, examples, cfg, start, settings,
                   signature):
    train_ds, val_ds = datasets
    settings = {**settings, "run_id": run_id}
    if args.print_settings:
        print_main(json.dumps(settings, indent=2))
    steps_per_epoch = len(train_ds) // cfg.accum_iter
    if start.next_batch >= steps_per_epoch * cfg.accum_iter:
        start.epoch, start.next_batch = start.epoch + 1, 0
    write_run_files(claim, args.output_dir, args.data_path, settings, examples)
    cut_log(args.output_dir, start.global_step)
    log_writer = None
    if misc.is_main_process():
        from tensorboardX import SummaryWriter
        log_writer = SummaryWriter(logdir=os.path.join(args.output_dir, "tensorboard"),
                                   purge_step=start.global_step + 1)
    ctx = RunContext(output_dir=args.output_dir, world_size=args.world_size, steps_per_epoch=steps_per_epoch,
                     val_dataset=val_ds, stopper=stopper, log_writer=log_writer, stop=stop,
                     settings=settings, signature=signature, run_id=run_id, run_dir=claim)
    print_main(f"{len(train_ds)} batches of {cfg.batch_size} per epoch, {steps_per_epoch} optimizer steps per "
               f"epoch, {cfg.epochs * steps_per_epoch} in all, lr {cfg.lr:.3g}, {args.world_size} rank(s)")
    end = train(model, train_ds, optimizer, cfg, ctx, start)
    if log_writer is not None:
        log_writer.close()
    if end.train_seconds > 0:
        steps, speed = end.global_step - start.global_step, end.timed.tokens_per_s
        print_main(f"trained {steps} steps in {end.train_seconds:.1f} s; " + (
            f"{speed:.0f} tokens/s (padded inputs, all ranks) over the {end.timed.steps} step(s) that compiled nothing"
            if speed else "every step met a new batch shape (Jittor compiled), so no tokens/s"))
    # this process's totals, for Compare.py and anyone reading log.txt; tokens/s without the steps that compiled
    log_line(ctx, {"event": "end", "step": end.global_step, "stop_reason": end.stop_reason,
                   "train_seconds": end.train_seconds, "input_tokens": end.input_tokens,
                   "train_tokens_per_s": end.timed.tokens_per_s, "timed_steps": end.timed.steps,
                   "trainable_params": model.parameter_counts()["total"]})
    if end.stop_reason == "signal":
        all_reduce_sum([0.0])
        print_main(f"stopped by {stop.name}{stop_origin(stop.name)} at step {end.global_step}; checkpoint-latest.pth "
                   f"is saved, continue with: {launcher()}python Math.py --resume auto --output_dir {args.output_dir}")
        return stop_exit_status(stop.name)
    if claim is not None:
        claim.record("adapter")
    save_adapter(model, os.path.join(args.output_dir, "adapter"))
    all_reduce_sum([0.0])  # barrier: no rank exits (and makes mpirun kill the rest) while rank 0 still writes
    best = f", best val_loss {stopper.best:.4f} in adapter-best/" if math.isfinite(stopper.best) else ""
    print_main(f"done ({end.stop_reason or 'all epochs'}): adapter in {os.path.join(args.output_dir, 'adapter')}"
               f"{best}")
    return 0


def main(argv=None):
    if os.environ.get("DISABLE_MULTIPROCESSING") == "1":  # set by block_stop_signals: the pool, not the threads
        jt.flags.use_parallel_op_compiler = 16  # Jittor's default, which that switch also turned off
    args = get_args_parser().parse_args(argv)
    misc.init_distributed_mode(args)
    try:
        return finetune(args, StopFlag())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLoss, NonFiniteAdapter) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Stopped as e:  # while blocked reading an input (a FIFO), before anything was written
        print(f"error: stopped by {e} while reading the inputs; nothing was written", file=sys.stderr)
        return stop_exit_status(str(e))
    except OSError as e:  # inputs were read in prepare(); what fails now is a write
        print(f"error: cannot write {e.filename or args.output_dir}: {e.strerror or e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
