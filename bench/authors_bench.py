"""The authors' PyTorch MoA code (DCDmllm/MoA) timed on a GPU, or the CPU, as bench/bench.py times ours.

    python bench/authors_bench.py --device cuda --variant sparse --config medium --precision bf16
    python bench/authors_bench.py --device cuda --variant soft --config 8b --n_layers 8 --precision bf16

It runs ../shared/ref/ref_bench.py's measurement through its own functions (imported, with
../shared/ref/moa_ref_loader.py): their LLaMA_adapter.forward + backward + AdamW over their trainable
set (batch 8 x 256, median of 5 steps after 2), then their generate_time greedy on their KV cache
(batch 4, 32-token prompts, 64 new tokens, median of 3 after 1); decode_tok_s = 4 x 63 / their
post-prefill time, as ref_bench.py reports it. Nothing of theirs is stored in this project: their files
are read at run time from $MOA_MIRROR (a bare git dir), or where that is absent from the tar.gz that
scripts/carry_authors.sh writes into .gpu/ref/ (with copies of ../shared/ref's two files, for a GPU
machine that has neither).

--device cuda keeps their CUDA code as it is: .cuda(), torch.cuda.amp.autocast in generate_time (fp16
when bf16 is off, as their code does) and, for bf16, their engine_finetune step: the base built in bf16
on the GPU, adapters in fp32 (their get_trainable_params), the forward in cuda autocast bf16 and the
step through their NativeScalerWithGradNormCount. Only flash_attn, fairscale, transformers.utils and the
tokenizer are stubbed, as on the CPU. --device cpu is ref_bench.py's CPU path (their CUDA calls patched
away, 2 threads). Timers wait for the GPU: their generate_time reads time.time(), which here waits for
the device first.
Last line: key=value (variant config n_layers device precision train_ms train_tok_s decode_tok_s
end_to_end_tok_s peak_rss_mb, on a GPU torch_reserved_mb torch_allocated_mb (torch's allocator) and
peak_gpu_mb (the process, as bench.py measures ours), the parameter counts and the step-0 loss).
"""
import argparse
import contextlib
import os
import resource
import statistics
import sys
import tarfile
import time
import types
import warnings

from common import (CONFIGS, DECODE_BATCH, DECODE_RUNS, NEW_TOKENS, PROMPT_LEN, TIMED_STEPS, TRAIN_BATCH, TRAIN_SEQ,
                    WARMUP_STEPS, GpuMemoryPeak, authors_source, fail, reference_dir)  # bench/common.py


def parse_options():
    """Bad arguments: one `error:` line, exit 2, before torch is imported (the project's venv has none)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--variant", choices=["sparse", "soft"], default="sparse")
    parser.add_argument("--config", choices=list(CONFIGS), default="small", help="bench/common.py's shapes")
    parser.add_argument("--n_layers", type=int, help="the model's depth (default: the config's)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.error = fail
    opts = parser.parse_args()
    if opts.n_layers is not None and opts.n_layers < 1:
        fail(f"--n_layers {opts.n_layers} must be at least 1")
    if reference_dir() is None:
        fail("neither ../shared/ref (or $MOA_SHARED/ref) nor the carried .gpu/ref has ref_bench.py: "
             "run scripts/carry_authors.sh where ../shared exists")
    if authors_source() is None:
        fail("the authors' code is nowhere: set MOA_MIRROR to the bare git dir of DCDmllm/MoA, or carry "
             ".gpu/ref/authors.tar.gz (scripts/carry_authors.sh)")
    return opts


def read_from_archive(loader, archive: str):
    """The loader reads their files with `git show` from a mirror; point it at the carried tar.gz
    (git archive's output: the same paths, the commit id in its header) instead."""
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read().decode("utf-8") for m in tar.getmembers() if m.isfile()}
        commit = tar.pax_headers.get("comment", "unknown")

    def git_show(path):
        if path not in files:
            raise FileNotFoundError(f"{path} is not in {archive} (rerun scripts/carry_authors.sh)")
        return files[path]
    loader.git_show = git_show
    loader.mirror_commit = lambda: commit


def synced_clock(torch):
    """time.time() after the GPU has finished what was queued: CUDA runs asynchronously, so their
    generate_time's own timer would read when work was queued, not when it was done."""
    def now():
        torch.cuda.synchronize()
        return time.time()
    return types.SimpleNamespace(time=now)


def build(torch, L, RB, opts, kw):
    """Their model as LLaMA_adapter.__init__ builds it: on the GPU under torch.set_default_device('cuda')
    and (bf16) default dtype bf16, then their get_trainable_params(); fp32 is ref_bench.py's fp32 model."""
    with torch.device(opts.device):
        if opts.precision == "bf16":
            margs, model = RB.bf16_build(opts.variant, kw)
        else:
            margs = L.make_model_args(opts.variant, **kw)
            model = L.build_adapter_model(opts.variant, margs).float()
    return margs, model.to(opts.device)


def train(torch, L, RB, opts, model, margs, sync):
    """(median step s, step-0 loss, the steps' ms, the sparse threshold's selected fraction at the start)."""
    _, _, misc = L.load_official(opts.variant)
    bf16 = opts.precision == "bf16"
    g = torch.Generator().manual_seed(opts.seed + 1)
    tokens = torch.randint(1, margs.vocab_size, (TRAIN_BATCH, TRAIN_SEQ), generator=g).to(opts.device)
    labels = tokens.clone()
    model.train(True)
    optimizer = torch.optim.AdamW(misc.add_weight_decay(model, 0.05), lr=1e-3, betas=(0.9, 0.95))
    if bf16:  # engine_finetune: autocast(bf16) forward, their scaler's backward and step
        scaler = misc.NativeScalerWithGradNormCount() if opts.device == "cuda" else RB.official_loss_scaler(misc)
        autocast = lambda: torch.autocast(opts.device, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    with autocast():
        selected = RB.selected_fraction(model, opts.variant, tokens)
    times, losses = [], []
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        sync()
        start = time.perf_counter()
        with autocast():
            c_loss, m_loss = model(tokens, labels, None)
        loss = c_loss + m_loss * 0  # as engine_finetune
        if bf16:
            loss.item()
            scaler(loss, optimizer, parameters=model.parameters(), update_grad=True)
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(c_loss.detach()))
    return statistics.median(times[WARMUP_STEPS:]), losses[0], times, selected


