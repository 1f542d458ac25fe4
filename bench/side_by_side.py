"""Our speed beside a reference on torch, each pair measured one right after the other in one run.

    export REFVENV=~/.venvs/moa-ref              # python venv with torch (see ../shared/ref/README.md)
    export MOA_MIRROR=/path/to/DCDmllm+MoA/repo  # --against authors: bare git dir of the authors' repository
    ~/.venvs/moa-jittor/bin/python bench/side_by_side.py [--against authors|peft] [--precisions fp32 bf16]
        [--configs small medium]
    # on a GPU machine: REFPYTHON is a python with torch (the image's python3); without ../shared and the
    # mirror, the authors' side reads .gpu/ref/ (scripts/carry_authors.sh writes it here; carry it there)
    REFPYTHON=python3 python3 bench/side_by_side.py --device cuda [--configs small medium 8b --n_layers 8]

--against authors (the default): for every precision x configuration x variant it runs
../shared/ref/ref_bench.py (the authors' code, 2 threads) and then bench/bench.py (ours) on the
same configuration.
--against peft: for every precision x configuration it runs bench/peft_bench.py (plain LoRA with
Hugging Face peft on transformers, 2 threads; REFVENV needs transformers and peft) and then
bench/bench.py --preset lora (our plain LoRA: the same targets, rank and alpha, no prompt, parallel
adapter or router). It first checks that both did the same work: equal trainable and base parameter
counts, training, loss-target and decoded token counts, LoRA rank, alpha and targets, and optimizer
(AdamW over the same number of elements with the same lr, betas, eps and decay); a pair that
differs fails (exit 1) and gets no ratios.
--device cuda (--against authors): bench/authors_bench.py runs the authors' code on the GPU with their own
CUDA calls and autocast, and ours runs with use_cuda=1; --configs may add 8b (LLaMA-3.1-8B's shape, its
depth --n_layers, default 32); the peak GPU memory of each process (peak_gpu_mb, as the driver counts it)
joins the figures. The --device cpu side (the default) is ../shared/ref/ref_bench.py, small and medium.
Either way it prints both figures and ours/theirs: training tokens/s, decoding tokens/s, peak
RSS. Then, on the CPU, the GEMM roofline: our bf16 base matmul (fp32 activations x bf16 weights) against
torch's bf16 GEMM, both n^3 products timed in this run. Then a markdown table for the README, and
last one key=value line: each pair's ratios (PRECISION_CONFIG_METHOD_train_x, _decode_x, _rss_x, and on
the GPU _gpu_x), their extremes (train_x_min, decode_x_min, rss_x_max, gpu_x_max) and failed (pairs that
failed).

Runtime: about 3 minutes for all sixteen pairs against the authors on a 2-core AMD EPYC with bf16
units (avx512_bf16). Without bf16 units the authors' bf16 autocast has no fast CPU kernels: on such
a 2-core EPYC fp32 took about 15 min and bf16 about 1 h 45 min (6 min per small pair, 40 per
medium); `--precisions fp32` or `--configs small` run a part.
"""
import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import time

from common import CONFIGS, REPO, authors_source, fail, reference_dir  # bench/common.py

BENCH = os.path.join(REPO, "bench")
# what both sides of --against peft print and must agree on
SAME_WORK = ("trainable_params", "base_params", "train_tokens", "loss_tokens", "decode_tokens", "optimizer",
             "lora_rank", "lora_alpha", "lora_targets")


def reference_python(against: str, device: str) -> str:
    """The reference side's python: $REFPYTHON, else $REFVENV's; failing where what that side reads is absent."""
    venv, mirror, python = os.environ.get("REFVENV"), os.environ.get("MOA_MIRROR"), os.environ.get("REFPYTHON")
    if python:
        if not shutil.which(python):
            fail(f"REFPYTHON={python!r} is not a python executable")
    elif not venv or not os.path.isfile(os.path.join(venv, "bin", "python")):
        fail("set REFVENV to the reference venv with torch (e.g. ~/.venvs/moa-ref; ../shared/ref/README.md "
             f"says how to make it), or REFPYTHON to a python with torch; got REFVENV={venv!r}")
    else:
        python = os.path.join(venv, "bin", "python")
    if against == "peft":
        if subprocess.run([python, "-c", "import transformers, peft"], capture_output=True).returncode:
            fail(f"REFVENV={venv} lacks transformers or peft: {python} -m pip install transformers safetensors "
                 "tokenizers peft (after torch, see ../shared/ref/README.md)")
        return python
    if device == "cuda":
        if reference_dir() is None or authors_source() is None:
            fail("the authors' side needs ../shared/ref and MOA_MIRROR, or the carried .gpu/ref/ "
                 "(run scripts/carry_authors.sh where they exist, and carry .gpu/ref with the run)")
        return python
    if not mirror or not os.path.isdir(mirror):
        fail(f"set MOA_MIRROR to the bare git dir of the authors' repository (DCDmllm/MoA); got {mirror!r}")
    if reference_dir() is None:
        fail("../shared/ref/ref_bench.py is missing (set MOA_SHARED to the shared folder)")
    return python


