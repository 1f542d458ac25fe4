"""LLaMA-3.1-8B (or Qwen3-8B) on one machine: streaming load, two training steps, adapter save, decoding.

python bench/scale.py [--arch llama31-8b|qwen3-8b] [--llama_path DIR] [--n_layers 2] [--variants sparse,soft]
Without --llama_path it writes a checkpoint of random bf16 weights of the architecture's shape into a
temporary folder, tensor by tensor, and removes it at the end: LLaMA-3.1-8B's params.json and one
consolidated.00.pth (Meta's layout), or Qwen3-8B's config.json and safetensors shards of at most
4 GB with their index (Hugging Face's layout). For each variant (the `math` recipe: Sparse MoA, Soft MoA with
prompts on every layer): load, two AdamW steps on 1 x 300 tokens, save the
adapter, greedy-decode 16 tokens through the KV cache. The plain read of the
checkpoint is timed in the same run, each read (the plain one and every load)
starting from a cold page cache for that file (posix_fadvise DONTNEED).
Prints key=value pairs last.
"""
import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401
import jittor as jt  # noqa: E402

from bench import sgemm_gflops, train_flops_per_token  # noqa: E402  (bench/bench.py, beside this script)
from common import CONFIGS  # noqa: E402  (bench/common.py)
from Models.formats.adapters import save_adapter  # noqa: E402
from Models.formats.base_model import LAYOUTS, base_args, build_model, weight_paths  # noqa: E402
from Models.formats.hf import write_hf_base  # noqa: E402
from Models.formats.meta import meta_shapes  # noqa: E402
from Models.generate import generate  # noqa: E402
from Models.ModelArgs import ModelArgs  # noqa: E402
from Models.formats.pth import TensorSource, float32_to_bf16_bits, save_pth  # noqa: E402
from Models.kernels.adamw import build_optimizer  # noqa: E402
from Utils.settings import ArgumentParser, recipe_values  # noqa: E402

# LLaMA-3.1-8B's params.json (bench.py's and authors_bench.py's 8b); Qwen3-8B's config.json as ModelArgs fields
ARCHS = {
    "llama31-8b": CONFIGS["8b"],
    "qwen3-8b": dict(architecture="qwen3", dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     ffn_dim=12288, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
                     tied_embeddings=False),
}
SHARD_BYTES = 4 << 30  # the safetensors shards' largest size (Qwen3-8B's hub files are 4-5 GB)
BATCH, SEQ, STEPS, PROMPT_LEN, NEW_TOKENS = 1, 300, 2, 16, 16
BF16_ONE = 0x3F80


def random_sources(args: ModelArgs, seed: int) -> dict:
    """Meta-named bf16 TensorSources of the base's shapes (meta_shapes), made as each is written.
    Matrices tile a pool of 2^20 N(0, 0.02^2) values from a random start each (drawing 8e9 normals
    would take longer than the benchmark; speed and memory do not depend on the values); norms are 1."""
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32)
    pool = np.tile(float32_to_bf16_bits(pool), 2)

    def make(shape):
        if len(shape) == 1:
            return lambda: np.full(shape, BF16_ONE, np.uint16)
        start = int(rng.integers(0, 1 << 20))
        return lambda: np.resize(pool[start:start + (1 << 20)], shape)
    return {name: TensorSource(shape, "bfloat16", make(shape)) for name, shape in meta_shapes(args).items()}


def write_random_checkpoint(out_dir: str, arch: str, n_layers: int, seed: int = 0):
    """A random bf16 checkpoint of the architecture's shape, written one tensor at a time: Meta's
    params.json + consolidated.00.pth, or Hugging Face's config.json + safetensors shards."""
    fields = {**ARCHS[arch], "n_layers": n_layers}
    if arch == "qwen3-8b":
        args = ModelArgs(**fields)
        write_hf_base(out_dir, args, random_sources(args, seed), max_shard_bytes=SHARD_BYTES)
        return
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump(fields, f, indent=2)
    save_pth(random_sources(ModelArgs(**fields), seed), os.path.join(out_dir, "consolidated.00.pth"))


