"""Every fused CPU kernel equals its plain-Jittor reference, in values and in gradients."""
import numpy as np
import pytest

from kernel_inputs import normal, stored
import jittor as jt
from Models.Block import attention_mask
from Models.kernels import cpp, elementwise
from Models.kernels.elementwise import logit_rows, output_nll, rms_norm, rope, silu_gate
from Models.kernels.experts import add_projected, add_weighted, gated_projection
from Models.kernels.attention import attention, prompt_attention
from Models.kernels.switch import DECODE_ROWS, GEMV_ROWS, decoding, fused_kernels_on
from Models.kernels.linear import linear
from Models.Routing import Gamma, swiglu_router, type_router, type_weights
from Models.kernels.bf16 import BF16Linear, bf16_linear, cast_to, cpu_has_bf16_units, to_bf16
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits
from Models.rope import rope_tables

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")


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


@pytest.mark.parametrize("T, S, start", [(1, 16, 9), (3, 160, 70)])
def test_attention_reads_a_bf16_cache_as_it_is(T, S, start):
    """A decode step over a bf16 KV cache widens, per head, only the keys it reads: the plain path's values."""
    rng = np.random.default_rng(T + S)
    q = normal(rng, (2, T, 8, 8))
    k, v = (to_bf16(normal(rng, (2, S, 2, 8))) for _ in range(2))
    mask = jt.array(attention_mask(T, S, start))
    with jt.no_grad():
        got, want = attention.fused(q, k, v, mask, True), attention.plain(q, k, v, mask, True)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-6)


# 2 x 5 rows: a decode step's loops; 2 x 20 rows: one sgemm per head over the batch's rows
@pytest.mark.parametrize("T, H, Hkv, L", [(5, 8, 4, 10), (5, 4, 4, 3), (20, 8, 4, 10)])
def test_prompt_attention(T, H, Hkv, L):
    """Attention to L prompt keys/values shared by the batch (Soft MoA's prompt expert), under its
    per-head gate and its type weight (or none), added to the causal attention's output."""
    rng = np.random.default_rng(H + L)
    q, k, v = normal(rng, (2, T, H, 8)), normal(rng, (L, Hkv * 8)), normal(rng, (L, Hkv * 8))
    gate, type_weight, base = normal(rng, (H,)), jt.array(rng.random((2, T)).astype(np.float32)), normal(rng, q.shape)
    assert_same(prompt_attention, [q, k, v, gate, type_weight, base], [0, 1, 2, 3, 4, 5], atol=2e-6)
    assert_same(prompt_attention, [q, k, v, gate, None, base], [0, 1, 2, 3, 5], atol=2e-6)


