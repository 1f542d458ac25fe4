"""Our speed beside the authors' PyTorch code, each pair measured one right after the other in one run.

    export REFVENV=~/.venvs/moa-ref              # python venv with torch (see ../shared/ref/README.md)
    export MOA_MIRROR=/path/to/DCDmllm+MoA/repo  # bare git dir of the authors' repository
    ~/.venvs/moa-jittor/bin/python bench/side_by_side.py [--precisions fp32 bf16] [--configs small medium]

For every precision x configuration x variant it runs ../shared/ref/ref_bench.py (the
authors' code, 2 threads) and then bench/bench.py (ours) on the same configuration,
and prints both figures and ours/theirs: training tokens/s, decoding tokens/s, peak
RSS. Then the GEMM roofline: our bf16 base matmul (fp32 activations x bf16 weights)
against torch's bf16 GEMM, both n^3 products timed in this run. The last lines are a
markdown table for the README.

Runtime: about 3 minutes for all sixteen pairs on a 2-core AMD EPYC with bf16 units
(avx512_bf16). Without bf16 units the authors' bf16 autocast has no fast CPU kernels: on such a
2-core EPYC fp32 took about 15 min and bf16 about 1 h 45 min (6 min per small pair, 40 per
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("MOA_SHARED", os.path.join(os.path.dirname(REPO), "shared"))


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def reference_python() -> str:
    venv, mirror = os.environ.get("REFVENV"), os.environ.get("MOA_MIRROR")
    if not venv or not os.path.isfile(os.path.join(venv, "bin", "python")):
        fail("set REFVENV to the reference venv with torch (e.g. ~/.venvs/moa-ref; ../shared/ref/README.md "
             f"says how to make it); got {venv!r}")
    if not mirror or not os.path.isdir(mirror):
        fail(f"set MOA_MIRROR to the bare git dir of the authors' repository (DCDmllm/MoA); got {mirror!r}")
    if not os.path.isfile(os.path.join(SHARED, "ref", "ref_bench.py")):
        fail(f"{SHARED}/ref/ref_bench.py is missing (set MOA_SHARED to the shared folder)")
    return os.path.join(venv, "bin", "python")


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
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--configs", nargs="+", choices=["small", "medium"], default=["small", "medium"])
    parser.add_argument("--variants", nargs="+", choices=["sparse", "soft"], default=["sparse", "soft"])
    parser.error = fail  # the project's contract: one `error:` line, exit 2 (no Jittor here: it would catch SIGCHLD)
    opts = parser.parse_args()
    ref_python = reference_python()
    ours_python = sys.executable
    print(f"# side by side, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}",
          flush=True)
    rows, gemm_n, bf16_rates = [], None, []
    for precision in opts.precisions:
        for config in opts.configs:
            for variant in opts.variants:
                args = ["--variant", variant, "--config", config]
                theirs = run([ref_python, os.path.join(SHARED, "ref", "ref_bench.py"), *args]
                             + (["--precision", "bf16"] if precision == "bf16" else []))
                ours = run([ours_python, os.path.join(REPO, "bench", "bench.py"), *args, "--precision", precision])
                rows.append((precision, config, variant, theirs, ours))
                for side, result in (("theirs", theirs), ("ours", ours)):
                    print(f"{precision} {config} {variant} {side}: "
                          + (result["error"] if "error" in result else
                             " ".join(f"{k}={result.get(k, '-')}" for k in
                                      ("train_tok_s", "decode_tok_s", "peak_rss_mb", "wall_s"))), flush=True)
                if "error" not in ours:
                    gemm_n = ours["gemm_n"]
                    bf16_rates.append(float(ours["bf16_matmul_gflops"]))
    torch_gemm = run([ref_python, os.path.join(REPO, "bench", "torch_gemm.py"), "--n", gemm_n or "1024"])

    print("\n| precision | config | variant | train tok/s theirs | ours | ratio | decode tok/s theirs | ours | ratio "
          "| peak RSS MB theirs | ours | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for precision, config, variant, theirs, ours in rows:
        failed |= "error" in theirs or "error" in ours
        cells = [precision, config, variant]
        for key in ("train_tok_s", "decode_tok_s", "peak_rss_mb"):
            cells += [theirs.get(key, "failed"), ours.get(key, "failed"), ratio(ours, theirs, key)]
        print("| " + " | ".join(cells) + " |")
    if "error" in torch_gemm:
        print(f"\ntorch GEMM failed: {torch_gemm['error']}")
        failed = True
    elif bf16_rates:
        ours_rate = sorted(bf16_rates)[len(bf16_rates) // 2]
        torch_rate = float(torch_gemm["torch_bf16_gflops"])
        print(f"\nGEMM {gemm_n}^3 in this run: our bf16 base matmul {ours_rate:.1f} GFLOP/s (median of our runs), "
              f"torch bf16 {torch_rate:.1f} GFLOP/s (torch {torch_gemm['torch']}, {torch_gemm['cpu_capability']}): "
              f"{ours_rate / torch_rate:.2f}x; torch fp32 {torch_gemm['torch_fp32_gflops']} GFLOP/s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
