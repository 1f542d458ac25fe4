#!/usr/bin/env bash
# The GPU path checked on a bare GPU machine in one command (docs/gpu.md).
#
#   bash scripts/gpu_check.sh fetch          # here, with package registries: what the GPU machine lacks -> .gpu/
#   bash scripts/gpu_check.sh run [SECONDS]  # there, with .gpu/ beside the clone: everything below within SECONDS
#                                            # (default 560: one 10-minute command, the machine's start apart)
#   bash scripts/gpu_check.sh decode [SECONDS]  # there: generation on the GPU against its rooflines (below)
# The GPU machine has no package registries and its own Python 3.12 with torch, transformers and most of our
# requirements; .gpu/wheels carries the rest (Jittor built as a wheel, numpy < 2, tensorboardX, astunparse,
# pytest-xdist and its execnet) and .gpu/ref the authors' sources for the side by side (scripts/carry_authors.sh).
# `run` makes the usual venv (~/.venvs/moa-jittor) over the image's packages, installs the wheels, runs setup.sh
# (Jittor's patches, its first compile), prints the environment, then, each step timed and bounded by what is left:
#   alone, so that its figures are the GPU's: the side by side with the authors' code, Sparse MoA at medium
#   bf16 (bench/side_by_side.py --device cuda); then in parallel (compiling CUDA kernels is most of their time, and
#   the machine has 16 cores): bash demo.sh (accuracy against the base) and the golden parity tests (3 workers);
#   then, with the time left, the 8B shape (8 of its layers) and Soft MoA side by side, and two MPI ranks against
#   one (tests/test_mpi.py) where OpenMPI is.
# Logs go to $OUT (the device tool's folder) or .gpu/logs; the last line is key=value.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$HERE/.gpu"
VENV="${MOA_VENV:-$HOME/.venvs/moa-jittor}"