def test_rope():
    rng = np.random.default_rng(3)
    cos, sin = (jt.array(t[4:9]) for t in rope_tables(8, 16, 500000.0))  # positions 4..8
    assert_same(rope, [normal(rng, (2, 5, 3, 8)), cos, sin], [0], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_output_nll_in_chunks(dtype, monkeypatch):
    """The loss through the output matrix, 64 rows of logits at a time (three chunks, the last
    partial), equals the loss of the whole [B,T,V] logits, in values (also under no_grad, which makes
    no gradient) and in the gradient, which the forward makes before the loss weight scales it."""
    rng = np.random.default_rng(10)
    B, T, D, V = 2, 64 + 7, 16, 1100
    monkeypatch.setattr(elementwise, "LOGIT_BYTES", 64 * 4 * V)
    assert logit_rows(V) == 64
    weight, scale = stored(normal(rng, (V, D), 0.5), dtype)
    targets = jt.array(rng.integers(0, V, (B, T)).astype(np.int32))
    h = normal(rng, (B, T, D))
    if dtype == "float32":
        assert_same(output_nll, [h, weight, targets, scale], [0], atol=2e-5, rtol=1e-5)
    with jt.no_grad():
        np.testing.assert_allclose(output_nll.fused(h, weight, targets, scale).numpy(),
                                   output_nll.plain(h, weight, targets, scale).numpy(), rtol=1e-5, atol=2e-5)
    if dtype != "float32":  # softmax - onehot (times an int8 matrix's row scales) is rounded to bf16 before
        # the loss weight scales it
        loss_weight = normal(rng, (B, T))
        got, = jt.grad((output_nll.fused(h, weight, targets, scale) * loss_weight).sum(), [h])
        w64, h64 = weight.float32().numpy().astype(np.float64), rounded(h.numpy().reshape(-1, D))
        s64 = np.ones(V) if scale is None else scale.numpy().astype(np.float64)
        logits = (h64 @ w64.T) * s64
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        probs[np.arange(B * T), targets.numpy().reshape(-1)] -= 1
        want = (rounded(probs * s64) @ w64) * loss_weight.numpy().reshape(-1, 1)
        np.testing.assert_allclose(got.numpy().reshape(-1, D), want, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_plain_output_nll_in_chunks_equals_the_whole_logits(dtype, monkeypatch):
    """The plain loss (a GPU's), 64 rows of logits at a time with each chunk's gradient made by autograd in the
    forward, equals Jittor's ops on the whole [B*T,V] logits in values and in the gradient, which the loss weight
    scales after (as the fused loss's: with a bf16 or int8 matrix, after the rounding of the backward's product)."""
    rng = np.random.default_rng(11)
    B, T, D, V = 2, 64 + 7, 16, 1100
    monkeypatch.setattr(elementwise, "LOGIT_BYTES", 64 * 4 * V)
    weight, scale = stored(normal(rng, (V, D), 0.5), dtype)
    targets = jt.array(rng.integers(0, V, (B, T)).astype(np.int32))
    h, loss_weight = normal(rng, (B, T, D)), normal(rng, (B, T))

    def whole(h):
        return elementwise.rows_nll(h.reshape(B * T, D), weight, targets.reshape(B * T), scale).reshape(B, T)
    got, want = output_nll.plain(h, weight, targets, scale), whole(h)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(want.numpy()).min() > 0.1
    got_grad, = jt.grad((output_nll.plain(h, weight, targets, scale) * loss_weight).sum(), [h])
    want_grad = jt.grad(whole(h).sum(), [h])[0] * loss_weight.unsqueeze(-1)  # each row's nll reads its own h
    np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(want_grad.numpy()).max() > 0.1


def test_silu_gate():
    rng = np.random.default_rng(5)
    assert_same(silu_gate, [normal(rng, (2, 7, 13), 3.0), normal(rng, (2, 7, 13), 3.0)], [0, 1], atol=1e-6)


def test_swiglu_past_exp_range():
    """Gates below about -88 (exp(-g) is inf there) give a SwiGLU of 0, not NaN: the FFN's and the router's."""
    g = np.tile(np.array([-300, -120, -89, -60, 0, 60, 120, 300], np.float32), (4, 8))  # [4, 64]: the vector loop
    pair = [jt.array(g), jt.array(np.full(g.shape, 2.0, np.float32))]
    assert np.isfinite(silu_gate.fused(*pair).numpy()).all()
    assert_same(silu_gate, pair, [0, 1], atol=1e-6)
    # the gate's gradient u s (1 + g e s), e = exp(-g), against float64 up to gates of 3e7 (1 - s taken as
    # 1 - a rounded s was off by g 2^-24 relative: 2.8 times the gradient at 3e7)
    g = np.array([-3e7, -2e3, -40, -1, 0.5, 30, 2e3, 4.1e4, 3e7], np.float32).repeat(8).reshape(3, 24)
    gate, up = jt.array(g), jt.array(np.full(g.shape, 1.5, np.float32))
    got = jt.grad(silu_gate.fused(gate, up).sum(), gate).numpy()
    g64 = g.astype(np.float64)
    s = 1 / (1 + np.exp(np.minimum(-g64, 700)))
    np.testing.assert_allclose(got, 1.5 * s * (1 + g64 * (1 - s)), rtol=1e-6, atol=1e-20)
    rng = np.random.default_rng(16)
    params = [normal(rng, shape, 0.3) for shape in [(12, 32), (12,), (12, 32), (12,), (5, 12), (5,)]]
    x = normal(rng, (40, 32), 100.0)  # router gates of several hundred, both signs
    fused, plain = swiglu_router.fused(x, *params).numpy(), swiglu_router.plain(x, *params).numpy()
    assert np.isfinite(fused).all()
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_rms_norm():
    rng = np.random.default_rng(6)
    scale = jt.array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32)).stop_grad()
    assert_same(rms_norm, [normal(rng, (3, 5, 16)), scale, 1e-5], [0], atol=1e-6)
    assert not rms_norm.when(normal(rng, (3, 5, 16)), jt.ones(16), 1e-5), "a trainable norm weight needs the plain path"


