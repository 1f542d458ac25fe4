"""Command 1 end to end, as a user runs it: `bash demo.sh` (2 MPI ranks, the shipped tiny base,
the demo recipe, the run's 300 held-out problems), with one flag: 2 epochs of the recipe's 3. MoA must
beat the base alone clearly.

The slowest test (minutes on 2 cores). It runs the demo itself rather than a single-process variant:
the adapters learn to copy the question's numbers in a sudden transition late in the schedule, and runs
that differ only in floating-point summation order (one process instead of two ranks, other data) have
ended far apart, so only the demo's own run says what the README claims. The schedule is the
recipe's cut to 2 epochs (cosine over 2,500 steps instead of 3,750: a third less training), which
still ends past the transition by a wide margin: every 2-epoch run measured cleared the base by 60
points or more (fp32: seed 0 99.7%, seed 1 100%, seed 2 67.3%; bf16 seed 0 96.7% and 95.3%; commits
469500b and c573241), where 1 epoch ends in the middle of it (12-33% on that CPU, 46.3% on the Zen 4
EPYC, seed 0, 2026-11-27) and the recipe's 3 reach 100%.
"""
import json
import os
import shutil
import subprocess

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.mpi,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (setup.sh installs it)")]

EPOCHS = 2  # of the demo recipe's 3: see above


def test_demo_moa_beats_the_base_alone(tmp_path):
    run = tmp_path / "math"
    proc = subprocess.run(["bash", str(REPO / "demo.sh"), "--epochs", str(EPOCHS)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "MOA_RUN_DIR": str(run)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = json.loads((run / "args.json").read_text())
    assert (args["recipe"], args["epochs"], args["world_size"]) == ("demo", EPOCHS, 2)
    base = json.loads((run / "eval_base" / "scores.json").read_text())
    moa = json.loads((run / "eval" / "scores.json").read_text())
    assert base["datasets"]["synthetic"]["total"] == moa["datasets"]["synthetic"]["total"] == 300
    assert base["average"] <= 0.15, (base["average"], moa["average"])
    assert moa["average"] >= base["average"] + 0.30, (base["average"], moa["average"])
    assert "accuracy on the held-out synthetic test set" in proc.stdout
    for name in ("type_weight.pkl", "token_weight.pkl", "type_weight.png", "router_stats.png", "router_report.html"):
        assert (run / "eval" / name).is_file(), name
