"""torch's GEMM rate on this machine, for the side-by-side roofline; run with the reference venv's python.

$REFVENV/bin/python bench/torch_gemm.py --n 1024 --threads 2
Prints one key=value line: torch_fp32_gflops, torch_bf16_gflops (an n^3 product each, best of 3).
"""
import argparse
import time

import torch


def rate(dtype, n: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: oneDNN picks and packs its kernel once
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1024, help="matrix size")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the reference harness uses 2)")
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")  # one `error:` line (torch's venv: no Utils)
    opts = parser.parse_args()
    if opts.n < 1 or opts.threads < 1:
        parser.error(f"--n {opts.n} and --threads {opts.threads} must be at least 1")
    torch.set_num_threads(opts.threads)
    print(f"torch={torch.__version__} cpu_capability={torch.backends.cpu.get_cpu_capability()} n={opts.n} "
          f"torch_fp32_gflops={rate(torch.float32, opts.n):.1f} torch_bf16_gflops={rate(torch.bfloat16, opts.n):.1f}")


if __name__ == "__main__":
    main()
