"""Evaluation at the 8B shape: batched generation through Infer.py's path against the machine's rooflines.

python bench/eval_scale.py [--arch llama31-8b|qwen3-8b|qwen3-14b] [--llama_path DIR] [--n_layers 2]
                           [--batch_sizes 1 8 32 auto] [--precision bf16|int8|nf4]
Without --llama_path it writes a random bf16 checkpoint of the architecture's shape as bench/scale.py
does (its writer; removed at the end). It loads the base in bf16 (or --precision) with the math recipe's MoA adapter
(random experts: the work of a decode step does not depend on their values) and, for each batch size,
runs Models/generate.generate as Infer.generate_share calls it, with the math recipe's sampling
(temperature 0.1, top_p 0.75): a batch of prompts of the math test sets' lengths (the sorted lengths
around their median), one warm-up, then a timed run of --new_tokens steps. `auto` is the batch
Infer.py's --batch_size auto picks from the memory left after loading.

On a GPU (use_cuda=1) the same, with the GPU's rooflines (bench/rooflines.py) and its peak memory.
Beside each figure, the roofline measured in the same run (the machine may be shared: each peak is the
best of a measure just before and one just after its batch's timed run, the bandwidth the best of a
measure after loading and one after each batch):
- memory: a streaming read of every base matrix in memory (bytes/s); a decode step reads the matrices
  of every layer and the output matrix once, whatever the batch;
- compute: the bf16 product's best rate at the decode shape (batch rows times 4096, the weights in
  cache, so no memory stall: the better of the model's own decode product, on the base's storage, and
  oneDNN's bf16 gemm)
  and at the prefill shape (oneDNN's bf16 gemm at a chunk's rows times the FFN's 14336 x 4096).
decode roofline (tokens/s) = batch / max(matrix bytes / bandwidth, 2 * matrix elements * batch /
decode peak); prefill peak (tokens/s) = prefill gemm peak / (2 * the layers' matrix elements: the output
matrix serves only each prompt's last token). Attention, norms,
the adapters and sampling are outside both rooflines: they are what the ratios leave to explain.
The bf16 units' issue rate (dot products from registers on every core) bounds every batch: a token's
products at that rate (2 x matrix elements of FLOP) give the most tokens/s any batch could decode here
(`speedup_bound`: that over batch 1's measured tokens/s; `machine_balance`: that over a batch 1 reading
the weights at the streaming rate, the units' FLOP/s over the bandwidth's bytes/s times the bytes of a
weight over its 2 FLOP a row: a bf16 weight is 2 bytes, an int8 one 1).
Last, the projected wall time of the paper's math (4,076 problems, up to 200 new tokens each) and
commonsense (12,369 problems, 40 tokens) evaluations at the best batch: the test sets of --data_root
tokenized by --tokenizer (prompt lengths; sets missing from --data_root are assumed to have the same
lengths), batched longest-first, prefill at the measured prefill rate, each step at the measured
decode rate, every example generating its whole budget (no early stop: an upper bound).
Prints key=value pairs last.
"""
import argparse
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from common import GpuMemoryPeak  # noqa: E402  (bench/common.py, beside this script)
from rooflines import product_gflops, stream_bandwidth, units_issue_gflops  # noqa: E402
from scale import ARCHS, peak_rss_gb, write_random_checkpoint  # noqa: E402
from Data.prompts import format_prompt  # noqa: E402
from Data.test_sets import data_files, load_test_sets  # noqa: E402
from Models.formats.base_model import LAYOUTS, base_args, build_model  # noqa: E402
from Models.generate import auto_batch_size, generate, prefill_chunks  # noqa: E402
from Models.Tokenizer import Tokenizer  # noqa: E402
from Utils.settings import ArgumentParser, count_or_auto, recipe_values  # noqa: E402

# the paper's evaluations: problems (their test sets' sizes) and new tokens per problem (the recipes')
PAPER = {"math": (4076, recipe_values("math")["max_gen_len"]),
         "commonsense": (12369, recipe_values("commonsense")["max_gen_len"])}
SHARED = os.environ.get("MOA_SHARED", os.path.join(os.path.dirname(REPO), "shared"))
PREFILL_CHUNK = 64  # generate's prefill_step: the prefill's chunk length
PEAK_ROWS, PEAK_REPS = 192, 200  # the decode peak's weights: 192 x 4096 (1.5 MB in bf16, in the caches)