def drop_cached(path: str):
    """Evict a file's pages from the page cache (clean pages only: the file was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_read(path: str) -> float:
    """Seconds to read the file once, cold, in 16 MB blocks into one buffer (what `cat > /dev/null` does)."""
    drop_cached(path)
    buffer = bytearray(16 << 20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def run_variant(llama_dir: str, variant: str, out_dir: str, roofline: float) -> dict:
    settings = {k: v for k, v in recipe_values("math", variant).items() if k in ModelArgs.__dataclass_fields__}
    args = base_args(llama_dir, **{**settings, "max_seq_len": SEQ, "max_batch_size": BATCH})
    for path in weight_paths(llama_dir):
        drop_cached(path)
    start = time.perf_counter()
    model = build_model(llama_dir, args)
    load_s = time.perf_counter() - start
    base_gb = sum(int(np.prod(p.shape)) * (2 if p.dtype == "bfloat16" else 4)
                  for p in model.base_parameters().values()) / 1e9
    print(f"[{variant}] loaded in {load_s:.1f} s, peak RSS {peak_rss_gb():.2f} GB (the base's tensors: "
          f"{base_gb:.2f} GB)", flush=True)

    rng = np.random.default_rng(0)
    optimizer = build_optimizer(model, lr=6e-3, weight_decay=0.02)  # Math.py's, the math recipe's decay
    mask = jt.ones((BATCH, SEQ))
    step_s, losses = [], []
    for step in range(STEPS):
        tokens = jt.array(rng.integers(0, args.vocab_size, (BATCH, SEQ)).astype(np.int32))
        start = time.perf_counter()
        loss, _ = model(tokens, mask, with_logits=False)
        optimizer.step(loss)
        losses.append(float(loss.item()))
        jt.sync_all()
        step_s.append(time.perf_counter() - start)
        print(f"[{variant}] step {step}: {step_s[-1]:.1f} s, loss {losses[-1]:.4f}, "
              f"peak RSS {peak_rss_gb():.2f} GB", flush=True)
    start = time.perf_counter()
    save_adapter(model, os.path.join(out_dir, f"adapter-{variant}"))
    save_s = time.perf_counter() - start

    model.eval()
    prompt = [list(rng.integers(1, args.vocab_size, PROMPT_LEN))]
    no_stops = SimpleNamespace(stop_tokens=set(), n_words=args.vocab_size)
    start = time.perf_counter()
    out = generate(model, no_stops, prompt, max_gen_len=NEW_TOKENS)
    decode_s = time.perf_counter() - start
    print(f"[{variant}] decoded {len(out[0])} tokens in {decode_s:.1f} s", flush=True)

    n_base = sum(int(np.prod(p.shape)) for p in model.base_parameters().values())
    flops = train_flops_per_token(model, SEQ) * BATCH * SEQ
    step = min(step_s)
    result = dict(load_s=load_s, step_s=step, first_step_s=step_s[0], mfu=flops / step / 1e9 / roofline,
                  loss=losses[-1], save_s=save_s, decode_tok_s=len(out[0]) / decode_s, n_base=n_base,
                  n_adapter=sum(int(np.prod(p.shape)) for p in model.adapter_parameters().values()))
    del model, optimizer, loss
    jt.sync_all()
    jt.gc()
    return result


def check_options(parser, opts):
    """Bad arguments: one `error:` line, exit 2, before anything is written."""
    unknown = [v for v in opts.variants.split(",") if v not in ("sparse", "soft")]
    problems = [
        (opts.n_layers is not None and opts.n_layers < 1, f"--n_layers {opts.n_layers} must be at least 1"),
        (bool(unknown), f"--variants: unknown {unknown}; choose from sparse, soft"),
        (opts.llama_path and not any(os.path.isfile(os.path.join(opts.llama_path, f)) for f in LAYOUTS.values()),
         f"--llama_path {opts.llama_path}: neither params.json (Meta's layout) nor config.json (Hugging Face's) there"),
        (opts.tmp_dir and not (os.path.isdir(opts.tmp_dir) and os.access(opts.tmp_dir, os.W_OK)),
         f"--tmp_dir {opts.tmp_dir} is not a writable folder")]
    problem = next((message for broken, message in problems if broken), None)
    if problem:
        parser.error(problem)


def main():
    """Exit codes: 0 done, 2 bad arguments or input, 4 the temporary checkpoint could not be written."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama31-8b", choices=list(ARCHS),
                        help="the random checkpoint's shape and layout: LLaMA-3.1-8B in Meta's, Qwen3-8B in "
                             "Hugging Face's (default: llama31-8b)")
    parser.add_argument("--llama_path", help="a base folder (Meta or Hugging Face) to load instead of a random one")
    parser.add_argument("--n_layers", type=int, default=None,
                        help="layers of the random checkpoint (default: the architecture's; a quick check: 2)")
    parser.add_argument("--variants", default="sparse,soft", help="comma-separated: sparse, soft")
    parser.add_argument("--tmp_dir", default=None, help="where the temporary folder goes (default: the system's)")
    opts = parser.parse_args()
    check_options(parser, opts)
    jt.set_global_seed(0)
    work = tempfile.mkdtemp(prefix="moa-scale-", dir=opts.tmp_dir)
    try:
        return measure(opts, work)
    except ValueError as e:  # a base that does not load (CheckpointError), a bad params.json or config.json
        parser.exit(2, f"error: {e}\n")
    except OSError as e:
        parser.exit(4, f"error: cannot write {e.filename or work}: {e.strerror or e}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(opts, work: str):
    """The measurements, printed as one key=value line."""
    llama_dir = opts.llama_path
    if llama_dir is None:
        llama_dir = os.path.join(work, "base")
        os.makedirs(llama_dir)
        start = time.perf_counter()
        write_random_checkpoint(llama_dir, opts.arch, opts.n_layers or ARCHS[opts.arch]["n_layers"])
        print(f"wrote the random checkpoint in {time.perf_counter() - start:.1f} s", flush=True)
    n_layers = base_args(llama_dir).n_layers
    files = weight_paths(llama_dir)
    file_gb = sum(os.path.getsize(f) for f in files) / 1e9
    read_s = sum(timed_read(f) for f in files)
    print(f"plain cold read of {file_gb:.2f} GB: {read_s:.1f} s", flush=True)
    roofline = sgemm_gflops()
    results = {v: run_variant(llama_dir, v, work, roofline) for v in opts.variants.split(",")}
    peak = peak_rss_gb()
    n_base = next(iter(results.values()))["n_base"]
    line = {"base": opts.llama_path or opts.arch, "n_layers": n_layers, "file_gb": f"{file_gb:.2f}",
            "read_s": f"{read_s:.1f}", "sgemm_gflops": f"{roofline:.0f}", "peak_rss_gb": f"{peak:.2f}",
            "bytes_per_base_param": f"{peak * 1e9 / n_base:.2f}", "n_base": n_base}
    for variant, r in results.items():
        line.update({f"{variant}_{k}": (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items() if k != "n_base"})
        line[f"{variant}_load_over_read"] = f"{r['load_s'] / read_s:.2f}"
    print(" ".join(f"{k}={v}" for k, v in line.items()))


if __name__ == "__main__":
    main()
