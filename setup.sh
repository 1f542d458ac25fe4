#!/usr/bin/env bash
# One-time (idempotent) setup: system packages, the virtual environment, Jittor's first compile.
# The venv lives at a stable path outside the clone because Jittor keys its compile cache
# by the install path: every clone and CI run then reuses one warm cache.
set -euo pipefail
VENV="${MOA_VENV:-$HOME/.venvs/moa-jittor}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicc >/dev/null || missing+=(libopenmpi-dev)
[ -e /usr/include/dnnl.hpp ] || missing+=(libdnnl-dev)
command -v g++ >/dev/null || missing+=(g++)
command -v bwrap >/dev/null || missing+=(bubblewrap)  # the code task's sandbox (Utils/sandbox/)
command -v ip >/dev/null || missing+=(iproute2)  # hosts emulated in network namespaces (scripts/emulated_hosts.py)
if [ ${#missing[@]} -gt 0 ]; then
  if [ -n "${PIP_NO_INDEX:-}" ]; then  # pip's own switch for a machine without package registries
    echo "[setup] no package registries (PIP_NO_INDEX): continuing without ${missing[*]}" >&2
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] apt-get install ${missing[*]}"
    # bounded: a machine without package registries (a GPU machine here) goes on without them
    if ! { timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
      echo "[setup] apt-get failed (no package registry?): continuing without ${missing[*]}" >&2
    fi
  else
    echo "[setup] missing system packages: ${missing[*]} (install them as root; continuing without)" >&2
  fi
fi
# optional, on its own so that a system without the package (Ubuntu ships a snap) still gets the others: the
# router report's browser test (tests/test_router_report.py) opens the page in it, and skips without it
if ! command -v chromium >/dev/null && [ -z "${PIP_NO_INDEX:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] apt-get install chromium (the router report's browser test)"
  if ! { timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium >/dev/null; }; then
    echo "[setup] no chromium: the router report's browser test will skip" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
# without registries (PIP_NO_INDEX) only what requirements.txt names is checked: its dependencies came with it
NO_DEPS=(); [ -n "${PIP_NO_INDEX:-}" ] && NO_DEPS=(--no-deps)
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${NO_DEPS[@]}" -r "$HERE/requirements.txt"; then
  # mpi4py needs mpicc to build; everything else still works without it (Jittor has its own MPI)
  echo "[setup] retrying without mpi4py" >&2
  grep -v '^mpi4py' "$HERE/requirements.txt" | "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${NO_DEPS[@]}" -r /dev/stdin
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
bash "$HERE/scripts/jittor_patches.sh" "$SITE"  # compiler threads and Python; compile time and locks; progress
NVCC="${nvcc_path:-$(command -v nvcc || true)}"
if ls /dev/nvidia[0-9]* >/dev/null 2>&1 && [ -n "$NVCC" ] && \
   [ "$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" -ge 13 ] 2>/dev/null; then
  bash "$HERE/scripts/jittor_cuda13.sh" "$SITE"
fi

echo "[setup] preparing Jittor (the first time compiles for a few minutes)"
cd "$HERE" && MOA_JITTOR_LOG="${MOA_JITTOR_LOG:-0}" "$VENV/bin/python" -c "
import time; t = time.time()
import Utils.jittor_env, jittor as jt
from jittor import compile_extern
x = jt.ones((64, 64)); (x @ x).sync()
print(f'[setup] Jittor {jt.__version__} ready in {time.time() - t:.0f}s: oneDNN', compile_extern.mkl_ops is not None,
      '| MPI', jt.compile_extern.mpi is not None, '| CUDA', bool(jt.has_cuda))
"
echo "[setup] done: $VENV/bin/python"