def test_set_lengths(root: str, tokenizer_path: str) -> dict:
    """{'math': lengths, 'commonsense': lengths}: the prompt lengths (Alpaca template, BOS) of the test sets
    under root/math and root/commonsense, or None where they or the tokenizer are missing."""
    if not os.path.isfile(tokenizer_path):
        return {name: None for name in PAPER}
    tok = Tokenizer(tokenizer_path)
    found = {}
    for name in PAPER:
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            found[name] = None
            continue
        examples, _ = load_test_sets(data_files([folder]), None)
        found[name] = np.array([len(tok.encode(format_prompt(ex), bos=True, eos=False)) for ex in examples])
    return found


def median_batch(lengths: np.ndarray, batch: int) -> list:
    """The lengths of the `batch` prompts around the median of the sorted lengths (a longest-first batch)."""
    ordered = np.sort(lengths)
    start = max(0, min(len(ordered) - batch, len(ordered) // 2 - batch // 2))
    return [int(n) for n in ordered[start:start + batch]]


def projected_hours(lengths: np.ndarray, problems: int, new_tokens: int, batch: int, prefill_tok_s: float,
                    decode_tok_s: float) -> float:
    """Hours to generate for `problems` prompts of these lengths' distribution at this batch, as generate
    runs them: longest-first batches, the prefill's chunks at the prefill rate, then one step per token
    left (the rest of the longest prompt and every new token) at the decode rate."""
    ordered = np.sort(lengths)[::-1]
    seconds = 0.0
    for start in range(0, len(ordered), batch):
        rows = ordered[start:start + batch]
        prefilled = sum(prefill_chunks(int(rows.min()), PREFILL_CHUNK))
        seconds += batch * prefilled / prefill_tok_s + (int(rows.max()) - prefilled + new_tokens) * batch / decode_tok_s
    return seconds * problems / len(ordered) / 3600


def time_batch(model, lengths: list, new_tokens: int, rng) -> dict:
    """One warm-up and one timed generate of these prompts (random tokens) with the math recipe's sampling."""
    prompts = [[1] + list(rng.integers(2, model.llama.args.vocab_size, n - 1)) for n in lengths]
    recipe = recipe_values("math")
    no_stops = SimpleNamespace(stop_tokens=set(), n_words=model.llama.args.vocab_size)
    for max_gen_len in (2, new_tokens):  # the warm-up compiles every shape of the timed run
        timings = {}
        generate(model, no_stops, prompts, max_gen_len, recipe["temperature"], recipe["top_p"], seed=0,
                 batch_size=len(prompts), timings=timings)
    B = len(prompts)
    return dict(prefill_tok_s=timings["prefill_tokens"] / timings["prefill_s"],
                decode_tok_s=B * timings["decode_steps"] / timings["decode_s"],
                step_s=timings["decode_s"] / timings["decode_steps"],
                sampling_s=timings["sampling_s"] / timings["decode_steps"], peak_rss_gb=peak_rss_gb())


def measure(opts, work: str):
    gpu_memory = GpuMemoryPeak().start()  # use_cuda=1: the process's peak GPU memory on the last line
    llama_dir = opts.llama_path
    if llama_dir is None:
        llama_dir = os.path.join(work, "base")
        os.makedirs(llama_dir)
        write_random_checkpoint(llama_dir, opts.arch, opts.n_layers or ARCHS[opts.arch]["n_layers"])
    lengths = test_set_lengths(opts.data_root, opts.tokenizer)
    assumed = {name: v is None for name, v in lengths.items()}
    lengths = {name: np.full(64, opts.assumed_prompt_len) if v is None else v for name, v in lengths.items()}
    longest = max(int(v.max()) for v in lengths.values())
    settings = {k: v for k, v in recipe_values("math", opts.variant).items() if k in base_args(llama_dir).to_dict()}
    args = base_args(llama_dir, **{**settings, "precision": opts.precision, "max_seq_len": longest + opts.new_tokens,
                                   "max_batch_size": 1})
    model = build_model(llama_dir, args)
    model.eval()
    print(f"loaded {args.n_layers} layers, peak RSS {peak_rss_gb():.2f} GB", flush=True)

    layers = [p for name, p in model.base_parameters().items() if len(p.shape) == 2 and ".layers." in name]
    matrices = layers + [model.llama.output.weight]  # the output matrix is the embedding's when tied
    step_bytes = sum(m.nbytes for m in matrices)  # what a decode step reads, whatever the batch
    step_flops = 2 * sum(m.numel() for m in matrices)  # a decode step's products, per row of the batch
    token_flops = 2 * sum(m.numel() for m in layers)  # a prefill token's products (logits: the last token's only)
    bandwidth = stream_bandwidth(matrices)
    ffn = model.llama.layers[0].feed_forward.w1
    peak = (ffn.weight[:PEAK_ROWS].clone(), None if ffn.weight_scale is None else ffn.weight_scale[:PEAK_ROWS].clone())
    ffn = (ffn.weight, ffn.weight_scale)
    auto = auto_batch_size(args, args.max_seq_len, 1 << 30)
    batches = sorted({auto if b == "auto" else b for b in opts.batch_sizes})
    print(f"streaming read {step_bytes / 1e9:.2f} GB: {bandwidth / 1e9:.1f} GB/s; auto batch {auto}", flush=True)

    rng = np.random.default_rng(0)
    rows = {}
    for B in batches:
        # the peaks: the best of a measure before and one after the timed run (the machine is shared)
        peaks = [(product_gflops(B, *peak, PEAK_REPS, decode=True),
                  product_gflops(B * PREFILL_CHUNK, *ffn, 3, decode=False))]
        r = time_batch(model, median_batch(lengths["math"], B), opts.new_tokens, rng)
        peaks.append((product_gflops(B, *peak, PEAK_REPS, decode=True),
                      product_gflops(B * PREFILL_CHUNK, *ffn, 3, decode=False)))
        r.update(decode_peak_gflops=max(p for p, _ in peaks), prefill_peak_gflops=max(p for _, p in peaks))
        rows[B] = r
        bandwidth = max(bandwidth, stream_bandwidth(matrices))
        print(f"batch {B}: prefill {r['prefill_tok_s']:.1f} tok/s; decode {r['decode_tok_s']:.2f} tok/s, "
              f"{r['step_s']:.3f} s a step, {r['sampling_s']:.3f} s of it sampling; peak RSS {r['peak_rss_gb']:.2f} GB",
              flush=True)
    units = units_issue_gflops()  # NaN on a GPU (its gemm peak is the decode and prefill peaks' vendor side)
    balance = units * 1e9 / step_flops / (bandwidth / step_bytes)  # the units' tokens/s over the streaming read's
    print(f"rooflines: streaming read {bandwidth / 1e9:.1f} GB/s (the best of {len(batches) + 1} measures)"
          + ("" if np.isnan(units) else f"; the bf16 units issue {units:.0f} GFLOP/s: no batch decodes faster than "
             f"{units * 1e9 / step_flops:.1f} tok/s on this CPU (a token's products at that rate, nothing else), "
             f"{balance:.1f}x a batch 1 at the streaming read's rate"))
    for B, r in rows.items():
        roofline = B / max(step_bytes / bandwidth, step_flops * B / (r["decode_peak_gflops"] * 1e9))
        r.update(decode_roofline_tok_s=roofline, decode_over_roofline=r["decode_tok_s"] / roofline,
                 prefill_over_peak=r["prefill_tok_s"] / (r["prefill_peak_gflops"] * 1e9 / token_flops))
        print(f"batch {B}: prefill {r['prefill_over_peak']:.2f} of the bf16 gemm peak {r['prefill_peak_gflops']:.0f} "
              f"GFLOP/s; decode {r['decode_over_roofline']:.2f} of the roofline {roofline:.2f} tok/s (product peak "
              f"{r['decode_peak_gflops']:.0f} GFLOP/s)")

    best = max(rows, key=lambda b: rows[b]["decode_tok_s"])
    r = rows[best]
    hours = {name: projected_hours(lengths[name], problems, tokens, best, r["prefill_tok_s"], r["decode_tok_s"])
             for name, (problems, tokens) in PAPER.items()}
    for name, h in hours.items():
        source = (f"assumed prompts of {opts.assumed_prompt_len} tokens" if assumed[name] else
                  f"prompt lengths of {len(lengths[name])} problems of {opts.data_root}/{name} "
                  f"(mean {lengths[name].mean():.0f})")
        print(f"{name}: {PAPER[name][0]} problems x {PAPER[name][1]} new tokens at batch {best}: {h:.1f} h ({source})")
    line = {"base": opts.llama_path or opts.arch, "precision": args.precision, "n_layers": args.n_layers, "batches": ",".join(map(str, batches)),
            "bandwidth_gb_s": f"{bandwidth / 1e9:.1f}", "best_batch": best,
            "decode_tok_s": f"{r['decode_tok_s']:.3g}", "decode_roofline_tok_s": f"{r['decode_roofline_tok_s']:.3g}",
            "decode_over_roofline": f"{r['decode_over_roofline']:.2f}",
            "decode_peak_gflops": f"{r['decode_peak_gflops']:.0f}",
            "speedup_over_batch1": f"{r['decode_tok_s'] / rows[1]['decode_tok_s']:.1f}" if 1 in rows else "nan",
            "units_issue_gflops": f"{units:.0f}",
            "speedup_bound": f"{units * 1e9 / step_flops / rows[1]['decode_tok_s']:.1f}" if 1 in rows else "nan",
            "machine_balance": f"{balance:.1f}",
            "prefill_tok_s": f"{r['prefill_tok_s']:.3g}", "prefill_over_peak": f"{r['prefill_over_peak']:.2f}",
            "prefill_peak_gflops": f"{r['prefill_peak_gflops']:.0f}", "peak_rss_gb": f"{peak_rss_gb():.2f}",
            "math_eval_hours": f"{hours['math']:.1f}", "commonsense_eval_hours": f"{hours['commonsense']:.1f}"}
    for B, b in rows.items():
        line.update({f"b{B}_decode_tok_s": f"{b['decode_tok_s']:.3g}",
                     f"b{B}_decode_over_roofline": f"{b['decode_over_roofline']:.2f}",
                     f"b{B}_prefill_tok_s": f"{b['prefill_tok_s']:.3g}"})
    print(" ".join(f"{k}={v}" for k, v in line.items()) + gpu_memory.keys())


def main():
    """Exit codes: 0 done, 2 bad arguments or input, 4 the temporary checkpoint could not be written."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama31-8b", choices=list(ARCHS),
                        help="the random checkpoint's shape and layout (bench/scale.py's; default: llama31-8b)")
    parser.add_argument("--llama_path", help="a base folder (Meta or Hugging Face) to load instead of a random one")
    parser.add_argument("--n_layers", type=int, default=None,
                        help="layers of the random checkpoint (default: the architecture's; a quick check: 2)")
    parser.add_argument("--variant", default="sparse", choices=("sparse", "soft"), help="the math recipe's MoA variant")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "int8", "nf4"),
                        help="the base's storage (default: bf16, the math recipe's)")
    parser.add_argument("--batch_sizes", nargs="+", type=count_or_auto, default=[1, 8, 32, "auto"],
                        help="batch sizes to time; auto: Infer.py's --batch_size auto (default: 1 8 32 auto)")
    parser.add_argument("--new_tokens", type=int, default=24, help="decode steps timed per batch (default: 24)")
    parser.add_argument("--data_root", default=os.path.join(SHARED, "data"),
                        help="folder with the math and commonsense test sets (their prompt lengths)")
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "llama3", "tokenizer.model"),
                        help="the tokenizer.model that measures the prompts")
    parser.add_argument("--assumed_prompt_len", type=int, default=80,
                        help="the prompt length assumed where the test sets or the tokenizer are missing")
    parser.add_argument("--tmp_dir", default=None, help="where the temporary folder goes (default: the system's)")
    opts = parser.parse_args()
    problems = [(opts.n_layers is not None and opts.n_layers < 1, f"--n_layers {opts.n_layers} must be at least 1"),
                (opts.new_tokens < 2, f"--new_tokens {opts.new_tokens} must be at least 2"),
                (opts.llama_path and not any(os.path.isfile(os.path.join(opts.llama_path, f))
                                             for f in LAYOUTS.values()),
                 f"--llama_path {opts.llama_path}: neither params.json (Meta's layout) nor config.json "
                 "(Hugging Face's) there")]
    problem = next((message for broken, message in problems if broken), None)
    if problem:
        parser.error(problem)
    jt.set_global_seed(0)
    work = tempfile.mkdtemp(prefix="moa-eval-scale-", dir=opts.tmp_dir)
    try:
        return measure(opts, work)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    except OSError as e:
        parser.exit(4, f"error: cannot write {e.filename or work}: {e.strerror or e}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