def decode(torch, opts, model, margs):
    """(their post-prefill decode tokens/s, end-to-end tokens/s with the prefill), medians of DECODE_RUNS."""
    model.eval()  # their Attention.train(False) allocates the KV cache
    g = torch.Generator().manual_seed(opts.seed + 2)
    prompts = torch.randint(1, margs.vocab_size, (DECODE_BATCH, PROMPT_LEN), generator=g).tolist()
    post_prefill, end_to_end = [], []
    for run in range(1 + DECODE_RUNS):
        out, cost = model.generate_time(prompts, max_gen_len=NEW_TOKENS, temperature=0, time_gen=True)
        assert all(len(o) == NEW_TOKENS for o in out), [len(o) for o in out]
        if run:
            post_prefill.append(DECODE_BATCH * (NEW_TOKENS - 1) / cost["inference_cost"])
            end_to_end.append(DECODE_BATCH * NEW_TOKENS / cost["all_cost"])
    return statistics.median(post_prefill), statistics.median(end_to_end)


def main():
    """Exit codes: 0 done, 2 bad arguments or no CUDA device."""
    opts = parse_options()
    gpu_memory = GpuMemoryPeak().start() if opts.device == "cuda" else None  # before torch opens the device
    sys.path.insert(0, reference_dir())
    sys.dont_write_bytecode = True
    try:
        import torch
    except ImportError:
        fail(f"{sys.executable} has no torch: run this with the reference venv's python (../shared/ref/README.md) "
             "or, on a GPU machine, the image's python3")
    import moa_ref_loader as L  # ../shared/ref (or the carried copy)
    import ref_bench as RB
    source = authors_source()
    if not os.path.isdir(source):
        read_from_archive(L, source)
    shape = {**CONFIGS[opts.config], **({"n_layers": opts.n_layers} if opts.n_layers else {})}
    if opts.config in RB.CONFIGS and RB.CONFIGS[opts.config] != CONFIGS[opts.config]:
        fail(f"--config {opts.config}: ref_bench.py's shape {RB.CONFIGS[opts.config]} is not bench/common.py's")
    RB.CONFIGS[opts.config] = shape  # ref_bench.bench_args reads the shape (and its depth) from here
    kw = RB.bench_args(opts.variant, opts.config)
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda: torch sees no CUDA device")
        L._CPU_PATCHED = True  # keep their .cuda() and cuda autocast: the loader's CPU patches never run
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.cuda.amp.*")
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(2)
        sync = lambda: None  # noqa: E731
    torch.manual_seed(opts.seed)
    margs, model = build(torch, L, RB, opts, kw)
    if opts.device == "cpu" and opts.precision == "bf16":
        RB.install_cpu_bf16_autocast()  # their generate_time's cuda autocast(bf16) as CPU autocast
    if opts.device == "cuda":
        _, adapter_module, _ = L.load_official(opts.variant)
        adapter_module.time = synced_clock(torch)
    n_all = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    device_name = (f"{torch.cuda.get_device_name()} (fp32 matmul tf32={torch.backends.cuda.matmul.allow_tf32})"
                   if opts.device == "cuda" else "cpu")
    print(f"[setup] {device_name} torch={torch.__version__} "
          f"params total={n_all / 1e6:.2f}M trainable={n_trainable / 1e6:.3f}M "
          f"ffn_hidden={model.llama.layers[0].feed_forward.w1.out_features} dtypes: {RB.dtype_summary(model)}",
          flush=True)

    train_s, loss0, times, selected = train(torch, L, RB, opts, model, margs, sync)
    print(f"[train] step_ms={[round(t * 1e3, 1) for t in times]} loss first={loss0:.4f}"
          + (f" sparse_selected_frac={selected:.3f}" if selected is not None else ""), flush=True)
    decode_tok_s, end_to_end_tok_s = decode(torch, opts, model, margs)
    decode_autocast = "bfloat16" if margs.bf16 else "float16" if opts.device == "cuda" else "none"
    line = (f"variant={opts.variant} config={opts.config} n_layers={margs.n_layers} device={opts.device} "
            f"precision={opts.precision} train_ms={train_s * 1e3:.1f} "
            f"train_tok_s={TRAIN_BATCH * TRAIN_SEQ / train_s:.1f} decode_tok_s={decode_tok_s:.1f} "
            f"end_to_end_tok_s={end_to_end_tok_s:.1f} decode_autocast={decode_autocast} "
            f"peak_rss_mb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}")
    if opts.device == "cuda":
        line += (f" torch_reserved_mb={torch.cuda.max_memory_reserved() / 2 ** 20:.0f}"
                 f" torch_allocated_mb={torch.cuda.max_memory_allocated() / 2 ** 20:.0f}" + gpu_memory.keys())
    print(line + f" trainable_params={n_trainable} base_params={n_all - n_trainable} loss0={loss0:.4f} "
          f"authors={L.mirror_commit()[:10]}")


if __name__ == "__main__":
    main()
