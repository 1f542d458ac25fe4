"""LLaMA-3.1-8B, Qwen3-8B, 14B or 32B on one machine: streaming load, two training steps, adapter save, decoding.

python bench/scale.py [--arch llama31-8b|qwen3-8b|qwen3-14b|qwen3-32b] [--llama_path DIR] [--n_layers 2]
                      [--variants sparse,soft] [--precisions bf16 int8 nf4] [--checkpoint_dir DIR] [--recompute]
Without --llama_path it writes a checkpoint of random bf16 weights of the architecture's shape into a
temporary folder, tensor by tensor, and removes it at the end (--checkpoint_dir: into that folder, kept, and
reused by a later run of the same --arch and --n_layers): LLaMA-3.1-8B's params.json and one
consolidated.00.pth (Meta's layout), or Qwen3's config.json and safetensors shards of at most
4 GB with their index (Hugging Face's layout). It says the disk that takes before writing, and refuses (exit 4)
where the folder's disk has less free. Training recomputes the layers' activations in the backward where the
memory check says a step would not fit with them kept (--recompute / --no-recompute choose). For each variant (the
`math` recipe: Sparse MoA, Soft MoA with prompts on every layer): load, two AdamW steps on 1 x 300 tokens, save
the adapter, greedy-decode 16 tokens through the KV cache (after a 2-token warm-up that compiles the decode step:
`decode_step_tok_s` is the steady rate of the decode steps, `decode_tok_s` the whole timed call). The plain read
of the checkpoint is timed in the same run, each read (the plain one and every load) starting from a cold page
cache for that file (posix_fadvise DONTNEED). The base takes the math recipe's precision (bf16) unless
--precisions names one; several run one after another, each in a process of its own (peak RSS is a process's) on
the one checkpoint, and end with their ratios to the first (`<precision>_over_<first>_...`).
Several variants likewise run each in a process of its own (`<variant>_peak_rss_gb`; `peak_rss_gb` is the
largest).
Prints key=value pairs last.
"""
import argparse
import errno
import json
import math
import os
import resource
import shutil
import subprocess
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
from Models.memory import memory_parts, needs_recompute  # noqa: E402
from Models.ModelArgs import ModelArgs  # noqa: E402
from Models.formats.pth_writer import save_pth  # noqa: E402
from Models.formats.tensor_bytes import TensorSource, float32_to_bf16_bits  # noqa: E402
from Models.kernels.adamw import build_optimizer  # noqa: E402
from Models.ModelArgs import PRECISIONS  # noqa: E402
from Utils.settings import ArgumentParser, recipe_values  # noqa: E402

QWEN3 = dict(architecture="qwen3", head_dim=128, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
             tied_embeddings=False)
