"""How much loading a base raises a fresh process's peak memory (tests/test_base.py, tests/test_hf.py)."""
import json
import subprocess
import sys

from conftest import REPO

LOAD_PEAK_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import Utils.jittor_env
import numpy as np
from Models.formats import hf, meta
from Models.formats.base_model import base_args, base_layout, build_model
from Models.LLaMA_Adapter import LLaMA_adapter

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

warm, big, precision = sys.argv[2:5]
build_model(warm, base_args(warm, max_seq_len=8, precision=precision))  # compiles the ops
model = LLaMA_adapter(base_args(big, max_seq_len=8, precision=precision))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS")
(meta if base_layout(big) == "meta" else hf).load_base(model, big)
nbytes = sum(p.nbytes for p in model.base_parameters().values())
print(json.dumps({"increase": status("VmHWM") - before, "model_bytes": nbytes}))
"""


def load_peak(warm, big, precision) -> dict:
    """{"increase", "model_bytes"}: how much loading the base folder `big` raises the peak RSS (VmHWM) of a
    fresh process that compiled the read ops on the small base `warm` first, and the loaded base's bytes."""
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK_PROBE, str(REPO), str(warm), str(big), precision],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
