#!/usr/bin/env bash
# The test command: setup if needed, then pytest with the arguments given: none runs the whole suite
# (pytest.ini's testpaths), `-m "not slow"` the quick run, `tests/test_base.py` one file.
# Jittor compiles each kernel the first time it runs (ours once for every shape, its own fused ops once per shape) and
# keeps it in its cache; a marker there says that a whole run (no file named) has filled it, and until then the
# command says that this run is mostly compiling.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${MOA_VENV:-$HOME/.venvs/moa-jittor}/bin/python"
bash "$HERE/setup.sh"
cd "$HERE"
CACHE="$("$PYTHON" -c 'import Utils.jittor_env, jittor_utils; print(jittor_utils.cache_path)' 2>/dev/null || true)"
MARKER="$CACHE/moa_tests_compiled"
if [ -n "$CACHE" ] && [ ! -e "$MARKER" ]; then
  echo "[test] Jittor's kernel cache ($CACHE) has not run this suite yet: this first run is mostly Jittor" \
       "compiling the kernels the tests use (each once, kept in the cache); later runs are much quicker"
fi
whole=1
for arg in "$@"; do [ -e "${arg%%::*}" ] && whole=0; done  # a file or folder named: part of the suite
# Workers (pytest-xdist), one a core up to 4 (MOA_TEST_WORKERS overrides; 0: one process): most tests run on one
# thread, and a worker that runs out of tests takes half of another's (worksteal). Each worker gets its share of
# the cores for its OpenMP threads (spinning threads beside another worker's made tiny trainings ~10x slower);
# the tests that start MPI ranks run alone (tests/suite_run.py); the workers compile kernels at once (each under its
# own lock: scripts/jittor_patches.sh).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc alone reads those
workers="${MOA_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"; [ "$workers" = 1 ] && workers=0
(( workers > 0 )) && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / workers > 1 ? cores / workers : 1 ))}"
status=0
# at the end: the 25 slowest tests and the time per test file (tests/suite_run.py), kernels compiled included
"$PYTHON" -m pytest -q -p no:cacheprovider -n "$workers" --dist worksteal --durations=25 "$@" || status=$?
if [ -n "$CACHE" ] && [ "$whole" = 1 ] && [ "$status" -le 1 ]; then touch "$MARKER"; fi  # 0 passed, 1 failures
exit "$status"
