"""Fine-tune MoA adapters on math word problems (LLM-Adapters schema).

    python Math.py                                     # tiny demo: default base, synthetic data, Sparse MoA
    mpirun -np 2 python Math.py --batch_size 16 ...    # data parallel over MPI ranks
    python Math.py --resume auto --output_dir out      # continue exactly where out/ stopped

--batch_size is the GLOBAL batch of one micro-step (split over the ranks), so a
run means the same on 1 or N ranks; the authors' --batch_size was per GPU.
Exit codes: 0 done, 2 bad input, 3 non-finite loss, 143 stopped by SIGTERM.
"""
import Utils.jittor_env  # must precede numpy and jittor (see block_sigterm)

if __name__ == "__main__":
    Utils.jittor_env.block_sigterm()

import argparse
import json
import math
import os
import random
import sys

import numpy as np

import jittor as jt

from Data.dataset import FinetuneDataset, load_examples, split_validation
from Data.synthetic import make_splits
from engine_finetune import NonFiniteLoss, StopFlag, build_optimizer, set_rng_state, train_one_epoch, write_adapter
from Models.checkpoints import adapter_arrays, assign_strict, build_model, config_differences, load_adapter
from Models.ModelArgs import PRECISION_HELP, PRECISIONS, ModelArgs, add_moa_arguments
from Models.tiny_base import ensure_default_base
from Models.Tokenizer import Tokenizer
from Models.torch_io import load_pth
from Utils import misc
from Utils.misc import EarlyStopper, all_reduce_sum

# The demo data; the held-out test split is written beside it for Infer.py (disjoint by instruction).
SYNTHETIC = dict(n_train=20000, n_val=200, n_test=300, seed=0)
# Training settings a resumed run must share with its checkpoint (model settings are checked separately).
RESUME_KEYS = ("llama_path", "data", "val_data", "val_fraction", "batch_size", "accum_iter", "epochs",
               "warmup_epochs", "lr", "min_lr", "weight_decay", "clip_grad", "max_seq_len", "seed")


class UserError(Exception):
    """Bad input: printed as one line, exit code 2, no stack trace."""


def get_args_parser():
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    a = p.add_argument
    a("--llama_path", default=None, help="Meta checkpoint dir (params.json, consolidated.*.pth, tokenizer.model); "
      "default: the shipped tiny demo base in assets/tiny-math-base")
    a("--data_path", default=None, help="training JSON (LLM-Adapters schema); default: synthetic math problems "
      "written to <output_dir>/data/")
    a("--val_data_path", default=None, help="validation JSON; default: --val_fraction of --data_path "
      "(or the synthetic val split)")
    a("--val_fraction", type=float, default=0.05, help="share of --data_path held out for validation when "
      "--val_data_path is not given; 0 = no validation")
    add_moa_arguments(p, training=True)
    a("--blr", type=float, default=4e-2, help="base lr: lr = blr * batch_size * accum_iter / 256")
    a("--lr", type=float, default=None, help="absolute lr (overrides --blr)")
    a("--min_lr", type=float, default=0.0, help="lr floor of the cosine schedule")
    a("--warmup_epochs", type=float, default=0.05, help="epochs of linear lr warm-up (fractions allowed)")
    a("--epochs", type=int, default=1, help="training epochs")
    a("--batch_size", type=int, default=16, help="GLOBAL batch size of one micro-step, split over MPI ranks")
    a("--accum_iter", type=int, default=1, help="micro-steps accumulated per optimizer step")
    a("--weight_decay", type=float, default=0.02, help="AdamW weight decay on matrices (not 1-D params, biases)")
    a("--clip_grad", type=float, default=1.0, help="max global gradient norm; 0 = no clipping")
    a("--max_seq_len", type=int, default=192, help="tokens per example, longer ones are cut (the demo's "
      "examples are 145-176 tokens: the Alpaca prompt alone is ~120)")
    a("--seed", type=int, default=0, help="seed of adapter init and data order")
    a("--output_dir", default="./output/math", help="checkpoints, adapter/, log.txt, tensorboard/, args.json")
    a("--resume", default=None, help="checkpoint to continue from, or 'auto' = <output_dir>/checkpoint-latest.pth "
      "when it exists")
    a("--init_adapter", default=None, help="start from this adapter (our dir/adapter.pth or the authors' "
      "adapter.pth) with a fresh optimizer")
    a("--early_stop_patience", type=int, default=0, help="stop after this many validations without improvement; "
      "0 = never")
    a("--eval_interval", type=int, default=200, help="validate (and save checkpoint-latest) every N optimizer "
      "steps; also at each epoch end; 0 = epoch ends only")
    a("--max_steps", type=int, default=0, help="stop after this many optimizer steps in all (lr schedule "
      "unchanged); 0 = no cap")
    a("--log_interval", type=int, default=100, help="terminal and log.txt line every N optimizer steps")
    a("--amp", action="store_true", help="GPU only: fp16 frozen base + Jittor AMP level 4 (adapters and "
      "optimizer stay fp32; untested on GPU so far); ignored on CPU")
    a("--precision", default="bf16", choices=PRECISIONS, help=PRECISION_HELP)
    a("--device", default="cuda", choices=["cuda", "cpu"], help="cuda when available, or force cpu")
    return p


