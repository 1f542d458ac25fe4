"""MoA on small random configurations: zero-init equivalence, freezing, adapter files, bad input."""

import numpy as np
import pytest

from tiny_models import randomize_adapters
import jittor as jt
from Models.formats.adapters import CheckpointError, load_adapter, save_adapter
from Models.LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from Models.ModelArgs import ModelArgs
from Models.formats.pth import load_pth

BASE = dict(dim=32, n_layers=2, n_heads=4, vocab_size=61, multiple_of=16, max_seq_len=16, max_batch_size=2)
ALL_ON = dict(lora_layers="0-2", lora_rank=4, lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN",
              p_adapter_layers="0-2", p_adapter_size=8, swi_x=2)


def tokens_and_mask(seed=0, B=2, T=10):
    rng = np.random.default_rng(seed)
    return jt.array(rng.integers(0, BASE["vocab_size"], (B, T)).astype(np.int32)), jt.ones((B, T))


def copy_base(src: LLaMA_adapter, dst: LLaMA_adapter):
    for name, var in dst.base_parameters().items():
        var.assign(src.base_parameters()[name].clone())


CONFIGS = [dict(variant=v, n_kv_heads=kv, lora_targets=t, swi_x=s, expert_num=e, hydra_moe=h, p_adapter_hydra=h,
                prompt_layers=("0-2" if (p and v == "soft") else "0-0"), prompt_len=3)
           for v, kv, t, s, e, h, p in [
               ("sparse", 2, "Q,V", 0, 1, False, False),
               ("sparse", 1, "K,O,FFN_GATE", 2, 2, True, False),
               ("sparse", 4, "FFN_DOWN,Q", 3, 3, False, False),
               ("soft", 2, "Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN", 2, 1, False, True),
               ("soft", 1, "O,FFN_UP", 0, 2, False, True),
               ("soft", 4, "V", 2, 2, True, False)]]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['variant']}-kv{c['n_kv_heads']}-e{c['expert_num']}"
                         f"-h{int(c['hydra_moe'])}-x{c['swi_x']}-p{c['prompt_layers']}")
def test_configurations(config):
    args = ModelArgs(**{**BASE, **ALL_ON, **config})
    model = LLaMA_adapter(args)
    base = LLaMA_adapter(ModelArgs(**{**BASE, "n_kv_heads": config["n_kv_heads"], "variant": config["variant"]}))
    copy_base(model, base)
    tokens, mask = tokens_and_mask()
    records = []
    loss, logits = model(tokens, mask, records=records)
    assert logits.shape == [2, 10, BASE["vocab_size"]] and np.isfinite(loss.item())
    for layer, record in zip(model.llama.layers, records):
        assert record["type_weight"].shape == [2, 10, len(layer.type_names)]
        assert (record["threshold"] is None) == (config["variant"] == "soft")
    # zero-initialised experts: the adapted model is the base model
    np.testing.assert_allclose(logits.numpy(), base.llama(tokens).numpy(), atol=1e-5, rtol=0)
    randomize_adapters(model, seed=1, scale=0.3)
    _, moved = model(tokens, mask)
    assert np.isfinite(moved.numpy()).all() and np.abs(moved.numpy() - logits.numpy()).max() > 1e-3


def test_type_column_order_ignores_target_order():
    args = ModelArgs(**{**BASE, **ALL_ON, "variant": "soft", "lora_targets": "FFN_DOWN,O,Q", "prompt_layers": "1-2"})
    assert args.type_names(0) == ["Q", "O", "FFN_DOWN", "PADAPTER"]
    assert args.type_names(1) == ["Q", "PROMPT", "O", "FFN_DOWN", "PADAPTER"]


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_optimizer_step_changes_only_adapters(variant):
    extra = {"prompt_layers": "0-2", "prompt_len": 3} if variant == "soft" else {}
    model = LLaMA_adapter(ModelArgs(**{**BASE, **ALL_ON, "variant": variant, **extra}))
    before = {n: v.numpy().copy() for n, v in model.named_parameters()}
    optimizer = jt.optim.AdamW(list(model.adapter_parameters().values()), lr=1e-2)
    tokens, mask = tokens_and_mask()
    loss, _ = model(tokens, mask)
    optimizer.step(loss)
    after = {n: v.numpy() for n, v in model.named_parameters()}
    for name in before:
        if is_adapter_param(name):
            continue
        assert np.array_equal(before[name], after[name]), f"base parameter {name} moved"
    moved = [n for n in before if is_adapter_param(n) and not np.array_equal(before[n], after[n])]
    assert any("lora_B" in n for n in moved) and any("adapter_type_router" in n for n in moved)


