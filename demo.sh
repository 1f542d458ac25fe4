#!/usr/bin/env bash
# Command 1: the whole MoA pipeline on the embedded tiny LLaMA-3 base, on a CPU, in minutes:
# setup if needed -> fine-tune Sparse MoA with 2 MPI ranks (one without OpenMPI) -> evaluate base alone and MoA on
# the held-out synthetic test set -> router pickles and heatmaps. Extra arguments go to Math.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${MOA_VENV:-$HOME/.venvs/moa-jittor}/bin/python"
RUN="${MOA_RUN_DIR:-$HERE/output/math}"
bash "$HERE/setup.sh"
cd "$HERE"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # mpirun reads these itself
start=$(date +%s)
"$PY" -c "from Data.tiny_base import ensure_default_base; ensure_default_base()"
# The demo's folder is the demo's own: a rerun replaces the earlier demo run, unless it continues it.
case " $* " in *" --resume"*) OWN=() ;; *) OWN=(--overwrite) ;; esac
if command -v mpirun >/dev/null; then
  mpirun -np 2 --oversubscribe "$PY" Math.py --output_dir "$RUN" "${OWN[@]}" "$@"
else  # --batch_size is the global batch: one rank trains the same adapter as two (tests/test_mpi.py)
  echo "[demo] mpirun not found (OpenMPI): training on one rank"
  "$PY" Math.py --output_dir "$RUN" "${OWN[@]}" "$@"
fi
trained=$(date +%s)
"$PY" Infer.py --adapter_path "$RUN/adapter" --no_adapter --output_dir "$RUN/eval_base"
"$PY" Infer.py --adapter_path "$RUN/adapter" --save_weights --output_dir "$RUN/eval"
done_at=$(date +%s)
"$PY" - "$RUN" <<'PYEOF'
import json, sys
run = sys.argv[1]
base = json.load(open(f"{run}/eval_base/scores.json"))["average"]
moa = json.load(open(f"{run}/eval/scores.json"))["average"]
print(f"\n[demo] accuracy on the held-out synthetic test set: base alone {100 * base:.1f}% -> MoA {100 * moa:.1f}%")
print(f"[demo] adapter: {run}/adapter   predictions and scores: {run}/eval/")
print(f"[demo] router pickles and heatmaps: {run}/eval/*.pkl, {run}/eval/*.png; in a browser: {run}/eval/router_report.html")
PYEOF
echo "[demo] training $(( trained - start ))s, evaluation $(( done_at - trained ))s"
