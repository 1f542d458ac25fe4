"""The peak memory of a training step with the loss through the output matrix as it runs (elementwise.output_nll:
row chunks, run one by one past LAZY_CHUNKS of them) against the whole [B*T,V] logits at once in the lazy graph.

python bench/loss_memory.py [--path plain|fused] [--vocab_size 128256] [--dim 512] [--n_layers 2] [--precision bf16]
A random model of those sizes (the bench recipe's Sparse MoA) takes one forward and backward on 8 x 256 tokens, on
Jittor's own ops (--path plain: the fused CPU kernels off, the graph a GPU runs; use_cuda=1 runs it there) or on
this CPU's fused kernels (--path fused); Jittor's memory profiler gives the peak of its live tensors, each form in a
process of its own. Prints key=value pairs last.
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

from common import CONFIGS, TRAIN_BATCH, TRAIN_SEQ, fail  # bench/common.py

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from bench import model_args  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Models.kernels import elementwise, switch  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402

def whole_nll(h, weight, targets, scale=None):
    """The loss of the whole [B*T,V] logits at once, through autograd."""
    B, T, D = h.shape
    return elementwise.rows_nll(h.reshape(B * T, D), weight, targets.reshape(B * T), scale).reshape(B, T)


FORMS = ("chunks", "whole")


def peak_of_step(form: str, opts) -> tuple:
    """(peak MB of live tensors, seconds) of the second training step with the loss in `form`."""
    if opts.path == "plain":
        switch.fused_kernels_on = lambda: False  # Jittor's own ops everywhere, as on a GPU
    if form == "whole":
        elementwise.output_nll.fused = elementwise.output_nll.plain = whole_nll
    CONFIGS["loss"] = dict(dim=opts.dim, n_layers=opts.n_layers, n_heads=8, n_kv_heads=8, vocab_size=opts.vocab_size,
                           multiple_of=128)
    jt.set_global_seed(0)
    model = LLaMA_adapter(model_args("loss", {"variant": "sparse", "precision": opts.precision}))
    model.train()
    tokens = jt.array(np.random.default_rng(0).integers(1, opts.vocab_size, (TRAIN_BATCH, TRAIN_SEQ)).astype(np.int32))
    mask = jt.ones((TRAIN_BATCH, TRAIN_SEQ))
    params = [p for p in model.parameters() if not p.is_stop_grad()]

    def step():
        loss, _ = model(tokens, mask, with_logits=False)
        jt.sync(jt.grad(loss, params))
    step()  # compiles
    jt.sync_all(True)
    jt.gc()
    jt.flags.profile_memory_enable = 1
    start = time.perf_counter()
    step()
    jt.sync_all(True)
    seconds = time.perf_counter() - start
    return int(jt.get_max_memory_info().split("[!@#div1!@#]")[0]) / 2**20, seconds


def main():
    """Exit codes: 0 done, 2 bad arguments (one `error:` line)."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("plain", "fused"), default="plain",
                        help="Jittor's own ops (a GPU's graph) or this CPU's fused kernels")
    parser.add_argument("--vocab_size", type=int, default=128256, help="the output matrix's rows (LLaMA-3's)")
    parser.add_argument("--dim", type=int, default=512, help="the model's width")
    parser.add_argument("--n_layers", type=int, default=2, help="the model's depth")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="the base's storage")
    parser.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)  # one form, in a process of its own
    opts = parser.parse_args()
    for name in ("vocab_size", "dim", "n_layers"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} {getattr(opts, name)} must be at least 1")
    if opts.form:
        mb, seconds = peak_of_step(opts.form, opts)
        print(f"{opts.form} {mb:.1f} {seconds:.2f}")
        return
    figures = {}
    for form in FORMS:
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--form", form], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"the {form} run failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        _, mb, seconds = done.stdout.split()[-3:]
        figures[form] = float(mb), float(seconds)
    tokens = TRAIN_BATCH * TRAIN_SEQ
    chunks = -(-tokens // elementwise.logit_rows(opts.vocab_size))
    print(f"path={opts.path} vocab_size={opts.vocab_size} dim={opts.dim} n_layers={opts.n_layers} "
          f"precision={opts.precision} tokens={tokens} device={'cuda' if jt.flags.use_cuda else 'cpu'} chunks={chunks} "
          f"run_one_by_one={int(chunks > elementwise.LAZY_CHUNKS)} "
          f"peak_mb_chunks={figures['chunks'][0]:.1f} peak_mb_whole={figures['whole'][0]:.1f} "
          f"step_s_chunks={figures['chunks'][1]:.2f} step_s_whole={figures['whole'][1]:.2f}")


if __name__ == "__main__":
    main()