def pair_commands(against: str, ref_python: str, precision: str, config: str, method: str, device: str = "cpu",
                  n_layers: int = None) -> tuple:
    """(theirs, ours): the two command lines of one pair; `n_layers` is the 8b shape's depth."""
    depth = ["--n_layers", str(n_layers)] if config == "8b" and n_layers else []
    ours = [sys.executable, os.path.join(BENCH, "bench.py"), "--config", config, "--precision", precision] + depth
    if against == "peft":
        return ([ref_python, os.path.join(BENCH, "peft_bench.py"), "--config", config, "--precision", precision],
                ours + ["--preset", method])
    if device == "cuda":
        return ([ref_python, os.path.join(BENCH, "authors_bench.py"), "--device", "cuda", "--variant", method,
                 "--config", config, "--precision", precision] + depth, ours + ["--variant", method])
    theirs = [ref_python, os.path.join(reference_dir(), "ref_bench.py"), "--variant", method, "--config", config]
    return theirs + (["--precision", "bf16"] if precision == "bf16" else []), ours + ["--variant", method]


def same_work(theirs: dict, ours: dict) -> tuple:
    """(the SAME_WORK keys on which the two sides differ, a line with theirs, and ours where it differs)."""
    differs = [key for key in SAME_WORK if theirs.get(key) != ours.get(key)]
    cells = [f"{key}={theirs.get(key, '-')}" + (f"|ours:{ours.get(key, '-')}" if key in differs else "")
             for key in SAME_WORK]
    return differs, ("same work: " if not differs else f"DIFFERENT WORK ({', '.join(differs)}): ") + " ".join(cells)