def fail(message):
    raise UserError(message)


def check_args(args, n_layers):
    """Resolve defaults that depend on the base and the world size; reject impossible settings."""
    args.lora_layers = args.lora_layers or f"0-{n_layers}"
    args.p_adapter_layers = args.p_adapter_layers or f"0-{n_layers}"
    for name in ("batch_size", "accum_iter", "epochs", "max_seq_len", "log_interval"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("eval_interval", "max_steps", "early_stop_patience", "warmup_epochs", "clip_grad", "min_lr"):
        if getattr(args, name) < 0:
            fail(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.batch_size < args.world_size:
        fail(f"--batch_size {args.batch_size} is smaller than the {args.world_size} MPI ranks: each rank needs a row")
    if args.batch_size % args.world_size:
        fail(f"--batch_size {args.batch_size} is not divisible by the {args.world_size} MPI ranks")
    if not 0.0 <= args.val_fraction < 1.0:
        fail(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if args.lr is None:
        args.lr = args.blr * args.batch_size * args.accum_iter / 256
    if args.lr <= 0:
        fail(f"the learning rate must be positive, got {args.lr}")


def load_data(args):
    """(train, val or None) example lists; the seeded synthetic splits when --data_path is not given."""
    if args.data_path is None:
        train, val, _ = make_splits(SYNTHETIC["n_train"], SYNTHETIC["n_val"], 0, seed=SYNTHETIC["seed"])
        return train, val
    train = load_examples(args.data_path)
    if args.val_data_path:
        return train, load_examples(args.val_data_path)
    if args.val_fraction == 0:
        return train, None
    return split_validation(train, args.val_fraction, seed=args.seed)


def resume_signature(args):
    data = os.path.abspath(args.data_path) if args.data_path else "synthetic"
    val_data = os.path.abspath(args.val_data_path) if args.val_data_path else None
    sig = {k: getattr(args, k) for k in RESUME_KEYS if k not in ("data", "val_data", "llama_path")}
    return {**sig, "llama_path": os.path.abspath(args.llama_path), "data": data, "val_data": val_data}


def find_resume(args):
    if args.resume != "auto":
        return args.resume
    latest = os.path.join(args.output_dir, "checkpoint-latest.pth")
    return latest if os.path.isfile(latest) else None


def restore(path, model, optimizer, stopper, args):
    """Load a checkpoint after checking it was made with the same settings; returns it."""
    ckpt = load_pth(path)
    if not isinstance(ckpt, dict) or "adapter" not in ckpt or "optimizer" not in ckpt:
        fail(f"{path}: not a training checkpoint of Math.py (no adapter/optimizer state)")
    differences = config_differences(ckpt["model_args"], model.args)
    saved = ckpt.get("signature", {})
    differences += [f"{k}: checkpoint has {saved.get(k)!r}, this run has {v!r}"
                    for k, v in resume_signature(args).items() if saved.get(k) != v]
    if differences:
        fail(f"{path}: checkpoint of another configuration, cannot resume: " + "; ".join(differences))
    assign_strict(model.adapter_parameters(), ckpt["adapter"], path, "adapter")
    optimizer.load_state_arrays(ckpt["optimizer"], path)
    stopper.load_state_dict(ckpt["early_stopper"])
    set_rng_state(ckpt["rng"])
    return ckpt


def prepare(args):
    """Everything that can fail on user input, before a single file is written."""
    if args.llama_path is None:
        try:
            args.llama_path = ensure_default_base()
        except FileNotFoundError as err:
            fail(str(err))
    params = ModelArgs.from_params_json(args.llama_path)
    check_args(args, params.n_layers)
    train, val = load_data(args)
    tokenizer = Tokenizer(os.path.join(args.llama_path, "tokenizer.model"))
    train_ds = FinetuneDataset(train, tokenizer, args.max_seq_len, args.batch_size, shuffle=True, drop_last=True,
                               seed=args.seed, keep_numpy_array=True)
    val_ds = None
    if val is not None:
        val_ds = FinetuneDataset(val, tokenizer, args.max_seq_len, args.batch_size, shuffle=False,
                                 drop_last=False, keep_numpy_array=True)
    if len(train_ds) < args.accum_iter:
        fail(f"{len(train_ds)} batches per epoch cannot fill one optimizer step of --accum_iter {args.accum_iter}")

    jt.set_seed(args.seed)  # the same on every rank: the adapters start identical
    np.random.seed(args.seed)
    random.seed(args.seed)
    model = build_model(args.llama_path, variant=args.variant, lora_layers=args.lora_layers,
                        lora_rank=args.lora_rank, lora_targets=args.lora_targets, lora_alpha=args.lora_alpha,
                        expert_num=args.expert_num, hydra_moe=args.hydra_moe,
                        p_adapter_layers=args.p_adapter_layers, p_adapter_size=args.p_adapter_size,
                        p_adapter_hydra=args.p_adapter_hydra, prompt_layers=args.prompt_layers,
                        prompt_len=args.prompt_len, swi_x=args.swi_x, max_threshold=args.max_threshold,
                        const_threshold=args.const_threshold, gamma_grad=args.gamma_grad,
                        max_seq_len=args.max_seq_len, max_batch_size=args.batch_size // args.world_size,
                        precision=args.precision)
    if args.amp and jt.flags.use_cuda:
        # fp16 storage for the frozen base; the adapters and their AdamW state stay fp32
        for p in model.base_parameters().values():
            p.assign(p.float16())
        model.freeze_base()
    model.train()
    counts = model.parameter_counts()
    print(f"trainable parameters: {counts['total']:,} (base {counts['base']:,}, frozen); per type: "
          + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if k not in ("total", "base")))

    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    stopper = EarlyStopper(args.early_stop_patience)
    position = (0, 0, 0)  # epoch, next global batch, optimizer steps done
    resume_path = find_resume(args) if args.resume else None
    if args.resume == "auto" and resume_path is None:
        print(f"--resume auto: no checkpoint-latest.pth in {args.output_dir} yet, starting afresh")
    if resume_path:
        ckpt = restore(resume_path, model, optimizer, stopper, args)
        position = (int(ckpt["epoch"]), int(ckpt["data_iter_step"]), int(ckpt["global_step"]))
        print(f"resumed from {resume_path}: epoch {position[0]}, batch {position[1]}, step {position[2]}")
    elif args.init_adapter:
        load_adapter(model, args.init_adapter)
        print(f"adapter initialised from {args.init_adapter} (fresh optimizer)")
    return model, optimizer, stopper, train_ds, val_ds, (train, val), position


def write_run_files(args, examples):
    """args.json and, for the synthetic default, the data it trains on (rank 0)."""
    if not misc.is_main_process():
        return
    os.makedirs(args.output_dir, exist_ok=True)
    if args.data_path is None:
        data_dir = os.path.join(args.output_dir, "data")
        os.makedirs(data_dir, exist_ok=True)
        test = make_splits(SYNTHETIC["n_train"], SYNTHETIC["n_val"], SYNTHETIC["n_test"], seed=SYNTHETIC["seed"])[2]
        for name, split in zip(("train.json", "val.json", "test.json"), (*examples, test)):
            misc.save_on_master(lambda tmp, split=split: write_json(split, tmp), os.path.join(data_dir, name))
        args.synthetic_data = data_dir
    misc.save_on_master(lambda tmp: write_json(vars(args), tmp), os.path.join(args.output_dir, "args.json"))


def write_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def finetune(args, sigterm):
    try:
        model, optimizer, stopper, train_ds, val_ds, examples, position = prepare(args)
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None
    start_epoch, start_batch, global_step = position
    steps_per_epoch = len(train_ds) // args.accum_iter
    if start_batch >= steps_per_epoch * args.accum_iter:
        start_epoch, start_batch = start_epoch + 1, 0
    write_run_files(args, examples)
    log_writer = None
    if misc.is_main_process():
        from tensorboardX import SummaryWriter
        log_writer = SummaryWriter(logdir=os.path.join(args.output_dir, "tensorboard"), purge_step=global_step + 1)
    amp_level = 4 if args.amp and jt.flags.use_cuda else 0
    if args.amp and not jt.flags.use_cuda:
        print("--amp ignored: no GPU in use, training in fp32")
    run = argparse.Namespace(
        output_dir=args.output_dir, world_size=args.world_size, val_dataset=val_ds, stopper=stopper,
        log_writer=log_writer, sigterm=sigterm, amp_level=amp_level, global_step=global_step,
        steps_per_epoch=steps_per_epoch, total_steps=args.epochs * steps_per_epoch,
        warmup_steps=int(round(args.warmup_epochs * steps_per_epoch)), stop_reason=None,
        input_tokens=0, train_seconds=0.0, signature=resume_signature(args), saved_args=dict(vars(args)))
    print(f"{len(train_ds)} batches of {args.batch_size} per epoch, {steps_per_epoch} optimizer steps per epoch, "
          f"{run.total_steps} in all, lr {args.lr:.3g}, {args.world_size} rank(s)")
    if args.max_steps and global_step >= args.max_steps:
        run.stop_reason = "max_steps"
    for epoch in range(start_epoch, args.epochs):
        if run.stop_reason:
            break
        train_one_epoch(model, train_ds, optimizer, epoch, start_batch, run, args)
        start_batch = 0
    if log_writer is not None:
        log_writer.close()
    if run.train_seconds > 0:
        steps = run.global_step - global_step
        print(f"trained {steps} steps in {run.train_seconds:.1f} s: {steps / run.train_seconds:.2f} steps/s, "
              f"{run.input_tokens / run.train_seconds:.0f} tokens/s (padded inputs, all ranks)")
    all_reduce_sum([0.0])  # barrier: no rank exits (and makes mpirun kill the rest) while rank 0 still writes
    if run.stop_reason == "sigterm":
        print(f"stopped by SIGTERM at step {run.global_step}; checkpoint-latest.pth is saved, "
              f"continue with --resume auto")
        return 143
    write_adapter({"adapter": adapter_arrays(model), "model_args": model.args.to_dict()},
                  os.path.join(args.output_dir, "adapter"))
    best = f", best val_loss {stopper.best:.4f} in adapter-best/" if math.isfinite(stopper.best) else ""
    print(f"done ({run.stop_reason or 'all epochs'}): adapter in {os.path.join(args.output_dir, 'adapter')}{best}")
    return 0


def main(argv=None):
    if os.environ.get("DISABLE_MULTIPROCESSING") == "1":  # set by block_sigterm: the pool, not the threads
        jt.flags.use_parallel_op_compiler = 16  # Jittor's default, which that switch also turned off
    args = get_args_parser().parse_args(argv)
    misc.init_distributed_mode(args)
    print(json.dumps(vars(args), indent=2))
    try:
        return finetune(args, StopFlag())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, force=True)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr, force=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
