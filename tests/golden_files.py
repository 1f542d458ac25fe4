"""The authors' golden files as the tests read them (tests/test_golden.py checks them all): their model with the
file's parameters, and its forward on the file's batch."""
import json

import numpy as np

from conftest import GOLDEN
import jittor as jt
from Models.formats.adapters import assign_strict
from Models.formats.authors import args_from_authors
from Models.LLaMA_Adapter import LLaMA_adapter


def load_golden(stem: str):
    """(npz, meta dict, ModelArgs in fp32) of tests/golden/<stem>.npz, e.g. "sparse_s0" or
    "baselines/instance_s0"; meta["variant"] names the authors' folder (authors_options)."""
    data = np.load(GOLDEN / f"{stem}.npz", allow_pickle=False)
    meta = json.loads(str(data["meta"]))
    return data, meta, args_from_authors(meta["model_args"], meta["variant"], precision="fp32")  # parity in fp32


def golden_model(stem: str, **overrides):
    """(model with the golden file's parameters, npz, meta); `overrides` change ModelArgs fields."""
    data, meta, args = load_golden(stem)
    if overrides:
        args = type(args)(**{**args.to_dict(), **overrides})
    model = LLaMA_adapter(args)
    assign_strict(dict(model.named_parameters()), golden_params(data), f"{stem}.npz", "golden")
    return model, data, meta


def golden_forward(model, data, records=None):
    """(loss, logits) on the golden batch, the loss masked where the authors' ignore_index=0 drops it."""
    tokens = jt.array(data["tokens"].astype(np.int32))
    mask = jt.array((data["labels"] != 0).astype(np.float32))
    return model(tokens, mask, records=records)


def golden_params(data) -> dict:
    return {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")}
