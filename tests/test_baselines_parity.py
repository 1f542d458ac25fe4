"""The paper's baselines against the authors' PyTorch outputs (tests/golden/baselines/, see its README):
logits, loss and its load-balancing part, every router output, gradients, and the KV-cache path."""
import numpy as np
import pytest

from conftest import BASELINE_FILES, assert_golden_gradients, golden_forward, golden_model, kv_logits, max_abs

LEVELS = {"soft_moe": "token", "sparse_moe": "token", "instance": "sequence", "unipeft": "sequence"}


def expert_keys(data, layer, family):
    """The expert-router arrays a golden file holds for one module: {output name: array}."""
    suffix = f"/{layer}/{family}"
    return {k[:-len(suffix)]: data[k] for k in data.files if k.endswith(suffix) and not k.startswith("aux_loss")}


@pytest.mark.parametrize("name", BASELINE_FILES)
def test_baseline_forward_loss_routers(name):
    model, data, meta = golden_model(f"baselines/{name}")
    records = []
    loss, logits = golden_forward(model, data, records)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4
    assert abs(float(loss.item()) - float(data["loss"])) <= 1e-5
    compared = set()
    if "aux_loss" in data.files:
        parts = model.last_loss_parts
        assert abs(float(parts["ce"].item()) - float(data["ce_loss"])) <= 1e-5
        assert abs(float(parts["aux"].item()) - float(data["aux_loss"])) <= 1e-5 * max(1.0, float(data["aux_loss"]))
    for layer, record in enumerate(records):
        if LEVELS[meta["variant"]] == "sequence":
            prefix = "type" if meta["variant"] == "instance" else "gate"
            ours = {"pooled": "pooled", "router_logits": f"{'router' if prefix == 'type' else 'gate'}_logits",
                    "sequence_gates": f"{prefix}_weights"}
            for key, golden_key in ours.items():
                assert max_abs(record[key].numpy(), data[f"{golden_key}/{layer}"]) <= 1e-5, (key, layer)
                compared.add(f"{golden_key}/{layer}")
        for key, family_outputs in record.items():
            if not isinstance(family_outputs, dict) or key == "aux_loss":
                continue
            for family, value in family_outputs.items():
                ref = expert_keys(data, layer, family)
                if key == "topk_indices":  # a set per token
                    assert np.array_equal(np.sort(value.numpy(), -1), np.sort(ref[key], -1)), (layer, family)
                elif key in ref:
                    assert max_abs(value.numpy(), ref[key]) <= 1e-5, (key, layer, family)
                else:
                    continue
                compared.add(f"{key}/{layer}/{family}")
        for family, value in record.get("aux_loss", {}).items():
            ref = float(data[f"aux_loss_modules/{layer}/{family}"])
            assert abs(float(value.item()) - ref) <= 1e-5 * max(1.0, abs(ref))
            compared.add(f"aux_loss_modules/{layer}/{family}")
    # topk_weights and topk_margin are expert_weights and expert_probs read at topk_indices
    router_keys = {k for k in data.files if "/" in k and not k.startswith(("param/", "grad/", "kv_", "topk_weights",
                                                                           "topk_margin"))}
    assert router_keys <= compared, sorted(router_keys - compared)
    assert router_keys or meta["expert_num"] == 1, "a mixture whose routers the file does not hold"


@pytest.mark.parametrize("name", BASELINE_FILES)
def test_baseline_gradients(name):
    model, data, meta = golden_model(f"baselines/{name}")
    loss, _ = golden_forward(model, data)
    assert_golden_gradients(model, loss, data, meta)
    for param in meta["grad_none"]:  # UniPEFT's p_adapter_gate: never read, so never updated
        assert not model.adapter_parameters()[param].requires_grad, param


@pytest.mark.parametrize("name", BASELINE_FILES)
def test_baseline_kv_cache(name):
    """Token-level methods: the KV path equals the full forward. Sequence-level ones: the gates of
    the 6-token prefill are kept for every decode step, so the KV logits are the authors' KV logits."""
    model, data, meta = golden_model(f"baselines/{name}")
    model.eval()
    got = kv_logits(model.llama, data["tokens"].astype(np.int32), meta["kv_prefill"])
    assert max_abs(got, data["kv_logits"]) <= 1e-4
    if LEVELS[meta["variant"]] == "sequence":
        assert max_abs(got, data["logits"][:, meta["kv_prefill"] - 1:]) > 0.1  # the prefill's gates, not the full mean's
        prefix = "kv_type" if meta["variant"] == "instance" else "kv_gate"
        for layer, block in enumerate(model.llama.layers):
            assert max_abs(block._sequence_gates.numpy(), data[f"{prefix}_weights/{layer}"]) <= 1e-5