fetch() {
  set -e
  local py="$VENV/bin/python" wheels="$CARRY/wheels"
  rm -rf "$wheels" && mkdir -p "$wheels"
  "$py" -m pip download -q --no-deps --no-binary :all: -d "$wheels/src" "jittor==1.3.11.0"
  "$py" -m pip wheel -q --no-deps -w "$wheels" "$wheels"/src/jittor-*.tar.gz && rm -rf "$wheels/src"
  local pins; pins="$("$py" -c 'from importlib.metadata import version as v
print(*(f"{p}=={v(p)}" for p in ("tensorboardX", "pytest-xdist", "execnet")))')"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" \
    "numpy==1.26.4" "astunparse==1.6.3" $pins
  MOA_MIRROR="${MOA_MIRROR:-/work/.mirror/DCDmllm+MoA/repo}" bash "$HERE/scripts/carry_authors.sh"
  du -sh "$CARRY"/*
}

LOG_DIR="${OUT:-$CARRY/logs}"  # the device tool brings back at most 8 files: the logs alone go there
STATUS_DIR="${GPU_CHECK_STATUS:-$(mktemp -d)}"
START="${GPU_CHECK_START:-$(date +%s)}"
BUDGET=560

left() { echo $(( START + BUDGET - $(date +%s) )); }
note() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$LOG_DIR/gpu_check.log"; }

# step NAME SECONDS COMMAND...: COMMAND into $LOG_DIR/NAME.log, bounded by SECONDS and by the time left
step() {
  local name="$1" limit="$2"; shift 2
  local budget; budget=$(left); (( limit > budget - 5 )) && limit=$(( budget - 5 ))
  if (( limit < 20 )); then note "$name: skipped (no time left)"; echo "skipped" > "$STATUS_DIR/$name"; return; fi
  local t0; t0=$(date +%s)
  note "$name: start (at most ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
  local rc=$? status
  status="rc=$rc"; (( rc == 124 || rc == 137 )) && status="timed_out"
  echo "$status $(( $(date +%s) - t0 ))s" > "$STATUS_DIR/$name"
  note "$name: $status after $(( $(date +%s) - t0 ))s"
}

status_of() { cut -d' ' -f1 < "$STATUS_DIR/$1" 2>/dev/null || echo "not_run"; }
# pytest's counts at the end of step NAME's log: 12_passed,1_failed
counts_of() {
  tail -3 "$LOG_DIR/$1.log" 2>/dev/null | grep -oE '[0-9]+ (passed|failed|errors?)' | tr ' ' '_' | paste -sd, -
}

prepare() {
  note "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
  note "CUDA: $(nvcc --version 2>&1 | tail -2 | head -1) | python3: $(command -v python3) $(python3 --version 2>&1)"
  note "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GB, mpirun: $(command -v mpirun || echo absent)," \
       "mpicc: $(command -v mpicc || echo absent), bwrap: $(command -v bwrap || echo absent)," \
       "NCCL for Jittor (an installed nvidia-nccl wheel's): $(cd "$HERE" && python3 -c 'import sys
sys.path.insert(0, "."); from Utils.jittor_env import wheel_nccl; print(wheel_nccl() or "none")' 2>&1 | tail -1)"
  # the usual venv over the image's packages (torch, matplotlib, tiktoken, safetensors, ...); its own come first
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --without-pip "$VENV" || return 1
    python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$(site_packages)/gpu_image.pth"
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$(site_packages)" --upgrade \
    "$CARRY"/wheels/*.whl || return 1
  bash "$HERE/setup.sh" || return 1
  note "$(cd "$HERE" && "$VENV/bin/python" -c 'import Utils.jittor_env, jittor, numpy, sys
print("Jittor", jittor.__version__, "CUDA", jittor.has_cuda, "numpy", numpy.__version__, "Python", sys.version.split()[0])' 2>&1 | tail -1)"
}

site_packages() { "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# the set-up every mode starts with: the time budget ($1, default 560 s), the logs, the prepared venv
begin() {
  [ -n "${1:-}" ] && BUDGET="$1"
  mkdir -p "$LOG_DIR"
  cd "$HERE"
  # PIP_NO_INDEX: setup.sh reaches for no registry (pip finds everything installed, apt is not tried)
  export GPU_CHECK_START="$START" GPU_CHECK_STATUS="$STATUS_DIR" PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
  step setup 240 bash "$HERE/scripts/gpu_check.sh" prepare
  if [ "$(status_of setup)" != "rc=0" ]; then
    tail -30 "$LOG_DIR/setup.log"; echo "gpu_check=failed step=setup"; return 1
  fi
}

# the decode layer's CUDA form against the plain layer, and generation through it (greedy vs no cache, batched;
# rows whose logits are not finite picking no token, greedy and sampled on the device);
# MOA_GPU_KERNELS=1 turns it on (off by default until this has passed on a GPU). Compiling is most of it: about
# 44 distinct CUDA ops with the mixtures' (each 7 s of nvcc on this project's 2-core CPU), compiled 4 tests at a
# time (pytest-xdist's workers; one test's graph holds only a few ops to compile at once)
decode_tests() {
  local tests="decode_layer_equals or built_once or greedy_cache or batch_of_4 or records_match or non_finite"
  step gpu_decode 340 env use_cuda=1 MOA_GPU_KERNELS=1 OMP_NUM_THREADS=4 "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider -rf -n 4 --dist worksteal tests/test_decode_layer.py tests/test_kv_cache.py \
    tests/test_generation.py -k "$tests"
}

# side_by_side NAME SECONDS ARGS...: bench/side_by_side.py beside the authors' code on the GPU in bf16, as step NAME
side_by_side() {
  local name="$1" limit="$2"; shift 2
  step "$name" "$limit" env use_cuda=1 REFPYTHON=python3 "$VENV/bin/python" bench/side_by_side.py --device cuda \
    --precisions bf16 "$@"
}

run() {
  begin "$@" || return 1
  local py="$VENV/bin/python"
  side_by_side side_by_side 130 --configs medium --variants sparse
  step demo 400 env MOA_RUN_DIR=/tmp/demo bash demo.sh &
  step golden 400 env use_cuda=1 OMP_NUM_THREADS=2 "$py" -m pytest -q -p no:cacheprovider -rf -n 3 --dist worksteal \
    tests/test_golden.py tests/test_precision.py tests/test_hf.py &
  wait
  side_by_side side_by_side_8b 150 --configs 8b --n_layers 8 --variants sparse
  side_by_side side_by_side_soft 120 --configs medium --variants soft
  if command -v mpirun >/dev/null; then step mpi 120 bash test.sh tests/test_mpi.py; fi

  local demo_acc
  demo_acc="$(grep -o 'base alone [0-9.]*% -> MoA [0-9.]*%' "$LOG_DIR/demo.log" | sed 's/base alone /base=/; s/ -> MoA /,moa=/')"
  echo "gpu_check=done seconds=$(( $(date +%s) - START )) setup=$(status_of setup)" \
       "side_by_side=$(status_of side_by_side)" \
       "demo=$(status_of demo) demo_accuracy=${demo_acc:-none} golden=$(status_of golden)" \
       "golden_tests=$(counts_of golden) side_by_side_8b=$(status_of side_by_side_8b)" \
       "side_by_side_soft=$(status_of side_by_side_soft)" \
       "mpi=$(command -v mpirun >/dev/null && status_of mpi || echo no_openmpi)" \
       "jittor_cache_mb=$(du -sm "$HOME/.cache/jittor" 2>/dev/null | cut -f1)"
}

# Generation on the GPU: the decode tests, then bench.py's decoding at medium bf16 (the figure this project's CPU
# gives about 930 tokens/s) and where its step's time goes (bench/decode_host.py: building the graph, running it), the
# 8B shape (8 layers) decoding at batch 1, 8 and 32 beside the rooflines measured in
# the same run (bench/eval_scale.py: the streaming read, the decode pass's and cuBLAS's bf16 rates), and the
# authors' decoding beside ours at medium bf16
decode() {
  begin "$@" || return 1
  local py="$VENV/bin/python"
  export MOA_GPU_KERNELS=1  # the decode layer's CUDA form (Models/kernels/switch.py), off by default until checked
  decode_tests
  step bench_medium 120 env use_cuda=1 "$py" bench/bench.py --config medium --precision bf16
  step decode_host 60 env use_cuda=1 "$py" bench/decode_host.py --config medium --precision bf16 --batch 4
  step eval_8b 240 env use_cuda=1 "$py" bench/eval_scale.py --n_layers 8 --batch_sizes 1 8 32 --new_tokens 16
  side_by_side side_by_side 130 --configs medium --variants sparse
  echo "gpu_check=decode seconds=$(( $(date +%s) - START )) gpu_decode=$(status_of gpu_decode)" \
       "gpu_decode_tests=$(counts_of gpu_decode) bench_medium=$(status_of bench_medium)" \
       "decode_host=$(status_of decode_host) eval_8b=$(status_of eval_8b) side_by_side=$(status_of side_by_side)"
  for name in bench_medium decode_host eval_8b side_by_side; do tail -1 "$LOG_DIR/$name.log" 2>/dev/null; done
}

case "${1:-}" in
  fetch) fetch ;;
  decode) shift; decode "$@" ;;
  prepare) mkdir -p "$LOG_DIR"; prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash scripts/gpu_check.sh fetch | run [SECONDS] | decode [SECONDS]" >&2; exit 2 ;;
esac
