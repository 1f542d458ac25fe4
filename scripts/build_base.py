"""Rebuild the demo's tiny LLaMA-3 base (assets/tiny-math-base) from nothing.

    python scripts/build_base.py --minutes 40

1. A byte-level BPE tokenizer (digits never merged) trained on synthetic text.
2. A small LLaMA-3 (Meta's architecture, this project's Jittor code) pretrained
   from random on a synthetic corpus of arithmetic and story sentences:
   equations and two-step chains, the word problems' statements, and their
   solution sentences, drawn separately so that no problem is ever followed by
   its own solution. The base learns the language and the arithmetic; mapping a
   question to its solution is what the MoA fine-tune has to learn.
3. Saved in Meta's format (params.json, consolidated.00.pth in bf16, tokenizer.model).
"""
import argparse
import math
import os
import random
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from Data.bpe import train_bpe  # noqa: E402
from Data.synthetic import FAMILIES  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Models.ModelArgs import ModelArgs  # noqa: E402
from Data.tiny_base import DEFAULT_BASE_DIR, params_for, random_base_weights  # noqa: E402
from Models.Tokenizer import Tokenizer  # noqa: E402
from Models.formats.pth_writer import save_pth  # noqa: E402
from Utils import output_dirs  # noqa: E402
from Utils.file_io import write_json  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402


def equation(rng: random.Random) -> str:
    kind = rng.randrange(5)
    a, b = rng.randint(0, 40), rng.randint(0, 40)
    if kind == 0:
        return f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} = {a - b}."
    if kind == 2:
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        return f"{a} * {b} = {a * b}." if rng.random() < 0.5 else f"{a * b} / {a} = {b}."
    if kind == 3:
        c = rng.randint(0, a + b)
        return f"{a} + {b} - {c} = {a + b - c}."
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 6)
    return f"{a} + {b} = {a + b}. {a + b} * {c} = {(a + b) * c}."


def document(rng: random.Random) -> str:
    """A few unrelated sentences: equations, a problem statement, a (different) solution."""
    pieces = []
    for _ in range(rng.randint(2, 4)):
        kind = rng.random()
        if kind < 0.4:
            pieces.append(equation(rng))
        elif kind < 0.7:
            pieces.append(rng.choice(FAMILIES)(rng)[0])
        else:
            _, steps, n = rng.choice(FAMILIES)(rng)
            pieces.append(" ".join(steps) + f" The answer is {n}.")
    return " ".join(pieces)


def token_stream(tokenizer: Tokenizer, rng: random.Random, block: int, batch: int):
    """Endless [batch, block+1] int32 blocks of packed documents separated by eos."""
    buffer = []
    while True:
        while len(buffer) < batch * (block + 1):
            buffer += tokenizer.encode(document(rng), bos=True, eos=True)
        rows = np.array(buffer[:batch * (block + 1)], np.int32).reshape(batch, block + 1)
        buffer = buffer[batch * (block + 1):]
        yield rows


def lr_at(elapsed: float, total: float, peak: float, warmup: float = 0.03) -> float:
    if elapsed < warmup * total:
        return peak * elapsed / (warmup * total)
    progress = min(1.0, (elapsed - warmup * total) / ((1 - warmup) * total))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


FILES = ("tokenizer.model", "params.json", "consolidated.00.pth", "build_info.json")
TOOL = "scripts/build_base.py"


