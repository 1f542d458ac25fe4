"""Every fused CPU kernel equals its plain-Jittor reference, in values and in gradients."""
import numpy as np
import pytest

import jittor as jt
from Models.Block import attention_mask
from Models.fused import LOGIT_ROWS, output_nll, rms_norm, rope, silu_gate, token_nll
from Models.fused_experts import add_projected, add_weighted, gated_projection
from Models.kernels import attention, fused_kernels_on, linear
from Models.precision import BF16Linear, base_linear, cpu_has_bf16_units
from Models.utils import rope_tables

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")


def normal(rng, shape, scale=1.0):
    return jt.array((scale * rng.standard_normal(shape)).astype(np.float32))


def assert_same(kernel, inputs, differentiable, atol, rtol=1e-6, seed=0):
    """kernel.fused(*inputs) == kernel.plain(*inputs), and so are the gradients of a random weighted sum."""
    fused, plain = kernel.fused(*inputs), kernel.plain(*inputs)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=rtol, atol=atol)
    weight = normal(np.random.default_rng(seed), fused.shape)
    wrt = [inputs[i] for i in differentiable]
    for got, want in zip(jt.grad((fused * weight).sum(), wrt), jt.grad((plain * weight).sum(), wrt)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=10 * rtol, atol=10 * atol)


# (4, 2, 150, 150, 0): causal training over three 64-query blocks of growing key spans;
# (8, 2, 1, 160, 70): a decode step that reads 71 of 160 cache rows.
@pytest.mark.parametrize("H, Hkv, T, S, start", [(4, 4, 7, 7, 0), (4, 2, 5, 12, 3), (8, 2, 1, 16, 9),
                                                 (4, 2, 150, 150, 0), (8, 2, 1, 160, 70)])
def test_attention(H, Hkv, T, S, start):
    rng = np.random.default_rng(H * 100 + T)
    q, k, v = (normal(rng, shape) for shape in [(2, T, H, 8), (2, S, Hkv, 8), (2, S, Hkv, 8)])
    assert_same(attention, [q, k, v, jt.array(attention_mask(T, S, start))], [0, 1, 2], atol=2e-6)


def test_rope():
    rng = np.random.default_rng(3)
    cos, sin = (jt.array(t[4:9]) for t in rope_tables(8, 16, 500000.0, False))  # positions 4..8
    assert_same(rope, [normal(rng, (2, 5, 3, 8)), cos, sin], [0], atol=1e-6)


def test_token_nll():
    rng = np.random.default_rng(4)
    targets = jt.array(rng.integers(0, 11, (2, 3)).astype(np.int32))
    assert_same(token_nll, [normal(rng, (2, 3, 11), 3.0), targets], [0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_output_nll_in_chunks(dtype):
    """The loss through the output matrix, LOGIT_ROWS rows of logits at a time (three chunks, the
    last partial), equals the loss of the whole [B,T,V] logits, in values and in the gradient."""
    rng = np.random.default_rng(10)
    B, T, D, V = 2, LOGIT_ROWS + 7, 16, 1100
    weight = normal(rng, (V, D), 0.5).cast(dtype).stop_grad()
    targets = jt.array(rng.integers(0, V, (B, T)).astype(np.int32))
    assert_same(output_nll, [normal(rng, (B, T, D)), weight, targets], [0], atol=2e-5, rtol=1e-5)


def test_silu_gate():
    rng = np.random.default_rng(5)
    assert_same(silu_gate, [normal(rng, (2, 7, 13), 3.0), normal(rng, (2, 7, 13), 3.0)], [0, 1], atol=1e-6)


def test_rms_norm():
    rng = np.random.default_rng(6)
    scale = jt.array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32)).stop_grad()
    assert_same(rms_norm, [normal(rng, (3, 5, 16)), scale, 1e-5], [0], atol=1e-6)
    assert not rms_norm.when(normal(rng, (3, 5, 16)), jt.ones(16), 1e-5), "a trainable norm weight needs the plain path"