def test_adapter_save_load_bit_exact(tmp_path):
    args = ModelArgs(**{**BASE, **ALL_ON, "variant": "soft", "prompt_layers": "0-2", "prompt_len": 3})
    model = LLaMA_adapter(args)
    randomize_adapters(model, seed=1, scale=0.3)
    save_adapter(model, str(tmp_path))
    stored = load_pth(tmp_path / "adapter.pth")
    assert sorted(stored) == sorted(model.adapter_parameters()) and all(is_adapter_param(n) for n in stored)
    fresh = LLaMA_adapter(args)
    load_adapter(fresh, str(tmp_path))
    for name, var in model.adapter_parameters().items():
        assert np.array_equal(var.numpy(), fresh.adapter_parameters()[name].numpy()), name


@pytest.mark.parametrize("change, message", [
    (dict(lora_rank=8), "lora_rank: adapter has 4, model has 8"),
    (dict(lora_targets="Q,K"), "lora_targets"),
    (dict(lora_layers="0-1"), "lora_layers"),
])
def test_adapter_from_another_configuration(tmp_path, change, message):
    model = LLaMA_adapter(ModelArgs(**{**BASE, **ALL_ON}))
    save_adapter(model, str(tmp_path))
    other = LLaMA_adapter(ModelArgs(**{**BASE, **ALL_ON, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_adapter(other, str(tmp_path))
    (tmp_path / "adapter_params.json").unlink()  # without the JSON the tensors themselves disagree
    with pytest.raises(CheckpointError, match="adapter.pth"):
        load_adapter(other, str(tmp_path))


def test_parameter_counts_per_type():
    args = ModelArgs(**{**BASE, **ALL_ON, "variant": "soft", "prompt_layers": "0-2", "prompt_len": 3})
    counts = LLaMA_adapter(args).parameter_counts()
    r, D, F = 4, 32, args.ffn_hidden_dim
    assert counts["Q"] == 2 * (r * D + D * r)
    assert counts["FFN_DOWN"] == 2 * (r * F + D * r)
    assert counts["PROMPT"] == 2 * (3 * D + 4)
    assert counts["PADAPTER"] == 2 * (8 * D + 8 + D * 8 + D)
    assert counts["total"] == sum(v for k, v in counts.items() if k not in ("total", "base"))


def test_multi_expert_names_and_start():
    """The authors' names and starting values: routers as PyTorch's default Linear, B and gates at zero."""
    args = ModelArgs(**{**BASE, **ALL_ON, "variant": "soft", "lora_targets": "Q,FFN_DOWN", "expert_num": 3,
                        "hydra_moe": True, "p_adapter_hydra": False, "prompt_layers": "0-1", "prompt_len": 2})
    params = {n[len("llama.layers.0."):]: v.numpy() for n, v in LLaMA_adapter(args).adapter_parameters().items()
              if n.startswith("llama.layers.0.") and "adapter_type_router" not in n}
    F = args.ffn_hidden_dim
    shapes = {"attention.lora_Q.router.weight": (3, 32), "attention.lora_Q.lora_A.weight": (4, 32),
              "feed_forward.lora_DOWN.router.weight": (3, F), "feed_forward.lora_DOWN.lora_A.weight": (4, F),
              "attention.prompt.weight": (6, 32), "attention.prompt_gate": (1, 4, 1, 1),
              "attention.prompt_router.weight": (3, 32), "attention.prompt_router.bias": (3,),
              "p_adapter.router.weight": (3, 32), "p_adapter.router.bias": (3,),
              **{f"attention.lora_Q.lora_B_l.{e}.weight": (32, 4) for e in range(3)},
              **{f"feed_forward.lora_DOWN.lora_B_l.{e}.weight": (32, 4) for e in range(3)},
              **{f"p_adapter.down_proj_l.{e}.{w}": s for e in range(3) for w, s in (("weight", (8, 32)), ("bias", (8,)))},
              **{f"p_adapter.up_proj_l.{e}.{w}": s for e in range(3) for w, s in (("weight", (32, 8)), ("bias", (32,)))}}
    assert {n: v.shape for n, v in params.items()} == shapes
    for name in ("attention.lora_Q.router.weight", "attention.prompt_router.weight", "attention.prompt_router.bias",
                 "p_adapter.router.weight", "p_adapter.router.bias", "feed_forward.lora_DOWN.router.weight"):
        bound = 1 / np.sqrt(F if "DOWN" in name else 32)  # uniform(+-1/sqrt(fan_in)), bias included
        assert 0 < np.abs(params[name]).max() <= bound, name
        if name.endswith("weight"):  # enough draws that the largest nears the bound (a bias has only 3)
            assert np.abs(params[name]).max() > bound / 2, name
    assert all(not params[n].any() for n in params if "lora_B_l" in n or n == "attention.prompt_gate")
    assert all(0 < np.abs(params[n]).max() < 1e-3 for n in params if "proj_l" in n and n.endswith("weight"))
