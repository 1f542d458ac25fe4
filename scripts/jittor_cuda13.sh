#!/usr/bin/env bash
# Jittor 1.3.11 against CUDA 13 (run on a GPU machine; setup.sh does where nvcc reports 13 or later).
# Usage: bash scripts/jittor_cuda13.sh <site-packages dir holding jittor/>. Idempotent. Three changes:
# - CUDA 13 dropped cudaDeviceProp::computeMode and ::clockRate, read by Jittor's device helper;
# - CUDA 13's cub/thrust need C++17 from nvcc (the host compiler keeps Jittor's C++14);
# - CUDA 13's cub dropped cub::Max(), used by Jittor's CUDA softmax.
# Checked on an H100 with nvcc 13.0.88 (golden parity in fp32 and bf16; README, GPU).
set -euo pipefail
J="${1:?usage: jittor_cuda13.sh SITE_PACKAGES}/jittor"
[ -f "$J/compiler.py" ] || { echo "no Jittor under $J" >&2; exit 2; }
sed -i 's/deviceProp\.computeMode/cudaComputeModeDefault/g; s/deviceProp\.clockRate/1/g' "$J/extern/cuda/inc/helper_cuda.h"
if ! grep -q "nvcc 13: C++17" "$J/compiler.py"; then
  python3 - "$J/compiler.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
anchor = '        nvcc_flags += " -w "\n'
if text.count(anchor) != 1:
    sys.exit(f"{path}: the line to patch after was not found (not Jittor 1.3.11?)")
text = text.replace(anchor, anchor + '        if nvcc_version >= [13,]:  # nvcc 13: C++17\n'
                    '            nvcc_flags = nvcc_flags.replace("-std=c++14", "-std=c++17")\n')
open(path, "w").write(text)
PY
fi
if grep -q "cub::Max()" "$J/other/code_softmax.py"; then
  sed -i 's/cub::Max()/::cuda::maximum<>()/; s#^\#include <{jt.compile_extern.cub_home}cub/cub.cuh>#&\n\#include <cuda/functional>#' \
    "$J/other/code_softmax.py"
fi
echo "[jittor_cuda13] patched $J"
