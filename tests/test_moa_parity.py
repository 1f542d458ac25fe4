"""MoA against the authors' PyTorch outputs (tests/golden/{sparse,soft}_s0.npz)."""
import numpy as np
import pytest

from conftest import golden_params, kv_logits, load_golden, max_abs
import jittor as jt
from Models.checkpoints import assign_strict, export_authors_adapter, import_authors_adapter, load_adapter
from Models.LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from Models.torch_io import save_pth


def golden_model(variant: str, **overrides):
    data, meta, args = load_golden(f"{variant}_s0")
    if overrides:
        args = type(args)(**{**args.to_dict(), **overrides})
    model = LLaMA_adapter(args)
    params = golden_params(data)
    assign_strict(dict(model.named_parameters()), params, f"{variant}_s0.npz", "golden")
    return model, data, meta


def forward(model, data, records=None):
    tokens = jt.array(data["tokens"].astype(np.int32))
    mask = jt.array((data["labels"] != 0).astype(np.float32))  # the authors' ignore_index=0 positions
    return model(tokens, mask, records=records)


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_golden_forward_loss_router(variant):
    model, data, meta = golden_model(variant)
    records = []
    loss, logits = forward(model, data, records)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4
    assert abs(float(loss.item()) - float(data["loss"])) <= 1e-5
    for layer, record in enumerate(records):
        assert model.llama.layers[layer].type_names == meta["type_names"][layer]
        assert max_abs(record["type_weight"].numpy(), data[f"type_weights/{layer}"]) <= 1e-5
        if variant == "sparse":
            assert max_abs(record["threshold"].numpy(), data[f"thresholds/{layer}"]) <= 1e-5
            # sigmoid > 0, so a non-zero type weight is exactly a selected expert
            assert np.array_equal(record["type_weight"].numpy() > 0, data[f"selected/{layer}"] > 0)


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_golden_gradients(variant):
    model, data, meta = golden_model(variant)
    loss, _ = forward(model, data)
    adapter = model.adapter_parameters()
    assert sorted(adapter) == sorted(meta["trainable"])
    grads = dict(zip(adapter, jt.grad(loss, list(adapter.values()))))
    for name, grad in grads.items():
        ref, got = data[f"grad/{name}"], grad.numpy()
        if name in meta["grad_none"]:
            assert np.all(got == 0), f"{name}: the authors' hard step passes no gradient"
        else:
            assert max_abs(got, ref) / np.abs(ref).max() <= 1e-3, name


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_golden_kv_cache(variant):
    model, data, meta = golden_model(variant)
    model.eval()
    got = kv_logits(model.llama, data["tokens"].astype(np.int32), meta["kv_prefill"])
    assert max_abs(got, data["kv_logits"]) <= 1e-4


def test_learning_gamma_gets_gradient():
    model, data, _ = golden_model("sparse", gamma_grad="ste")
    loss, logits = forward(model, data)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4  # same forward as the authors'
    names = [n for n in model.adapter_parameters() if "adapter_threshold_fn" in n]
    grads = jt.grad(loss, [model.adapter_parameters()[n] for n in names])
    for name, grad in zip(names, grads):
        g = grad.numpy()
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_authors_adapter_import_export(variant, tmp_path):
    """Their adapter.pth ({'model': ...}, bf16 or fp32) -> ours -> theirs keeps every tensor."""
    model, data, meta = golden_model(variant)
    params = golden_params(data)
    theirs = {n: params[n] for n in meta["adapter_only_names"]}
    save_pth({"model": theirs}, tmp_path / "adapter.pth")
    import_authors_adapter(str(tmp_path / "adapter.pth"), str(tmp_path / "ours"), model.args)
    fresh = LLaMA_adapter(model.args)
    load_adapter(fresh, str(tmp_path / "ours"))
    for name, var in fresh.adapter_parameters().items():
        assert np.array_equal(var.numpy(), theirs[name]), name
    export_authors_adapter(str(tmp_path / "ours"), str(tmp_path / "back.pth"))
    from Models.torch_io import load_pth
    back = load_pth(tmp_path / "back.pth")["model"]
    assert sorted(back) == sorted(theirs) and all(np.array_equal(back[n], theirs[n]) for n in theirs)
    assert all(is_adapter_param(n) for n in back)
