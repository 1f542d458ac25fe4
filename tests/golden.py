"""Helpers to read the authors' golden files in ../shared/golden."""
import json

import numpy as np

from conftest import shared_path
from Models.authors_options import args_from_authors

# The golden files: sparse_s0, soft_s0 (one expert per type) and soft_e2_s3 (two experts per type).
GOLDEN_FILES = ("sparse_s0", "soft_s0", "soft_e2_s3")


def load_golden(name: str):
    """(npz, meta dict, ModelArgs) for a golden file by its stem, e.g. 'soft_e2_s3'."""
    data = np.load(shared_path("golden", f"{name}.npz"), allow_pickle=False)
    meta = json.loads(str(data["meta"]))
    return data, meta, args_from_authors(meta["model_args"], meta["variant"], precision="fp32")  # parity in fp32


def golden_params(data) -> dict:
    return {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")}


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
