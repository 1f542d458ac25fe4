"""MoA against the authors' PyTorch outputs (tests/golden/{sparse_s0,soft_s0,soft_e2_s3}.npz)."""
import json

import numpy as np
import pytest

from conftest import GOLDEN_FILES, golden_forward, golden_model, golden_params, kv_logits, load_golden, max_abs
import jittor as jt
from Models.authors_options import AUTHORS_PARAMS
from Models.checkpoints import (export_authors_adapter, import_authors_adapter,
                                load_adapter, save_adapter)
from Models.LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from Models.torch_io import load_pth


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_forward_loss_router(name):
    model, data, meta = golden_model(name)
    records = []
    loss, logits = golden_forward(model, data, records)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4
    assert abs(float(loss.item()) - float(data["loss"])) <= 1e-5
    for layer, record in enumerate(records):
        assert model.llama.layers[layer].type_names == meta["type_names"][layer]
        assert max_abs(record["type_weight"].numpy(), data[f"type_weights/{layer}"]) <= 1e-5
        if meta["variant"] == "sparse":
            assert max_abs(record["threshold"].numpy(), data[f"thresholds/{layer}"]) <= 1e-5
            # sigmoid > 0, so a non-zero type weight is exactly a selected expert
            assert np.array_equal(record["type_weight"].numpy() > 0, data[f"selected/{layer}"] > 0)


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_gradients(name):
    model, data, meta = golden_model(name)
    loss, _ = golden_forward(model, data)
    adapter = model.adapter_parameters()
    assert sorted(adapter) == sorted(meta["trainable"])
    grads = dict(zip(adapter, jt.grad(loss, list(adapter.values()))))
    for name, grad in grads.items():
        ref, got = data[f"grad/{name}"], grad.numpy()
        if name in meta["grad_none"]:
            assert np.all(got == 0), f"{name}: the authors' hard step passes no gradient"
        else:
            assert max_abs(got, ref) / np.abs(ref).max() <= 1e-3, name


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_kv_cache(name):
    model, data, meta = golden_model(name)
    model.eval()
    got = kv_logits(model.llama, data["tokens"].astype(np.int32), meta["kv_prefill"])
    assert max_abs(got, data["kv_logits"]) <= 1e-4


def test_learning_gamma_gets_gradient():
    model, data, _ = golden_model("sparse_s0", gamma_grad="ste")
    loss, logits = golden_forward(model, data)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4  # same forward as the authors'
    names = [n for n in model.adapter_parameters() if "adapter_threshold_fn" in n]
    grads = jt.grad(loss, [model.adapter_parameters()[n] for n in names])
    for name, grad in zip(names, grads):
        g = grad.numpy()
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_authors_adapter_export_import(name, tmp_path):
    """Ours -> their adapter.pth (flat) + adapter_params.json (their fields and values) -> ours, unchanged."""
    model, data, meta = golden_model(name)
    params = golden_params(data)
    save_adapter(model, str(tmp_path / "ours"))
    export_authors_adapter(str(tmp_path / "ours"), str(tmp_path / "theirs" / "adapter.pth"))
    theirs = load_pth(tmp_path / "theirs" / "adapter.pth")
    assert sorted(theirs) == sorted(meta["adapter_only_names"])
    assert all(np.array_equal(theirs[n], params[n]) for n in theirs)
    with open(tmp_path / "theirs" / "adapter_params.json") as f:
        assert json.load(f) == {k: meta["model_args"][k] for k in AUTHORS_PARAMS[meta["variant"]]}
    import_authors_adapter(str(tmp_path / "theirs" / "adapter.pth"), str(tmp_path / "back"), model.args)
    fresh = LLaMA_adapter(model.args)
    load_adapter(fresh, str(tmp_path / "back"))
    assert all(np.array_equal(var.numpy(), params[n]) for n, var in fresh.adapter_parameters().items())
    assert all(is_adapter_param(n) for n in theirs)
