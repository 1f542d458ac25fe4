"""Helpers to read the authors' golden files in ../shared/golden."""
import json

import numpy as np

from conftest import shared_path
from Models.checkpoints import args_from_authors


def load_golden(variant: str):
    """(npz, meta dict, ModelArgs) for sparse_s0 / soft_s0."""
    data = np.load(shared_path("golden", f"{variant}_s0.npz"), allow_pickle=False)
    meta = json.loads(str(data["meta"]))
    return data, meta, args_from_authors(meta["model_args"], variant, precision="fp32")  # parity in fp32


def golden_params(data) -> dict:
    return {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")}


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