@pytest.mark.parametrize("n, read", [(2, (0, 1, 2)), (1, (0, 1)), (2, (1, 2)), (2, (0, 2))])
def test_branches_sum_their_gradients(n, read):
    """rms_norm_branches and branches: their outputs and, summed in their own backward, the gradients
    of whichever outputs are read (a method without routing leaves the router's branch unread)."""
    rng = np.random.default_rng(9)
    x = normal(rng, (3, 5, 16))
    scale = jt.array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32)).stop_grad()
    weights = [normal(rng, (3, 5, 16)) for _ in range(n + 1)]
    cases = [(elementwise.rms_norm_branches, (x, scale, 1e-5, n)), (elementwise.branches, (x, n + 1))]
    for kernel, args in cases:
        results = []
        for run in (kernel.fused, kernel.plain):
            outs = run(*args)
            assert len(outs) == n + 1
            loss = sum((outs[i] * weights[i]).sum() + (outs[i] ** 2).sum() for i in read)
            results.append([o.numpy() for o in outs] + [jt.grad(loss, x).numpy()])
        for got, want in zip(*results):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(results[0][-1]).max() > 1.0


def test_residual_add():
    rng = np.random.default_rng(10)
    assert_same(elementwise.residual_add, [normal(rng, (2, 5, 12)), normal(rng, (2, 5, 12))], [0, 1], atol=1e-6)


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


@pytest.mark.parametrize("bf16", [False, True])
def test_gated_projection(bf16):
    """Both outputs (the SwiGLU hidden and its low-rank projection) and the gradients through both; with
    bf16, gate and up kept as bf16 bits, against the plain form on their rounded values."""
    rng = np.random.default_rng(12)
    inputs = [normal(rng, (2, 5, 13), 3.0), normal(rng, (2, 5, 13), 3.0), normal(rng, (4, 13))]
    fused, plain = gated_projection.fused(*inputs, bf16), gated_projection.plain(*inputs, bf16)
    if bf16:  # the rounding shows: 3.0-scale values move by up to 2^-8 of themselves
        assert np.abs(plain[0].numpy() - gated_projection.plain(*inputs)[0].numpy()).max() > 1e-3
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_gemv_at_every_row_count(dtype):
    """The GEMV pass (cpp/gemv.h) from 1 to GEMV_ROWS + 4 rows, in one op: each compiled pass (1, 2, 4, 8 and
    16 rows), the row counts it pads between them, and a second pass; fp32, bf16 and int8 weights."""
    rng = np.random.default_rng(11)
    N, K = 13, 100  # blocks of 4, 2 or 1 weight rows and a rest; 6 steps of 16 columns and a rest of 4
    weight = jt.array(rng.integers(-127, 128, (N, K)).astype(np.int8)) if dtype == "int8" else \
        cast_to(normal(rng, (N, K)), dtype)
    ctype = {"float32": "float", "bfloat16": "uint16_t", "int8": "int8_t"}[dtype]
    w64 = weight.float32().numpy().astype(np.float64)
    for M in range(1, GEMV_ROWS + 5):
        x = normal(rng, (M, K))
        numbers = cpp.Numbers().declare(M=M, N=N, K=K)
        y = jt.code((M, N), "float32", [x, weight], cpu_header=cpp.source("linear.h"), data=numbers.data,
                    cpu_src=numbers.code + f"gemv(M, N, K, in0_p, (const {ctype} *)in1_p, out0_p);")
        np.testing.assert_allclose(y.numpy(), x.numpy() @ w64.T, rtol=1e-5, atol=1e-4, err_msg=f"{M} rows")


def bf16_weight(rng, shape):
    return to_bf16(normal(rng, shape, 0.1)).stop_grad()


