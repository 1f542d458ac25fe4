"""Our speed beside a reference on torch, each pair measured one right after the other in one run.

    export REFVENV=~/.venvs/moa-ref              # python venv with torch (see ../shared/ref/README.md)
    export MOA_MIRROR=/path/to/DCDmllm+MoA/repo  # --against authors: bare git dir of the authors' repository
    ~/.venvs/moa-jittor/bin/python bench/side_by_side.py [--against authors|peft] [--precisions fp32 bf16]
        [--configs small medium]

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
Either way it prints both figures and ours/theirs: training tokens/s, decoding tokens/s, peak
RSS. Then the GEMM roofline: our bf16 base matmul (fp32 activations x bf16 weights) against
torch's bf16 GEMM, both n^3 products timed in this run. Then a markdown table for the README, and
last one key=value line: each pair's ratios (PRECISION_CONFIG_METHOD_train_x, _decode_x, _rss_x),
their extremes (train_x_min, decode_x_min, rss_x_max) and failed (pairs that failed).

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
import subprocess
import sys
import time

from common import fail  # bench/common.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("MOA_SHARED", os.path.join(os.path.dirname(REPO), "shared"))
BENCH = os.path.join(REPO, "bench")
# what both sides of --against peft print and must agree on
SAME_WORK = ("trainable_params", "base_params", "train_tokens", "loss_tokens", "decode_tokens", "optimizer",
             "lora_rank", "lora_alpha", "lora_targets")


def reference_python(against: str) -> str:
    venv, mirror = os.environ.get("REFVENV"), os.environ.get("MOA_MIRROR")
    if not venv or not os.path.isfile(os.path.join(venv, "bin", "python")):
        fail("set REFVENV to the reference venv with torch (e.g. ~/.venvs/moa-ref; ../shared/ref/README.md "
             f"says how to make it); got {venv!r}")
    python = os.path.join(venv, "bin", "python")
    if against == "peft":
        if subprocess.run([python, "-c", "import transformers, peft"], capture_output=True).returncode:
            fail(f"REFVENV={venv} lacks transformers or peft: {python} -m pip install transformers safetensors "
                 "tokenizers peft (after torch, see ../shared/ref/README.md)")
        return python
    if not mirror or not os.path.isdir(mirror):
        fail(f"set MOA_MIRROR to the bare git dir of the authors' repository (DCDmllm/MoA); got {mirror!r}")
    if not os.path.isfile(os.path.join(SHARED, "ref", "ref_bench.py")):
        fail(f"{SHARED}/ref/ref_bench.py is missing (set MOA_SHARED to the shared folder)")
    return python


def pair_commands(against: str, ref_python: str, precision: str, config: str, method: str) -> tuple:
    """(theirs, ours): the two command lines of one pair."""
    ours = [sys.executable, os.path.join(BENCH, "bench.py"), "--config", config, "--precision", precision]
    if against == "peft":
        return ([ref_python, os.path.join(BENCH, "peft_bench.py"), "--config", config, "--precision", precision],
                ours + ["--preset", method])
    theirs = [ref_python, os.path.join(SHARED, "ref", "ref_bench.py"), "--variant", method, "--config", config]
    return theirs + (["--precision", "bf16"] if precision == "bf16" else []), ours + ["--variant", method]


def same_work(theirs: dict, ours: dict) -> tuple:
    """(the SAME_WORK keys on which the two sides differ, a line with theirs, and ours where it differs)."""
    differs = [key for key in SAME_WORK if theirs.get(key) != ours.get(key)]
    cells = [f"{key}={theirs.get(key, '-')}" + (f"|ours:{ours.get(key, '-')}" if key in differs else "")
             for key in SAME_WORK]
    return differs, ("same work: " if not differs else f"DIFFERENT WORK ({', '.join(differs)}): ") + " ".join(cells)


def run(command: list) -> dict:
    """Run a benchmark; its last line with train_tok_s= as a dict (strings), or {'error': tail}."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", choices=["authors", "peft"], default="authors",
                        help="the authors' MoA code, or plain LoRA with peft on transformers")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--configs", nargs="+", choices=["small", "medium"], default=["small", "medium"])
    parser.add_argument("--variants", nargs="+", choices=["sparse", "soft"],
                        help="--against authors: the MoA variants (default: sparse soft)")
    parser.error = fail  # the project's contract: one `error:` line, exit 2 (no Jittor here: it would catch SIGCHLD)
    opts = parser.parse_args()
    if opts.against == "peft" and opts.variants:
        fail("--variants picks the authors' MoA variants; --against peft compares plain LoRA only")
    methods = ["lora"] if opts.against == "peft" else opts.variants or ["sparse", "soft"]
    ref_python = reference_python(opts.against)
    print(f"# side by side against {opts.against}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{cpu_model()}", flush=True)
    rows, gemm_n, bf16_rates = [], None, []
    for precision in opts.precisions:
        for config in opts.configs:
            for method in methods:
                theirs_command, ours_command = pair_commands(opts.against, ref_python, precision, config, method)
                theirs, ours = run(theirs_command), run(ours_command)
                for side, result in (("theirs", theirs), ("ours", ours)):
                    print(f"{precision} {config} {method} {side}: "
                          + (result["error"] if "error" in result else
                             " ".join(f"{k}={result.get(k, '-')}" for k in
                                      ("train_tok_s", "decode_tok_s", "peak_rss_mb", "wall_s"))), flush=True)
                if opts.against == "peft" and "error" not in theirs and "error" not in ours:
                    differs, line = same_work(theirs, ours)
                    print(f"{precision} {config} {method} {line}", flush=True)
                    if differs:
                        theirs = {"error": "different work"}
                rows.append((precision, config, method, theirs, ours))
                if "error" not in ours:
                    gemm_n = ours["gemm_n"]
                    bf16_rates.append(float(ours["bf16_matmul_gflops"]))
    torch_gemm = run([ref_python, os.path.join(BENCH, "torch_gemm.py"), "--n", gemm_n or "1024"])

    label = "variant" if opts.against == "authors" else "method"
    print(f"\n| precision | config | {label} | train tok/s theirs | ours | ratio | decode tok/s theirs | ours | ratio "
          "| peak RSS MB theirs | ours | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed, summary = 0, {}
    for precision, config, method, theirs, ours in rows:
        failed += "error" in theirs or "error" in ours
        cells = [precision, config, method]
        for key, short in (("train_tok_s", "train_x"), ("decode_tok_s", "decode_x"), ("peak_rss_mb", "rss_x")):
            cells += [theirs.get(key, "failed"), ours.get(key, "failed"), ratio(ours, theirs, key)]
            summary[f"{precision}_{config}_{method}_{short}"] = cells[-1].rstrip("x")
        print("| " + " | ".join(cells) + " |")
    if "error" in torch_gemm:
        print(f"\ntorch GEMM failed: {torch_gemm['error']}")
        failed += 1
    elif bf16_rates:
        ours_rate = sorted(bf16_rates)[len(bf16_rates) // 2]
        torch_rate = float(torch_gemm["torch_bf16_gflops"])
        print(f"\nGEMM {gemm_n}^3 in this run: our bf16 base matmul {ours_rate:.1f} GFLOP/s (median of our runs), "
              f"torch bf16 {torch_rate:.1f} GFLOP/s (torch {torch_gemm['torch']}, {torch_gemm['cpu_capability']}): "
              f"{ours_rate / torch_rate:.2f}x; torch fp32 {torch_gemm['torch_fp32_gflops']} GFLOP/s")
    for short, extreme in (("train_x", min), ("decode_x", min), ("rss_x", max)):
        values = [float(v) for k, v in summary.items() if k.endswith(short) and v != "-"]
        summary[f"{short}_{'max' if extreme is max else 'min'}"] = f"{extreme(values):.2f}" if values else "-"
    print(" ".join(f"{k}={v}" for k, v in {"against": opts.against, **summary, "failed": failed}.items()))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
