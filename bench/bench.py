"""Training and decoding speed of MoA-Jittor on this machine; prints key=value pairs last.

python bench/bench.py --variant sparse --config small [--precision fp32] [--preset lora]
    [--config 8b --n_layers 4]
The model is random (speed does not depend on the values); the sgemm roofline
for MFU and the bf16 base matmul's rate are measured in the same run. On a GPU
(use_cuda=1) the line also has the process's peak GPU memory (peak_gpu_mb).
bench/side_by_side.py runs this beside the authors' code, or (--preset lora) beside peft.
"""
import argparse
import os
import resource
import sys
import time
from types import SimpleNamespace

import numpy as np

from common import (CONFIGS, DECODE_BATCH, DECODE_RUNS, LR, NEW_TOKENS, PROMPT_LEN, TIMED_STEPS,  # bench/common.py
                    TRAIN_BATCH, TRAIN_SEQ, WARMUP_STEPS, WEIGHT_DECAY, GpuMemoryPeak, describe_optimizer)

if __name__ == "__main__":  # before Jittor can open the device, so that its CUDA context counts
    GPU_MEMORY = GpuMemoryPeak().start()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from Models.generate import generate  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Models.ModelArgs import ModelArgs  # noqa: E402
from Models.kernels.precision import base_linear  # noqa: E402
from Models.kernels.adamw import build_optimizer  # noqa: E402
from Utils.settings import METHOD_PRESETS, ArgumentParser, add_arguments, given, recipe_values  # noqa: E402

GEMM_SIZE = 1024  # the bf16 roofline's n^3 product; bench/torch_gemm.py times torch on the same size


def model_args(config: str, settings: dict, n_layers: int = None) -> ModelArgs:
    """A random model of `config`'s shape (`n_layers` deep where given) with the bench recipe's
    experts, overridden by `settings`."""
    values = {**recipe_values("bench", settings.get("variant")), **settings}
    shape = {**CONFIGS[config], **({"n_layers": n_layers} if n_layers else {})}
    return ModelArgs(**shape, **values, max_seq_len=TRAIN_SEQ, max_batch_size=TRAIN_BATCH)


def train_flops_per_token(model: LLaMA_adapter, seq: int) -> float:
    """Frozen base: forward 2N and activation-only backward 2N; adapters 6N; attention 12*L*T*D."""
    args = model.args
    base_matmul = sum(int(np.prod(p.shape)) for n, p in model.base_parameters().items()
                      if n.endswith("weight") and len(p.shape) == 2 and "tok_embeddings" not in n)
    adapter_matmul = sum(int(np.prod(p.shape)) for p in model.adapter_parameters().values() if len(p.shape) == 2)
    return 4 * base_matmul + 6 * adapter_matmul + 12 * args.n_layers * seq * args.dim


def sgemm_gflops() -> float:
    """The machine's fp32 matmul peak, as the better of Jittor (oneDNN) and numpy (OpenBLAS)."""
    n = 2048
    a, b = jt.randn(n, n), jt.randn(n, n)
    (a @ b).sync(True)  # True: wait for the GPU too (CUDA runs asynchronously)
    start = time.perf_counter()
    for _ in range(5):
        (a @ b).sync(True)
    jittor_rate = 5 * 2 * n ** 3 / (time.perf_counter() - start) / 1e9
    x = np.random.rand(n, n).astype(np.float32)
    x @ x
    start = time.perf_counter()
    for _ in range(5):
        x @ x
    numpy_rate = 5 * 2 * n ** 3 / (time.perf_counter() - start) / 1e9
    return max(jittor_rate, numpy_rate)


def base_matmul_gflops(n: int = GEMM_SIZE) -> float:
    """Our bf16 base matmul (Models/kernels/precision.base_linear: fp32 x times bf16 weights, fp32 out) on an
    n^3 product, best of 3 after a warm-up, as bench/torch_gemm.py times torch."""
    x, weight = jt.randn(n, n), jt.randn(n, n).bfloat16().stop_grad()
    base_linear(x, weight).sync(True)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        base_linear(x, weight).sync(True)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def time_training(model: LLaMA_adapter, steps: int = TIMED_STEPS, warmup: int = WARMUP_STEPS):
    """(first step s, median step s, the optimizer's description, the loss's target tokens per step)."""
    rng = np.random.default_rng(0)
    optimizer = build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    mask = jt.ones((TRAIN_BATCH, TRAIN_SEQ))
    loss_tokens = int(mask[:, 1:].sum())  # LLaMA_adapter weighs predicting tokens[:, t] by mask[:, t], t >= 1
    groups = [(sum(int(np.prod(p.shape)) for p in g["params"]), g.get("lr", optimizer.lr),
               g.get("betas", optimizer.betas), g.get("eps", optimizer.eps), g["weight_decay"])
              for g in optimizer.param_groups]
    times = []
    for step in range(warmup + steps):
        tokens = jt.array(rng.integers(0, model.args.vocab_size, (TRAIN_BATCH, TRAIN_SEQ)).astype(np.int32))
        start = time.perf_counter()
        loss, _ = model(tokens, mask, with_logits=False)
        optimizer.step(loss)
        loss.sync()
        jt.sync_all(True)  # True: wait for the GPU too
        times.append(time.perf_counter() - start)
    return times[0], float(np.median(times[warmup:])), describe_optimizer("AdamW", groups), loss_tokens


