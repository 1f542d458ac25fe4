"""The CPU kernels (oneDNN attention, fused elementwise passes) equal plain Jittor ops, values and gradients."""
import numpy as np
import pytest

import jittor as jt
from Models.Block import attention_mask
from Models.kernels import FusedAttention, onednn_available, reference_attention
from jittor import nn

pytestmark = pytest.mark.skipif(not onednn_available(), reason="oneDNN kernels are off (no libdnnl or a GPU run)")


# (4, 2, 150, 150, 0): causal training over three 64-query blocks of growing key spans;
# (8, 2, 1, 160, 70): a decode step that reads 71 of 160 cache rows.
@pytest.mark.parametrize("H, Hkv, T, S, start", [(4, 4, 7, 7, 0), (4, 2, 5, 12, 3), (8, 2, 1, 16, 9),
                                                 (4, 2, 150, 150, 0), (8, 2, 1, 160, 70)])
def test_fused_attention_matches_reference(H, Hkv, T, S, start):
    rng = np.random.default_rng(H * 100 + T)
    q, k, v = (jt.array(rng.standard_normal(shape).astype(np.float32))
               for shape in [(2, T, H, 8), (2, S, Hkv, 8), (2, S, Hkv, 8)])
    mask = jt.array(attention_mask(T, S, start))
    weight = jt.array(rng.standard_normal((2, T, H, 8)).astype(np.float32))
    fused = FusedAttention.apply(q, k, v, mask)
    plain = reference_attention(q, k, v, mask)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), atol=2e-6)
    for got, want in zip(jt.grad((fused * weight).sum(), [q, k, v]), jt.grad((plain * weight).sum(), [q, k, v])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)


def test_fused_rope_matches_reference():
    from Models.fused import Rope
    from Models.utils import rope_reference, rope_tables
    rng = np.random.default_rng(3)
    x = jt.array(rng.standard_normal((2, 5, 3, 8)).astype(np.float32))
    cos, sin = (jt.array(t[4:9]) for t in rope_tables(8, 16, 500000.0, False))  # positions 4..8
    plain = rope_reference(x, cos, sin)
    fused = Rope.apply(x, cos, sin)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), atol=1e-6)
    weight = jt.array(rng.standard_normal((2, 5, 3, 8)).astype(np.float32))
    got, = jt.grad((fused * weight).sum(), [x])
    want, = jt.grad((plain * weight).sum(), [x])
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)


def test_fused_cross_entropy_matches_log_softmax():
    from Models.fused import CrossEntropyRows
    rng = np.random.default_rng(4)
    logits = jt.array((3 * rng.standard_normal((6, 11))).astype(np.float32))
    targets = jt.array(rng.integers(0, 11, 6).astype(np.int32))
    weight = jt.array(rng.random(6).astype(np.float32))
    fused = CrossEntropyRows.apply(logits, targets)
    plain = -jt.gather(nn.log_softmax(logits, dim=-1), 1, targets.unsqueeze(-1)).squeeze(-1)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), atol=1e-5)
    got, = jt.grad((fused * weight).sum(), [logits])
    want, = jt.grad((plain * weight).sum(), [logits])
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)


def test_fused_silu_gate_matches_reference():
    from Models.fused import SiluGate
    rng = np.random.default_rng(5)
    gate, up, weight = (jt.array((3 * rng.standard_normal((2, 7, 13))).astype(np.float32)) for _ in range(3))
    fused = SiluGate.apply(gate, up)
    plain = nn.silu(gate) * up
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)
    for got, want in zip(jt.grad((fused * weight).sum(), [gate, up]), jt.grad((plain * weight).sum(), [gate, up])):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_fused_rms_norm_matches_reference():
    from Models.fused import FrozenRMSNorm
    rng = np.random.default_rng(6)
    x, weight_out = (jt.array(rng.standard_normal((3, 5, 16)).astype(np.float32)) for _ in range(2))
    scale = jt.array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32))
    fused = FrozenRMSNorm.apply(x, scale, 1e-5)
    plain = x * jt.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)
    got, = jt.grad((fused * weight_out).sum(), [x])
    want, = jt.grad((plain * weight_out).sum(), [x])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_fused_add_weighted_matches_reference():
    from Models.fused import AddWeighted
    rng = np.random.default_rng(7)
    base, delta, weight_out = (jt.array(rng.standard_normal((2, 5, 12)).astype(np.float32)) for _ in range(3))
    router_weight = jt.array(rng.random((2, 5)).astype(np.float32))
    fused = AddWeighted.apply(base, delta, router_weight, 0.5)
    plain = base + delta * 0.5 * router_weight.unsqueeze(-1)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-6, atol=1e-6)
    inputs = [base, delta, router_weight]
    for got, want in zip(jt.grad((fused * weight_out).sum(), inputs), jt.grad((plain * weight_out).sum(), inputs)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
