"""What --precision int8 and nf4 change in a base's predictions: their logits against the same base in bf16 and fp32.

python bench/quantization.py [--bases DIR ...] [--problems 32]
For each base folder (default: the golden tiny Meta checkpoint, the golden LLaMA-3.1 and Qwen3 Hugging Face
checkpoints, and the demo's pretrained base) it loads the base in fp32, bf16, int8 and nf4 and runs the same
tokens through each: a golden folder's tokens (tests/golden/<...>.npz beside it), else --problems synthetic
math problems with their solutions, teacher-forced (the demo's text). Per base and precision pair: the
largest logit difference (and the logits' largest magnitude) and the share of positions whose most likely
next token agrees. Prints a markdown table and one key=value line last.
"""
import argparse
import os
import random
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from Data.prompts import format_prompt  # noqa: E402
from Data.synthetic import make_example  # noqa: E402
from Data.tiny_base import DEFAULT_BASE_DIR  # noqa: E402
from Models import load_base_model  # noqa: E402
from Models.formats.base_model import LAYOUTS, open_tokenizer  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402

GOLDEN = os.path.join(REPO, "tests", "golden")
BASES = {"tiny_meta": os.path.join(GOLDEN, "tiny_meta"), "llama31_tiny": os.path.join(GOLDEN, "hf", "llama31_tiny"),
         "qwen3_tiny": os.path.join(GOLDEN, "hf", "qwen3_tiny"), "demo": DEFAULT_BASE_DIR}
PAIRS = [("int8", "bf16"), ("nf4", "bf16"), ("int8", "fp32"), ("nf4", "fp32"), ("bf16", "fp32")]
SEQ = 128


def golden_tokens(folder: str):
    """The tokens of the golden file that belongs to `folder` (its base_logits.npz, or <folder>.npz), or None."""
    for path in (os.path.join(folder, "base_logits.npz"), folder.rstrip("/") + ".npz"):
        if os.path.isfile(path):
            return np.load(path)["tokens"].astype(np.int32)
    return None


def problem_tokens(folder: str, vocab_size: int, problems: int) -> tuple:
    """(tokens [problems, SEQ], mask of the real positions): synthetic problems with their solutions."""
    tokenizer = open_tokenizer(folder, vocab_size)
    rng = random.Random(1)
    rows = []
    for _ in range(problems):
        example = make_example(rng)
        rows.append(tokenizer.encode(format_prompt(example) + example["output"], bos=True, eos=False)[:SEQ])
    mask = np.array([[i < len(r) for i in range(SEQ)] for r in rows])
    return np.array([r + [0] * (SEQ - len(r)) for r in rows], np.int32), mask


def compare(folder: str, problems: int) -> dict:
    """{(a, b): (max abs difference, largest |logit| of b, top-1 agreement, positions compared)} for the pairs
    of PAIRS."""
    logits, tokens, mask = {}, golden_tokens(folder), None
    for precision in ("fp32", "bf16", "int8", "nf4"):
        model = load_base_model(folder, precision=precision, max_seq_len=SEQ, max_batch_size=8)
        if tokens is None:
            tokens, mask = problem_tokens(folder, model.args.vocab_size, problems)
        with jt.no_grad():
            logits[precision] = np.concatenate([model.llama(jt.array(tokens[i:i + 8])).numpy()
                                                for i in range(0, len(tokens), 8)])
        del model
    mask = np.ones(tokens.shape, bool) if mask is None else mask
    return {(a, b): (float(np.abs(logits[a] - logits[b])[mask].max()), float(np.abs(logits[b])[mask].max()),
                     float((logits[a].argmax(-1) == logits[b].argmax(-1))[mask].mean()), int(mask.sum()))
            for a, b in PAIRS}


def check_options(parser, opts):
    """Bad arguments: one `error:` line, exit 2, before any base is loaded."""
    if opts.problems < 1:
        parser.error(f"--problems {opts.problems} must be at least 1")
    for folder in opts.bases or []:
        if not any(os.path.isfile(os.path.join(folder, f)) for f in LAYOUTS.values()):
            parser.error(f"--bases {folder}: neither params.json (Meta's layout) nor config.json (Hugging Face's) there")


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bases", nargs="+", default=None, help="base folders (default: the golden ones and the demo's)")
    parser.add_argument("--problems", type=int, default=32, help="synthetic problems for a base without golden tokens")
    opts = parser.parse_args()
    check_options(parser, opts)
    bases = {os.path.basename(b.rstrip("/")): b for b in opts.bases} if opts.bases else BASES
    print("| base | positions | pair | max abs logit difference (largest logit) | top-1 agreement |")
    print("| --- | --- | --- | --- | --- |")
    line = {}
    for name, folder in bases.items():
        for (a, b), (diff, top, agree, n) in compare(folder, opts.problems).items():
            print(f"| {name} | {n} | {a} vs {b} | {diff:.3g} ({top:.3g}) | {100 * agree:.1f}% |", flush=True)
            line.update({f"{name}_{a}_{b}_max_abs": f"{diff:.3g}", f"{name}_{a}_{b}_top1": f"{agree:.4f}"})
    print(" ".join(f"{k}={v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
