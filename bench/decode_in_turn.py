"""Batch-1 decoding of one base in several precisions, in turn in one process: their rates' ratio side by side.

python bench/decode_in_turn.py [--arch llama31-8b] [--llama_path DIR] [--checkpoint_dir DIR] [--n_layers N]
                               [--precisions int8 nf4] [--rounds 10] [--tokens 32] [--variant sparse]
bench/scale.py runs each precision in a process of its own (its peak RSS is its own), minutes apart; this machine's
memory rates drift by a quarter and more within minutes, and a decode step is a pass over the weights, so a ratio of
rates measured minutes apart is as much the drift's as the kernels'. Here every precision's model (the math recipe's
adapters on the same checkpoint: scale.py's random one without --llama_path) is loaded into one process, and each
round greedy-decodes --tokens tokens after the same prompt in each precision in turn, the order reversed every other
round (ABBA), so that each round's ratio compares runs seconds apart. The figure is the median of the rounds' ratios
(each the steady rate of the decode steps, scale.py's decode_step_tok_s); the median rates are printed beside it.
The models must fit in memory together (int8 and nf4 at the 8B shape: about 16 GB). Prints key=value pairs last.
"""
import argparse
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import ARCHS, PROMPT_LEN, peak_rss_gb, random_checkpoint  # noqa: E402  (bench/scale.py)

from Models.formats.base_model import LAYOUTS, base_args, build_model  # noqa: E402
from Models.generate import generate  # noqa: E402
from Models.ModelArgs import ModelArgs, PRECISIONS  # noqa: E402
from Utils.settings import ArgumentParser, recipe_values  # noqa: E402


def load(llama_dir: str, precision: str, variant: str, seq_len: int):
    settings = {k: v for k, v in recipe_values("math", variant).items() if k in ModelArgs.__dataclass_fields__}
    args = base_args(llama_dir, **{**settings, "max_seq_len": seq_len, "max_batch_size": 1, "precision": precision})
    model = build_model(llama_dir, args)
    model.eval()
    print(f"[{precision}] loaded, peak RSS {peak_rss_gb():.2f} GB", flush=True)
    return model


def decode_rate(model, prompt, tokens: int) -> float:
    """Tokens a second in the decode steps of one greedy generation of `tokens` tokens after `prompt`."""
    no_stops = SimpleNamespace(stop_tokens=set(), n_words=model.args.vocab_size)
    timings = {}
    generate(model, no_stops, [prompt], max_gen_len=tokens, timings=timings)
    return timings["decode_steps"] / timings["decode_s"]


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama31-8b", choices=list(ARCHS), help="the random checkpoint's shape")
    parser.add_argument("--llama_path", help="a base folder (Meta or Hugging Face) to load instead of a random one")
    parser.add_argument("--checkpoint_dir", help="keep the random checkpoint here (scale.py's: reused if there)")
    parser.add_argument("--n_layers", type=int, default=None, help="layers of the random checkpoint (a quick check: 2)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["int8", "nf4"],
                        help="the base's precisions, each loaded once; ratios are to the first")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of one decode in each precision")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a decode generates")
    parser.add_argument("--variant", default="sparse", choices=["sparse", "soft"], help="the math recipe's variant")
    parser.add_argument("--tmp_dir", default=None, help="where a temporary random checkpoint goes")
    opts = parser.parse_args()
    problems = [
        (len(opts.precisions) < 2 or len(set(opts.precisions)) < len(opts.precisions),
         f"--precisions {' '.join(opts.precisions)}: at least two, each once"),
        (opts.rounds < 1, f"--rounds {opts.rounds} must be at least 1"),
        (opts.tokens < 2, f"--tokens {opts.tokens} must be at least 2"),
        (opts.n_layers is not None and opts.n_layers < 1, f"--n_layers {opts.n_layers} must be at least 1"),
        (opts.llama_path and not any(os.path.isfile(os.path.join(opts.llama_path, f)) for f in LAYOUTS.values()),
         f"--llama_path {opts.llama_path}: neither params.json (Meta's layout) nor config.json (Hugging Face's) there")]
    problem = next((message for broken, message in problems if broken), None)
    if problem:
        parser.error(problem)
    work = tempfile.mkdtemp(prefix="moa-decode-", dir=opts.tmp_dir)
    try:
        llama_dir = opts.llama_path or random_checkpoint(opts, work)
        models = {p: load(llama_dir, p, opts.variant, PROMPT_LEN + opts.tokens + 1) for p in opts.precisions}
        prompt = [1] + list(np.random.default_rng(0).integers(1, base_args(llama_dir).vocab_size, PROMPT_LEN - 1))
        for model in models.values():
            decode_rate(model, prompt, 2)  # compiles the decode step
        rates = {p: [] for p in opts.precisions}
        for r in range(opts.rounds):
            for p in (opts.precisions if r % 2 == 0 else opts.precisions[::-1]):
                rates[p].append(decode_rate(models[p], prompt, opts.tokens))
            print(f"round {r}: " + ", ".join(f"{p} {rates[p][-1]:.2f}" for p in opts.precisions) + " tokens/s",
                  flush=True)
    except ValueError as e:  # a base that does not load or does not fit
        parser.exit(2, f"error: {e}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = opts.precisions[0]
    line = {"base": opts.llama_path or opts.arch, "rounds": opts.rounds, "tokens": opts.tokens,
            "peak_rss_gb": f"{peak_rss_gb():.2f}"}
    line.update({f"{p}_decode_step_tok_s": f"{np.median(rates[p]):.3g}" for p in opts.precisions})
    for p in opts.precisions[1:]:
        ratios = np.array(rates[p]) / np.array(rates[first])
        line[f"{p}_over_{first}_decode"] = f"{np.median(ratios):.2f}"
        line[f"{p}_over_{first}_decode_range"] = f"{ratios.min():.2f}-{ratios.max():.2f}"
    print(" ".join(f"{k}={v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