def rounded(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as float64."""
    return bf16_bits_to_float32(float32_to_bf16_bits(a.astype(np.float32))).astype(np.float64)


def test_to_bf16_rounds_to_nearest_even():
    x = np.random.default_rng(7).standard_normal(10000).astype(np.float32)
    ties = (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # halfway between two bf16
    x = np.concatenate([x, ties, -ties, [0.0, -0.0, np.inf, -np.inf]]).astype(np.float32)
    want = float32_to_bf16_bits(x)
    np.testing.assert_array_equal(to_bf16(jt.array(x)).float32().numpy().view(np.uint32) >> 16, want)
    np.testing.assert_array_equal(cast_to(jt.array(x), "bfloat16").float32().numpy(), bf16_bits_to_float32(want))


units_choices = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_has_bf16_units(), reason="this CPU has no bf16 units (avx512_bf16 / amx_bf16)"))]


# 3 rows: the per-thread panel path of decoding (N=150 is two full 64-row panels and a partial one);
# 2 x 40 = 80 rows: the path of training and prefill, widening 1024 weight rows at a time (N=2100:
# two full panels and a partial one, the backward summing over them). units: oneDNN's
# gemm_bf16bf16f32 on the CPU's bf16 units, else sgemm on widened panels; one rule for both.
@pytest.mark.parametrize("units", units_choices)
@pytest.mark.parametrize("shape, N", [((3, 96), 150), ((2, 40, 96), 150), ((2, 40, 96), 2100)])
def test_bf16_linear(shape, N, units):
    """The input (and, backwards, the gradient) rounded to bf16, products of bf16 values summed in
    fp32: the same as the plain reference and as float64 on the rounded operands, to fp32 summation."""
    rng = np.random.default_rng(8)
    x, weight = normal(rng, shape), bf16_weight(rng, (N, 96))
    flat = x.reshape(-1, 96)
    fused, plain = BF16Linear(units=units)(flat, weight), bf16_linear.plain(flat, weight)
    w64 = weight.float32().numpy().astype(np.float64)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(fused.numpy(), rounded(flat.numpy()) @ w64.T, rtol=1e-5, atol=2e-5)
    out_grad = normal(rng, fused.shape)
    got, = jt.grad((fused * out_grad).sum(), [flat])
    want, = jt.grad((plain * out_grad).sum(), [flat])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got.numpy(), rounded(out_grad.numpy()) @ w64, rtol=1e-5, atol=2e-5)


# A decode step's 17-64 rows, or 5-16 on the bf16 units (cpp/bf16_rows.h): M = 17, 33, 64, 6 (tiles of 5
# rows and a rest of 2, 3, 4 or 1), N = 13, 50 and 7 (blocks of 5 weight rows and single rows), K = 100
# (three 32-column steps and a rest of 4), 160, and 4200 (two chunks of 4096 columns, the second
# prefetched during the first, partial)
@pytest.mark.parametrize("units", units_choices)
@pytest.mark.parametrize("M, N, K", [(17, 13, 100), (33, 50, 160), (64, 7, 4200), (6, 13, 4200)])
def test_bf16_rows(M, N, K, units):
    """A decode step's bf16 product of more rows than a GEMV pass (on the bf16 units, from 5 rows): the
    bf16 rule, on the units (dot products of bf16 pairs) and without them (widened weights), as the plain
    reference and float64 on the rounded operands give it, to fp32 summation; with a gradient the same op
    takes training's path."""
    rng = np.random.default_rng(M + K)
    x, weight = normal(rng, (M, K)), bf16_weight(rng, (N, K))
    want = rounded(x.numpy()) @ weight.float32().numpy().astype(np.float64).T
    with jt.no_grad():
        assert decoding(x, weight) and not decoding(normal(rng, (DECODE_ROWS + 1, K)), weight)
        fused, plain = BF16Linear(units=units)(x, weight), bf16_linear.plain(x, weight)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(fused.numpy(), want, rtol=1e-5, atol=1e-4)
    training = BF16Linear(units=units)(x, weight).numpy()  # oneDNN's gemm or widened panels
    np.testing.assert_allclose(training, want, rtol=1e-5, atol=1e-4)
    if units or M > GEMV_ROWS:  # without the units 6 rows take the GEMV pass either way
        assert not np.array_equal(training, fused.numpy())  # another summation order: another kernel ran


@pytest.mark.parametrize("units", units_choices)
def test_bf16_attention(units, monkeypatch):
    """Attention of a bf16 base (training, prefill): q, k, v and the probabilities rounded to bf16, sums
    in fp32 (float64 on the rounded operands gives the same but where a probability rounds the other
    way); backwards the same rule on the units and without them, and within bf16's rounding of the
    fp32 gradients."""
    import Models.kernels.attention as attention_module
    monkeypatch.setattr(attention_module, "cpu_has_bf16_units", lambda: units)
    rng = np.random.default_rng(16)
    B, T, H, Hkv, hd = 2, 150, 4, 2, 8  # causal over three 64-query blocks, grouped kv heads
    q, k, v = (normal(rng, shape) for shape in [(B, T, H, hd), (B, T, Hkv, hd), (B, T, Hkv, hd)])
    mask = jt.array(attention_mask(T, T, 0))
    out = attention.fused(q, k, v, mask, True)
    qr, kr, vr = (np.repeat(rounded(t.numpy()), H // Hkv, axis=2) if t is not q else rounded(t.numpy()) for t in (q, k, v))
    scores = np.einsum("bthd,bshd->bhts", qr, kr) / np.sqrt(hd) + attention_mask(T, T, 0)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", rounded(probs.astype(np.float32)), vr)
    # a probability next to a bf16 rounding boundary may round the other way from its float64 twin
    off = np.abs(out.numpy() - want) > 2e-5 + 1e-4 * np.abs(want)
    assert off.mean() < 0.01 and np.abs(out.numpy() - want).max() < 2e-3
    out_grad = normal(rng, out.shape)
    grads = jt.grad((out * out_grad).sum(), [q, k, v])
    monkeypatch.setattr(attention_module, "cpu_has_bf16_units", lambda: not units)
    other = jt.grad((attention.fused(q, k, v, mask, True) * out_grad).sum(), [q, k, v])
    fp32 = jt.grad((attention.fused(q, k, v, mask, False) * out_grad).sum(), [q, k, v])
    for got, same_rule, exact in zip(grads, other, fp32):
        if cpu_has_bf16_units():  # the units path exists: both routes give one rule's numbers, summed in other
            # orders, so an fp32 intermediate next to a bf16 boundary (dP, dS) rounds either way at times: within
            # fp32 summation but for under 1% of the elements, and those within a bf16 ulp of the largest gradient
            off = np.abs(got.numpy() - same_rule.numpy()) > 2e-5 + 1e-4 * np.abs(same_rule.numpy())
            assert off.mean() < 0.01
            np.testing.assert_allclose(got.numpy(), same_rule.numpy(), atol=2.0 ** -8 * np.abs(exact.numpy()).max())
        np.testing.assert_allclose(got.numpy(), exact.numpy(), rtol=0.05, atol=0.05)
        assert np.abs(got.numpy() - exact.numpy()).max() > 0  # rounded, not the fp32 products


@pytest.mark.parametrize("rows", [(2, 40), (3, 1)])
def test_swiglu_router(rows):
    """The SwiGLU type router as one op each way: logits and the gradients of x and all six parameters."""
    rng = np.random.default_rng(15)
    params = [normal(rng, shape, 0.3) for shape in [(12, 32), (12,), (12, 32), (12,), (5, 12), (5,)]]
    assert_same(swiglu_router, [normal(rng, (*rows, 32))] + params, list(range(7)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("swi_x, threshold", [(4, "learned"), (0, "learned"), (4, "const"), (4, None)])
def test_type_weights(swi_x, threshold):
    """A decode step's routing in one op: router, sigmoid, Gamma and the Sparse selection."""
    rng = np.random.default_rng(13)
    router = type_router(32, 7, swi_x)
    for p in router.parameters():
        p.assign(normal(rng, p.shape, 0.5))
    gamma = None if threshold is None else Gamma(32, 0.5, threshold == "const")
    if threshold == "learned":
        gamma.bias.assign(normal(rng, (1,)))
    x = normal(rng, (4, 1, 32))
    with jt.no_grad():
        fused, plain = type_weights.fused(x, router, gamma, "authors"), type_weights.plain(x, router, gamma, "authors")
    np.testing.assert_allclose(fused[0].numpy(), plain[0].numpy(), rtol=1e-5, atol=1e-6)
    if threshold is not None:
        np.testing.assert_allclose(fused[1].numpy(), plain[1].numpy(), rtol=1e-5, atol=1e-6)
        assert 0 < (fused[0].numpy() == 0).sum() < fused[0].numel()  # some types are switched off, not all
    for got, want in zip(fused[2], plain[2]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