def run(command: list, env: dict = None) -> dict:
    """Run a benchmark; its last line with train_tok_s= as a dict (strings), or {'error': tail}."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if "=" in line and ("train_tok_s=" in line or
                                                                         "torch_bf16_gflops=" in line)]
    if done.returncode or not lines:
        tail = (done.stdout + done.stderr).strip().splitlines()[-8:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = dict(item.split("=", 1) for item in lines[-1].split())
    result["wall_s"] = f"{time.perf_counter() - start:.0f}"
    return result


def ratio(ours: dict, theirs: dict, key: str) -> str:
    try:
        return f"{float(ours[key]) / float(theirs[key]):.2f}x"
    except (KeyError, ValueError, ZeroDivisionError):
        return "-"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    units = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name.group(1) if name else 'unknown CPU'}, {os.cpu_count()} cores, {' '.join(units) or 'no AVX-512/bf16 flags'}"


def gpu_model() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    return done.stdout.strip().replace("\n", "; ") if done and not done.returncode else "no GPU seen by nvidia-smi"


def parse_options():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", choices=["authors", "peft"], default="authors",
                        help="the authors' MoA code, or plain LoRA with peft on transformers")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: both sides on the GPU (the authors' side through bench/authors_bench.py)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["small", "medium"],
                        help="bench/common.py's shapes; 8b on the GPU only")
    parser.add_argument("--n_layers", type=int, help="--device cuda: the 8b shape's depth (default: 32)")
    parser.add_argument("--variants", nargs="+", choices=["sparse", "soft"],
                        help="--against authors: the MoA variants (default: sparse soft)")
    parser.error = fail  # the project's contract: one `error:` line, exit 2 (no Jittor here: it would catch SIGCHLD)
    opts = parser.parse_args()
    if opts.against == "peft" and opts.variants:
        fail("--variants picks the authors' MoA variants; --against peft compares plain LoRA only")
    if opts.against == "peft" and opts.device == "cuda":
        fail("--device cuda runs the authors' code; --against peft runs on the CPU only")
    if opts.device == "cpu" and ("8b" in opts.configs or opts.n_layers is not None):
        fail("--configs 8b and --n_layers are for --device cuda (../shared/ref/ref_bench.py has small and medium)")
    if opts.n_layers is not None and (opts.n_layers < 1 or "8b" not in opts.configs):
        fail(f"--n_layers {opts.n_layers}: the 8b shape's depth, at least 1, with --configs ... 8b")
    return opts


def print_table(opts, rows) -> tuple:
    """The markdown table of every pair; (pairs that failed, each pair's ratios by key)."""
    figures = [("train_tok_s", "train tok/s", "train_x"), ("decode_tok_s", "decode tok/s", "decode_x"),
               ("peak_rss_mb", "peak RSS MB", "rss_x")]
    if opts.device == "cuda":
        figures.append(("peak_gpu_mb", "peak GPU MB", "gpu_x"))
    label = "variant" if opts.against == "authors" else "method"
    columns = " | ".join(f"{title} theirs | ours | ratio" for _, title, _ in figures)
    print(f"\n| precision | config | {label} | {columns} |")
    print("| --- " * (3 + 3 * len(figures)) + "|")
    failed, summary = 0, {}
    for precision, config, method, theirs, ours in rows:
        failed += "error" in theirs or "error" in ours
        cells = [precision, config, method]
        for key, _, short in figures:
            cells += [theirs.get(key, "failed"), ours.get(key, "failed"), ratio(ours, theirs, key)]
            summary[f"{precision}_{config}_{method}_{short}"] = cells[-1].rstrip("x")
        print("| " + " | ".join(cells) + " |")
    return failed, summary


def print_gemm(torch_gemm: dict, gemm_n: str, bf16_rates: list) -> int:
    """Our bf16 base matmul against torch's on the CPU; 1 where torch's GEMM failed."""
    if "error" in torch_gemm:
        print(f"\ntorch GEMM failed: {torch_gemm['error']}")
        return 1
    if bf16_rates:
        ours_rate = sorted(bf16_rates)[len(bf16_rates) // 2]
        torch_rate = float(torch_gemm["torch_bf16_gflops"])
        print(f"\nGEMM {gemm_n}^3 in this run: our bf16 base matmul {ours_rate:.1f} GFLOP/s (median of our runs), "
              f"torch bf16 {torch_rate:.1f} GFLOP/s (torch {torch_gemm['torch']}, {torch_gemm['cpu_capability']}): "
              f"{ours_rate / torch_rate:.2f}x; torch fp32 {torch_gemm['torch_fp32_gflops']} GFLOP/s")
    return 0


def main():
    opts = parse_options()
    methods = ["lora"] if opts.against == "peft" else opts.variants or ["sparse", "soft"]
    ref_python = reference_python(opts.against, opts.device)
    ours_env = {**os.environ, "use_cuda": "1" if opts.device == "cuda" else "0"}  # Jittor's device switch
    print(f"# side by side against {opts.against}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{cpu_model()}" + (f", GPU {gpu_model()}" if opts.device == "cuda" else ""), flush=True)
    shown = ("train_tok_s", "decode_tok_s", "peak_rss_mb") + (("peak_gpu_mb",) if opts.device == "cuda" else ())
    rows, gemm_n, bf16_rates = [], None, []
    for precision in opts.precisions:
        for config in opts.configs:
            label = f"{config}_l{opts.n_layers}" if config == "8b" and opts.n_layers else config
            for method in methods:
                theirs_command, ours_command = pair_commands(opts.against, ref_python, precision, config, method,
                                                             opts.device, opts.n_layers)
                theirs, ours = run(theirs_command), run(ours_command, ours_env)
                for side, result in (("theirs", theirs), ("ours", ours)):
                    print(f"{precision} {label} {method} {side}: "
                          + (result["error"] if "error" in result else
                             " ".join(f"{k}={result.get(k, '-')}" for k in shown + ("wall_s",))), flush=True)
                if opts.against == "peft" and "error" not in theirs and "error" not in ours:
                    differs, line = same_work(theirs, ours)
                    print(f"{precision} {label} {method} {line}", flush=True)
                    if differs:
                        theirs = {"error": "different work"}
                rows.append((precision, label, method, theirs, ours))
                if "error" not in ours:
                    gemm_n = ours["gemm_n"]
                    bf16_rates.append(float(ours["bf16_matmul_gflops"]))

    failed, summary = print_table(opts, rows)
    if opts.device == "cpu":  # the roofline compares CPU kernels: on a GPU ours runs Jittor's CUDA matmul
        failed += print_gemm(run([ref_python, os.path.join(BENCH, "torch_gemm.py"), "--n", gemm_n or "1024"]),
                             gemm_n, bf16_rates)
    extremes = (("train_x", min), ("decode_x", min), ("rss_x", max)) + ((("gpu_x", max),) if opts.device == "cuda"
                                                                          else ())
    for short, extreme in extremes:
        values = [float(v) for k, v in summary.items() if k.endswith(short) and v != "-"]
        summary[f"{short}_{'max' if extreme is max else 'min'}"] = f"{extreme(values):.2f}" if values else "-"
    print(" ".join(f"{k}={v}" for k, v in {"against": opts.against, "device": opts.device, **summary,
                                           "failed": failed}.items()))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