def test_add_weighted():
    rng = np.random.default_rng(7)
    router_weight = jt.array(rng.random((2, 5)).astype(np.float32))
    assert_same(add_weighted, [normal(rng, (2, 5, 12)), normal(rng, (2, 5, 12)), router_weight, 0.5], [0, 1, 2],
                atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_add_projected(bias):
    rng = np.random.default_rng(11)
    router_weight = jt.array(rng.random((2, 5)).astype(np.float32))
    inputs = [normal(rng, (2, 5, 12)), normal(rng, (2, 5, 3)), normal(rng, (12, 3)),
              normal(rng, (12,)) if bias else None, router_weight, 0.5]
    assert_same(add_projected, inputs, [0, 1, 2, 4] + ([3] if bias else []), atol=1e-5, rtol=1e-5)


def test_gated_projection():
    """Both outputs (the SwiGLU hidden and its low-rank projection) and the gradients through both."""
    rng = np.random.default_rng(12)
    inputs = [normal(rng, (2, 5, 13), 3.0), normal(rng, (2, 5, 13), 3.0), normal(rng, (4, 13))]
    fused, plain = gated_projection.fused(*inputs), gated_projection.plain(*inputs)
    weights = [normal(rng, out.shape) for out in plain]
    for got, want in zip(fused, plain):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    for used in [(0,), (1,), (0, 1)]:  # the hidden alone, the projection alone, both
        loss = [sum((outputs[i] * weights[i]).sum() for i in used) for outputs in (fused, plain)]
        for got, want in zip(jt.grad(loss[0], inputs), jt.grad(loss[1], inputs)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, bias, trains", [((2, 5, 12), True, True), ((7, 12), False, True),
                                                 ((2, 3, 12), False, False)])
def test_linear(shape, bias, trains):
    rng = np.random.default_rng(10)
    weight = normal(rng, (9, 12))
    inputs = [normal(rng, shape), weight if trains else weight.stop_grad()] + ([normal(rng, (9,))] if bias else [])
    assert_same(linear, inputs, range(len(inputs)) if trains else [0], atol=1e-5, rtol=1e-5)


def bf16_weight(rng, shape):
    return normal(rng, shape, 0.1).bfloat16().stop_grad()


# 3 rows: the per-thread panel path of decoding (N=150 is two full 64-row panels and a partial one);
# 2 x 40 = 80 rows: the path of training and prefill, widening 1024 weight rows at a time (N=2100:
# two full panels and a partial one, the backward summing over them).
@pytest.mark.parametrize("shape, N", [((3, 96), 150), ((2, 40, 96), 150), ((2, 40, 96), 2100)])
def test_bf16_linear(shape, N):
    rng = np.random.default_rng(8)
    x, weight = normal(rng, shape), bf16_weight(rng, (N, 96))
    assert base_linear.when(x, weight) and not base_linear.when(x, weight.float32())
    # fp32 products of the stored bf16 weights: as close as two fp32 summation orders
    assert_same(base_linear, [x, weight], [0], atol=2e-5, rtol=1e-5)
    widened = x.numpy().reshape(-1, 96).astype(np.float64) @ weight.float32().numpy().astype(np.float64).T
    np.testing.assert_allclose(base_linear.fused(x, weight).numpy().reshape(widened.shape), widened, atol=2e-5)


@pytest.mark.skipif(not cpu_has_bf16_units(), reason="this CPU has no bf16 units (avx512_bf16 / amx_bf16)")
def test_bf16_linear_on_bf16_units():
    """oneDNN's gemm_bf16bf16f32 rounds the input to bf16 (as torch's autocast does): bf16-level agreement."""
    rng = np.random.default_rng(9)
    x, weight = normal(rng, (80, 96)), bf16_weight(rng, (150, 96))
    fused, plain = BF16Linear(units=True)(x, weight), base_linear.plain(x, weight)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=2e-2, atol=2e-2)
    out_weight = normal(rng, (80, 150))
    got, = jt.grad((fused * out_weight).sum(), [x])
    want, = jt.grad((plain * out_weight).sum(), [x])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-2, atol=2e-2)