def get_args_parser():
    parser = ArgumentParser(prog="python scripts/build_base.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_BASE_DIR, help="output Meta checkpoint directory; its four files "
                        "are replaced together once the base is built, never a file the tools did not write")
    parser.add_argument("--minutes", type=float, default=40.0, help="pretraining wall-clock budget")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--n_layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n_heads", type=int, default=4, help="attention heads")
    parser.add_argument("--n_kv_heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--bpe_vocab", type=int, default=512, help="BPE vocabulary (the 256 bytes and their merges), "
                        "before the 256 special tokens")
    parser.add_argument("--block", type=int, default=128, help="tokens per training row")
    parser.add_argument("--batch", type=int, default=32, help="rows per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=1234, help="seed for data, tokenizer and weights")
    return parser


def check_options(opts):
    """Every setting checked before the tokenizer trains and before a file is written."""
    for flag in ("minutes", "block", "batch", "lr"):
        if not getattr(opts, flag) > 0:
            raise ValueError(f"--{flag} {getattr(opts, flag)} must be positive")
    if opts.bpe_vocab < 256:
        raise ValueError(f"--bpe_vocab {opts.bpe_vocab}: the vocabulary holds the 256 single bytes at least")
    # the model's shape rules (ModelArgs), at the vocabulary the tokenizer will have at most
    ModelArgs(**params_for(opts.bpe_vocab + 256, opts.dim, opts.n_layers, opts.n_heads, opts.n_kv_heads,
                           multiple_of=32), max_seq_len=opts.block + 1, max_batch_size=opts.batch)
    output_dirs.check_output_dir(opts.out, "--out")
    output_dirs.check_claimable(opts.out, FILES, "--out")


def pretrain(opts, folder: str) -> dict:
    """The tokenizer and the pretrained base's files in `folder`; the build's record."""
    rng = random.Random(opts.seed)
    corpus = [document(rng) for _ in range(20000)]
    tokenizer_path = train_bpe(corpus, opts.bpe_vocab, os.path.join(folder, "tokenizer.model"))
    tokenizer = Tokenizer(tokenizer_path)
    params = params_for(tokenizer.n_words, opts.dim, opts.n_layers, opts.n_heads, opts.n_kv_heads, multiple_of=32)
    args = ModelArgs(**params, max_seq_len=opts.block + 1, max_batch_size=opts.batch)
    jt.set_global_seed(opts.seed)
    model = LLaMA_adapter(args)
    initial = random_base_weights(args, opts.seed)
    for name, var in model.llama.named_parameters():  # the base itself trains here: unfreeze it
        var.assign(jt.array(initial[name]))
        var.requires_grad = True
    weights = list(model.llama.parameters())
    optimizer = jt.optim.AdamW(weights, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.01)
    mask = jt.ones((opts.batch, opts.block + 1))
    stream = token_stream(tokenizer, random.Random(opts.seed + 1), opts.block, opts.batch)
    budget, start, step, smoothed = opts.minutes * 60, time.time(), 0, None
    bar = tqdm(total=int(budget), unit="s", desc="pretraining")
    while step == 0 or time.time() - start < budget:
        optimizer.lr = lr_at(time.time() - start, budget, opts.lr)
        loss, _ = model(jt.array(next(stream)), mask, with_logits=False)
        optimizer.step(loss)
        value = float(loss.item())
        smoothed = value if smoothed is None else 0.98 * smoothed + 0.02 * value
        step += 1
        bar.n = int(time.time() - start)
        bar.set_postfix(step=step, loss=f"{smoothed:.3f}", lr=f"{optimizer.lr:.1e}")
    bar.close()
    state = {name: var.numpy() for name, var in model.llama.named_parameters()}  # Meta's names
    save_pth(state, os.path.join(folder, "consolidated.00.pth"), bf16=True)
    write_json(params, os.path.join(folder, "params.json"))
    record = {"steps": step, "tokens": step * opts.batch * opts.block, "final_loss": smoothed,
              "minutes": opts.minutes, **vars(opts)}
    write_json(record, os.path.join(folder, "build_info.json"))
    return record


def main(argv=None):
    """Exit codes: 0 built, 2 bad options or an --out that is not this tool's to write, 4 a write failed."""
    opts = get_args_parser().parse_args(argv)
    try:
        check_options(opts)
        output_dirs.remove_stale_temp(os.path.dirname(os.path.abspath(opts.out)), recursive=False)
        staging = output_dirs.staging_dir(os.path.abspath(opts.out), os.getpid())  # beside --out, until it is built
        output_dirs.make_staging(staging, TOOL)
        try:
            record = pretrain(opts, staging)
            os.makedirs(opts.out, exist_ok=True)
            output_dirs.record_written(opts.out, TOOL, FILES)
            for name in FILES:
                os.replace(os.path.join(staging, name), os.path.join(opts.out, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except ValueError as e:  # RunDirError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {e.filename or opts.out}: {e.strerror or e}", file=sys.stderr)
        return 4
    print(f"saved {opts.out}: {record['steps']} steps, {record['tokens'] / 1e6:.1f}M tokens, "
          f"loss {record['final_loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
