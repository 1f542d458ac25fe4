"""Where a decode step's time goes besides its arithmetic: building its graph in Python, and running it.

python bench/decode_host.py [--config medium] [--precision bf16] [--batch 1] [--steps 200] [--n_layers N]
A random model of bench.py's shapes (Sparse MoA, the bench recipe's experts) is prefilled with a 32-token
prompt per row, then each step is `generate.feed` of one token per row and an argmax, timed in two parts:
- graph_ms: `feed` until its lazy logits exist (Python, and Jittor creating the ops): this thread's CPU time,
  which another process on the machine does not add to;
- run_ms: the argmax's `.numpy()`, which runs the step's ops (on a GPU: launches them and waits for them);
and the ops a step runs with their time (ops_ms: Jittor's profiler, each op at its fastest; on a GPU it waits for
each op, so this is the kernels' time): what run_ms has beyond it is Jittor's executor (and on a GPU the launches).
Each figure is the 10th percentile of --steps steps, the best of three runs (a shared machine is noisy). On a GPU
a step's ops are fast and the host's parts are most of a step.
Prints key=value pairs last.
"""
import argparse
import os
import sys
import time

import numpy as np

from common import CONFIGS, PROMPT_LEN  # bench/common.py

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from bench import model_args  # noqa: E402
from Models.generate import feed  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Models.ModelArgs import PRECISIONS  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402

RUNS, PROFILED_STEPS = 3, 20


def steps(model, rows: int, n: int) -> tuple:
    """A prefill and n decode steps: (graph seconds [n], run seconds [n])."""
    model.llama.reset_cache()
    prompts = np.random.default_rng(0).integers(1, model.args.vocab_size, (rows, PROMPT_LEN))
    picked = jt.argmax(feed(model, prompts, 0), dim=-1)[0].numpy()
    graph, run = np.empty(n), np.empty(n)
    for i in range(n):
        start = time.thread_time()
        logits = feed(model, picked[:, None], PROMPT_LEN + i)
        built = jt.argmax(logits, dim=-1)[0]
        graph[i] = time.thread_time() - start
        start = time.perf_counter()
        picked = built.numpy()
        run[i] = time.perf_counter() - start
    return graph, run


def profiled_ops(model, rows: int) -> tuple:
    """The ops Jittor runs in a decode step and their seconds (its profiler's, which waits for each op: on a GPU,
    the kernels' time) over a few steps, each op at its fastest run: (ops, seconds) a step."""
    model.llama.reset_cache()
    picked = jt.argmax(feed(model, np.ones((rows, PROMPT_LEN), np.int64), 0), dim=-1)[0].numpy()
    jt.profiler.start(0, 0)
    for i in range(PROFILED_STEPS):
        picked = jt.argmax(feed(model, picked[:, None], PROMPT_LEN + i), dim=-1)[0].numpy()
    jt.profiler.stop()
    header, *report = jt.profiler.report()
    count, fastest_ns = header.index("Count"), header.index("MinTime")
    return (sum(int(row[count]) for row in report) / PROFILED_STEPS,
            sum(int(row[count]) * float(row[fastest_ns]) for row in report) * 1e-9 / PROFILED_STEPS)


def main():
    """Exit codes: 0 done, 2 bad arguments (one `error:` line)."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="medium", help="model size")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16", help="the base's storage")
    parser.add_argument("--batch", type=int, default=1, help="rows a step decodes")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per run")
    parser.add_argument("--n_layers", type=int, help="the model's depth (default: the config's)")
    opts = parser.parse_args()
    for name in ("batch", "steps", "n_layers"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value} must be at least 1")
    args = model_args(opts.config, {"variant": "sparse", "precision": opts.precision}, opts.n_layers)
    if PROMPT_LEN + opts.steps + PROFILED_STEPS > args.max_seq_len:
        parser.error(f"--steps {opts.steps} must be at most {args.max_seq_len - PROMPT_LEN - PROFILED_STEPS}")
    jt.set_global_seed(0)
    model = LLaMA_adapter(args)
    model.eval()
    with jt.no_grad():
        steps(model, opts.batch, 20)  # compiles every op a step runs
        best = min(((np.percentile(graph, 10), np.percentile(run, 10))
                    for graph, run in (steps(model, opts.batch, opts.steps) for _ in range(RUNS))), key=sum)
        ops, ops_seconds = profiled_ops(model, opts.batch)
    graph_ms, run_ms = (seconds * 1e3 for seconds in best)
    print(f"config={opts.config} n_layers={args.n_layers} precision={args.precision} batch={opts.batch} "
          f"device={'cuda' if jt.flags.use_cuda else 'cpu'} graph_ms={graph_ms:.3f} run_ms={run_ms:.3f} "
          f"ops_per_step={ops:.0f} ops_ms={ops_seconds * 1e3:.3f}")


if __name__ == "__main__":
    main()
