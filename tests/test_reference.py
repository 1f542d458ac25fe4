"""Models/reference.py, one MoA layer in plain Jittor ops read top to bottom, equals the model's layer
(its kernels) in values and in the adapters' gradients."""
import numpy as np
import pytest

from tiny_models import randomize_adapters
import jittor as jt

from Models.Block import attention_mask
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs
from Models.reference import moa_layer, type_weights
from Models.rope import rope_tables

ALL = "Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN"
MOA = {"sparse": dict(variant="sparse", lora_targets=ALL, p_adapter_layers="0-1"),
       "sparse_linear_router": dict(variant="sparse", lora_targets="Q,V,FFN_DOWN", swi_x=0),
       "soft": dict(variant="soft", lora_targets=ALL, p_adapter_layers="0-1", prompt_layers="0-1"),
       # Qwen3's block: per-head q/k norms after the experts, head_dim its own setting
       "soft_qwen3": dict(variant="soft", lora_targets=ALL, prompt_layers="0-1", architecture="qwen3", qk_norm=True,
                          head_dim=24)}


@pytest.mark.parametrize("name", list(MOA))
def test_reference_layer_equals_the_model(name):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32, max_seq_len=16,
                     lora_layers="0-1", lora_rank=4, prompt_len=3, **MOA[name])
    jt.set_global_seed(0)  # the base's random start
    model = LLaMA_adapter(args)
    randomize_adapters(model, seed=3, scale=0.3)
    block = model.llama.layers[0]
    rng = np.random.default_rng(4)
    norms = [block.attention_norm, block.ffn_norm] + [n for n in (block.attention.q_norm, block.attention.k_norm) if n]
    for norm in norms:
        norm.weight.assign(jt.array((1 + 0.2 * rng.standard_normal(norm.weight.shape)).astype(np.float32)))
    x = jt.array(rng.standard_normal((2, 12, 64)).astype(np.float32))
    cos, sin = (jt.array(t[:12]) for t in rope_tables(args.head_dim, 32, 500000.0))
    mask = jt.array(attention_mask(12, 12, 0))
    got, want = block(x, cos, sin, mask), moa_layer(block, x, cos, sin, mask)
    weights = np.concatenate([w.numpy() for w in type_weights(block, x).values()], -1)
    if args.variant == "sparse":  # the selection acts: some families are off, not all
        assert 0 < (weights == 0).sum() < weights.size
    # the same sums in another order: equal to fp32 rounding of the largest terms
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5 * np.abs(want.numpy()).max())
    out_grad = jt.array(rng.standard_normal(got.shape).astype(np.float32))
    params = [p for n, p in model.adapter_parameters().items() if "threshold" not in n]  # the step gives Gamma none
    for got_grad, want_grad in zip(jt.grad((got * out_grad).sum(), params), jt.grad((want * out_grad).sum(), params)):
        scale = np.abs(want_grad.numpy()).max()
        assert scale > 0
        np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), rtol=1e-4, atol=1e-5 * scale)
