#!/usr/bin/env bash
# The README's speed table: small and medium, Sparse and Soft, with and without oneDNN.
set -euo pipefail
PY="${MOA_VENV:-$HOME/.venvs/moa-jittor}/bin/python"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "| config | variant | oneDNN | train tok/s | decode tok/s | MFU | peak RSS MB | first step s | sgemm GFLOP/s |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for config in small medium; do
  for variant in sparse soft; do
    for mkl in 1 0; do
      line=$(use_mkl=$mkl "$PY" bench/bench.py --config $config --variant $variant 2>/dev/null | tail -1)
      eval "$(echo "$line" | tr ' ' '\n' | sed 's/^/b_/')"
      echo "| $config | $variant | $([ $mkl = 1 ] && echo yes || echo no) | $b_train_tok_s | $b_decode_tok_s | $b_mfu | $b_peak_rss_mb | $b_first_step_s | $b_sgemm_gflops |"
    done
  done
done