# LLaMA-3.1-8B's params.json (bench.py's and authors_bench.py's 8b); Qwen3-8B's and Qwen3-14B's config.json as
# ModelArgs fields
ARCHS = {
    "llama31-8b": CONFIGS["8b"],
    "qwen3-8b": dict(QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    "qwen3-14b": dict(QWEN3, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
    "qwen3-32b": dict(QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
}
WRITTEN = "random_checkpoint.json"  # {"arch", "n_layers"}: written last into a --checkpoint_dir, once complete
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
    if fields.get("architecture") == "qwen3":
        args = ModelArgs(**fields)
        write_hf_base(out_dir, args, random_sources(args, seed), max_shard_bytes=SHARD_BYTES)
        return
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump(fields, f, indent=2)
    save_pth(random_sources(ModelArgs(**fields), seed), os.path.join(out_dir, "consolidated.00.pth"))


def checkpoint_bytes(arch: str, n_layers: int) -> int:
    """The random checkpoint's tensors on disk: every one in bf16 (its headers, index and config are a few MB)."""
    shapes = meta_shapes(ModelArgs(**{**ARCHS[arch], "n_layers": n_layers}))
    return sum(2 * math.prod(shape) for shape in shapes.values())


def random_checkpoint(opts, work: str) -> str:
    """The random checkpoint's folder: --checkpoint_dir when it holds one of this --arch and --n_layers (reused), else
    written there or into `work`, once the disk is found to have the room (an OSError naming the folder if not)."""
    n_layers = opts.n_layers or ARCHS[opts.arch]["n_layers"]
    folder = opts.checkpoint_dir or os.path.join(work, "base")
    if written_checkpoint(folder) == {"arch": opts.arch, "n_layers": n_layers}:
        print(f"reusing the random checkpoint in {folder}", flush=True)
        return folder
    need = checkpoint_bytes(opts.arch, n_layers) + (64 << 20)
    existing = folder
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    print(f"the random {opts.arch} checkpoint ({n_layers} layers) takes {need / 1e9:.1f} GB of disk in {folder} "
          f"({free / 1e9:.1f} GB free there)", flush=True)
    if need > free:
        raise OSError(errno.ENOSPC, f"the random {opts.arch} checkpoint needs {need / 1e9:.1f} GB of disk, "
                                    f"{free / 1e9:.1f} GB free there: free some, or give --checkpoint_dir or --tmp_dir "
                                    "on a larger disk", folder)
    os.makedirs(folder, exist_ok=True)
    start = time.perf_counter()
    write_random_checkpoint(folder, opts.arch, n_layers)
    with open(os.path.join(folder, WRITTEN), "w") as f:
        json.dump({"arch": opts.arch, "n_layers": n_layers}, f)
    print(f"wrote the random checkpoint in {time.perf_counter() - start:.1f} s"
          f"{f' (kept: --checkpoint_dir {folder} reuses it)' if opts.checkpoint_dir else ''}", flush=True)
    return folder


def written_checkpoint(folder: str):
    """What a complete random checkpoint in `folder` was written as ({"arch", "n_layers"}), or None."""
    try:
        with open(os.path.join(folder, WRITTEN)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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


def run_variant(llama_dir: str, variant: str, out_dir: str, roofline: float, precision: str, recompute) -> dict:
    settings = {k: v for k, v in recipe_values("math", variant).items() if k in ModelArgs.__dataclass_fields__}
    args = base_args(llama_dir, **{**settings, "max_seq_len": SEQ, "max_batch_size": BATCH,
                                   **({"precision": precision} if precision else {})})
    args.recompute = needs_recompute(args, BATCH, SEQ) if recompute is None else recompute
    estimate = sum(size for _, size, _ in memory_parts(args, BATCH, SEQ, training=True)) / 1e9
    print(f"[{variant}] the memory check's estimate of a training step: {estimate:.2f} GB "
          f"(activations {'recomputed' if args.recompute else 'kept'})", flush=True)
    for path in weight_paths(llama_dir):
        drop_cached(path)
    start = time.perf_counter()
    model = build_model(llama_dir, args)
    load_s = time.perf_counter() - start
    base_gb = sum(p.nbytes for p in model.base_parameters().values()) / 1e9
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
    generate(model, no_stops, prompt, max_gen_len=2)  # compiles the decode step
    start, timings = time.perf_counter(), {}
    out = generate(model, no_stops, prompt, max_gen_len=NEW_TOKENS, timings=timings)
    decode_s = time.perf_counter() - start
    step_tok_s = timings["decode_steps"] / timings["decode_s"]
    print(f"[{variant}] decoded {len(out[0])} tokens in {decode_s:.1f} s ({step_tok_s:.2f} tokens/s in the decode "
          "steps)", flush=True)

    n_base = model.parameter_counts()["base"]  # weights, not bytes (an nf4 matrix holds two a byte)
    flops = train_flops_per_token(model, SEQ) * BATCH * SEQ
    step = min(step_s)
    result = dict(load_s=load_s, step_s=step, first_step_s=step_s[0], mfu=flops / step / 1e9 / roofline,
                  recompute=int(args.recompute), estimate_gb=estimate,
                  loss=losses[-1], save_s=save_s, decode_tok_s=len(out[0]) / decode_s, decode_step_tok_s=step_tok_s,
                  n_base=n_base,
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
        (opts.checkpoint_dir and opts.llama_path, "--checkpoint_dir keeps a random checkpoint: not with --llama_path"),
        (opts.llama_path and not any(os.path.isfile(os.path.join(opts.llama_path, f)) for f in LAYOUTS.values()),
         f"--llama_path {opts.llama_path}: neither params.json (Meta's layout) nor config.json (Hugging Face's) there"),
        (opts.tmp_dir and not (os.path.isdir(opts.tmp_dir) and os.access(opts.tmp_dir, os.W_OK)),
         f"--tmp_dir {opts.tmp_dir} is not a writable folder"),
        (opts.checkpoint_dir and os.path.exists(opts.checkpoint_dir) and (
            not os.path.isdir(opts.checkpoint_dir) or os.listdir(opts.checkpoint_dir) and not written_checkpoint(
                opts.checkpoint_dir)), f"--checkpoint_dir {opts.checkpoint_dir} holds other files than a complete "
                                       "random checkpoint: give an empty or new folder"),
        (len(set(opts.precisions or [])) < len(opts.precisions or []), f"--precisions {opts.precisions}: each once"),
        (opts.rounds < 1, f"--rounds {opts.rounds} must be at least 1")]
    problem = next((message for broken, message in problems if broken), None)
    if problem:
        parser.error(problem)


def main():
    """Exit codes: 0 done, 2 bad arguments or input, 4 the temporary checkpoint could not be written."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama31-8b", choices=list(ARCHS),
                        help="the random checkpoint's shape and layout: LLaMA-3.1-8B in Meta's, Qwen3-8B, 14B and "
                             "32B in Hugging Face's (default: llama31-8b)")
    parser.add_argument("--llama_path", help="a base folder (Meta or Hugging Face) to load instead of a random one")
    parser.add_argument("--n_layers", type=int, default=None,
                        help="layers of the random checkpoint (default: the architecture's; a quick check: 2)")
    parser.add_argument("--variants", default="sparse,soft", help="comma-separated: sparse, soft")
    parser.add_argument("--tmp_dir", default=None, help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="the base's precision (default: the math recipe's, bf16); several: each in a process "
                             "of its own, in turn, then their ratios to the first")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with several --precisions: run them in turn this many times, each figure the best of "
                             "its rounds (peak RSS the largest)")
    parser.add_argument("--checkpoint_dir", default=None,
                        help="write the random checkpoint into this folder and keep it; a later run with the same "
                             "--arch and --n_layers reuses it (default: a temporary folder, removed at the end)")
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer's activations in the backward (default: where the memory check "
                             "says a step would not fit with them kept)")
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
    llama_dir = opts.llama_path or random_checkpoint(opts, work)
    if opts.precisions and len(opts.precisions) > 1:
        return compare_precisions(opts, llama_dir, work)
    if len(opts.variants.split(",")) > 1:
        return separate_variants(opts, llama_dir, work)
    n_layers = base_args(llama_dir).n_layers
    files = weight_paths(llama_dir)
    file_gb = sum(os.path.getsize(f) for f in files) / 1e9
    read_s = sum(timed_read(f) for f in files)
    print(f"plain cold read of {file_gb:.2f} GB: {read_s:.1f} s", flush=True)
    roofline = sgemm_gflops()
    precision = opts.precisions[0] if opts.precisions else None
    results = {v: run_variant(llama_dir, v, work, roofline, precision, opts.recompute)
               for v in opts.variants.split(",")}
    peak = peak_rss_gb()
    n_base = next(iter(results.values()))["n_base"]
    line = {"base": opts.llama_path or opts.arch, "precision": precision or recipe_values("math")["precision"],
            "n_layers": n_layers, "file_gb": f"{file_gb:.2f}",
            "read_s": f"{read_s:.1f}", "sgemm_gflops": f"{roofline:.0f}", "peak_rss_gb": f"{peak:.2f}",
            "bytes_per_base_param": f"{peak * 1e9 / n_base:.2f}", "n_base": n_base}
    for variant, r in results.items():
        line.update({f"{variant}_{k}": (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items() if k != "n_base"})
        line[f"{variant}_load_over_read"] = f"{r['load_s'] / read_s:.2f}"
    print(" ".join(f"{k}={v}" for k, v in line.items()))


def child_line(llama_dir: str, work: str, precision, variants: str, recompute) -> dict:
    """This script on the checkpoint at llama_dir in a process of its own (one precision, `variants`): its
    output printed, its key=value line returned."""
    command = [sys.executable, os.path.abspath(__file__), "--llama_path", llama_dir, "--variants", variants,
               "--tmp_dir", work] + (["--precisions", precision] if precision else []) + (
        [] if recompute is None else ["--recompute" if recompute else "--no-recompute"])
    print(f"[{precision or 'recipe'} {variants}] {' '.join(command[1:])}", flush=True)
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    print(run.stdout, end="", flush=True)
    if run.returncode != 0:
        sys.exit(f"error: the {precision or ''} {variants} run ended with exit code {run.returncode}")
    return dict(item.split("=", 1) for item in run.stdout.strip().splitlines()[-1].split())


def separate_variants(opts, llama_dir: str, work: str):
    """Each variant in a process of its own, so that each peak RSS is its own (a process's peak keeps the
    largest of what ran in it); one key=value line: the first run's shared figures, each variant's own, its
    peak among them, and the largest peak as the run's."""
    precision = opts.precisions[0] if opts.precisions else None
    lines = {v: child_line(llama_dir, work, precision, v, opts.recompute) for v in opts.variants.split(",")}
    joined = {k: v for k, v in next(iter(lines.values())).items() if not k.startswith(tuple(lines))}
    joined["base"] = opts.llama_path or opts.arch
    for variant, line in lines.items():
        joined.update({k: v for k, v in line.items() if k.startswith(f"{variant}_")})
        joined[f"{variant}_peak_rss_gb"] = line["peak_rss_gb"]
        joined[f"{variant}_bytes_per_base_param"] = line["bytes_per_base_param"]
    peak = max(float(line["peak_rss_gb"]) for line in lines.values())
    joined.update(peak_rss_gb=f"{peak:.2f}", bytes_per_base_param=f"{peak * 1e9 / float(joined['n_base']):.2f}")
    print(" ".join(f"{k}={v}" for k, v in joined.items()))


# figures of each variant compared across precisions, and whether more of it is better (for the best of rounds)
COMPARED = {"load_s": False, "step_s": False, "decode_tok_s": True, "decode_step_tok_s": True}


def compare_precisions(opts, llama_dir: str, work: str):
    """Each precision in a process of its own on the checkpoint at llama_dir, --rounds times in turn; their
    key=value lines joined (keys prefixed with the precision) with the ratios to the first precision."""
    best = {}
    for _ in range(opts.rounds):
        for precision in opts.precisions:
            line = child_line(llama_dir, work, precision, opts.variants, opts.recompute)
            kept = best.setdefault(precision, line)
            for key, value in line.items():
                figure = key.split("_", 1)[-1]
                if key == "peak_rss_gb" or figure in COMPARED:
                    more = key == "peak_rss_gb" or COMPARED[figure]
                    kept[key] = str(max(float(value), float(kept[key])) if more else min(float(value), float(kept[key])))
    for line in best.values():
        line["bytes_per_base_param"] = float(line["peak_rss_gb"]) * 1e9 / float(line["n_base"])
    first = opts.precisions[0]
    keys = ["peak_rss_gb", "bytes_per_base_param"] + [f"{v}_{figure}" for v in opts.variants.split(",")
                                                      for figure in COMPARED]
    joined = {"base": opts.llama_path or opts.arch, "n_layers": best[first]["n_layers"], "rounds": opts.rounds}
    for precision in opts.precisions:
        joined.update({f"{precision}_{key}": f"{float(best[precision][key]):.3g}" for key in keys})
    for precision in opts.precisions[1:]:
        joined.update({f"{precision}_over_{first}_{key}": f"{float(best[precision][key]) / float(best[first][key]):.2f}"
                       for key in keys if key != "bytes_per_base_param"})
    print(" ".join(f"{k}={v}" for k, v in joined.items()))


if __name__ == "__main__":
    main()