def time_recompute(model: LLaMA_adapter, rounds: int) -> dict:
    """{False: median step s with every layer's activations kept, True: with them recomputed (--recompute)}, two steps
    of each in turn `rounds` times in this process (the machine's drift falls on both), the second timed (the first
    after a switch also refills Jittor's allocator, which the other kind of step left holding other blocks), after a
    round that compiles."""
    seconds = {False: [], True: []}
    for _ in range(rounds + 1):
        for recompute in seconds:
            model.args.recompute = recompute
            seconds[recompute].append(time_training(model, steps=1, warmup=1)[1])
    return {recompute: float(np.median(times[1:])) for recompute, times in seconds.items()}


def time_decoding(model: LLaMA_adapter):
    """Greedy decoding through the KV cache, no stop tokens so every row makes NEW_TOKENS:
    (tokens/s over the whole call, prefill included, tokens made per call)."""
    no_stops = SimpleNamespace(stop_tokens=set(), n_words=model.args.vocab_size)
    model.eval()
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(1, model.args.vocab_size, PROMPT_LEN)) for _ in range(DECODE_BATCH)]
    generate(model, no_stops, prompts, max_gen_len=NEW_TOKENS)  # compile every shape the timed runs meet
    rates = []
    for _ in range(DECODE_RUNS):  # the median: a shared machine is noisy
        start = time.perf_counter()
        out = generate(model, no_stops, prompts, max_gen_len=NEW_TOKENS)
        rates.append(sum(len(o) for o in out) / (time.perf_counter() - start))
    return float(np.median(rates)), sum(len(o) for o in out)


def main():
    """Exit codes: 0 done, 2 bad arguments (one `error:` line)."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model size")
    parser.add_argument("--n_layers", type=int, help="the model's depth (default: the config's; 8b at a depth "
                                                      "that fits the machine)")
    parser.add_argument("--no_decode", action="store_true", help="skip the decoding benchmark")
    parser.add_argument("--recompute_rounds", type=int, default=0,
                        help="instead of the other timings: a training step with each layer's activations kept, then "
                             "one with them recomputed (--recompute), this many times in turn; their tokens/s")
    parser.add_argument("--preset", choices=list(METHOD_PRESETS),
                        help="a method as Compare.py runs it (Utils/settings.METHOD_PRESETS; lora = plain LoRA on "
                             "the recipe's targets, no prompt, parallel adapter or router) over the bench recipe; "
                             "the flags below override it")
    add_arguments(parser.add_argument_group("model and experts (default: the bench recipe)"), ModelArgs,
                  recipe_values("bench"), exclude=("max_seq_len",))
    opts = parser.parse_args()
    if opts.n_layers is not None and opts.n_layers < 1:
        parser.error(f"--n_layers {opts.n_layers} must be at least 1")
    if opts.recompute_rounds < 0:
        parser.error(f"--recompute_rounds {opts.recompute_rounds} must be at least 0")
    try:
        settings = model_args(opts.config, {**METHOD_PRESETS.get(opts.preset, {}), **given(opts, ModelArgs)},
                              opts.n_layers)
    except ValueError as e:  # a setting's rule, or the rules joining several
        parser.exit(2, f"error: {e}\n")
    jt.set_global_seed(0)
    if opts.recompute_rounds:
        step_s = time_recompute(LLaMA_adapter(settings), opts.recompute_rounds)
        print(f"variant={settings.variant} config={opts.config} n_layers={settings.n_layers} "
              f"precision={settings.precision} rounds={opts.recompute_rounds} "
              f"kept_tok_s={TRAIN_BATCH * TRAIN_SEQ / step_s[False]:.0f} "
              f"recomputed_tok_s={TRAIN_BATCH * TRAIN_SEQ / step_s[True]:.0f} "
              f"recomputed_over_kept={step_s[False] / step_s[True]:.2f}")
        return
    # the rooflines first: their matrices then come from memory the model's run reuses, so the
    # peak RSS is the model's (measured after the model, they added up to 80 MB to it)
    roofline = sgemm_gflops()
    bf16_gflops = base_matmul_gflops()
    model = LLaMA_adapter(settings)
    first_step_s, train_s, optimizer, loss_tokens = time_training(model)
    train_tok_s = TRAIN_BATCH * TRAIN_SEQ / train_s
    decode_tok_s, decode_tokens = (0.0, 0) if opts.no_decode else time_decoding(model)
    mfu = train_flops_per_token(model, TRAIN_SEQ) * train_tok_s / 1e9 / roofline
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    onednn = os.environ.get("use_mkl", "1") == "1"
    counts, args = model.parameter_counts(), model.args
    print(f"variant={args.variant} method={args.method} config={opts.config} n_layers={args.n_layers} "
          f"precision={args.precision} "
          f"onednn={int(onednn)} train_ms={train_s * 1e3:.1f} "
          f"train_tok_s={train_tok_s:.0f} decode_tok_s={decode_tok_s:.0f} peak_rss_mb={peak_rss_mb:.0f} "
          f"mfu={mfu:.3f} sgemm_gflops={roofline:.0f} bf16_matmul_gflops={bf16_gflops:.1f} gemm_n={GEMM_SIZE} "
          f"first_step_s={first_step_s:.2f} warm_step_s={train_s:.3f} "
          f"trainable_params={counts['total']} base_params={counts['base']} "
          f"train_tokens={TRAIN_BATCH * TRAIN_SEQ} loss_tokens={loss_tokens} decode_tokens={decode_tokens} "
          f"optimizer={optimizer} lora_rank={args.lora_rank} lora_alpha={args.lora_alpha:g} "
          f"lora_targets={','.join(args.targets)}" + GPU_MEMORY.keys())


if __name__ == "__main__":
    main()
