"""--precision nf4: QLoRA's 4-bit NormalFloat against a numpy reference of NF4 (codes, bf16 group scales, the
packing), the nf4 matmul against its plain reference and float64, and the base quantized as its checkpoint streams
in (the streamed load against the in-memory quantization and the memory check: tests/test_int8.py; the
random-case pairs, the decode layer and the loss over nf4 bases: tests/kernel_cases.py, tests/test_decode_layer.py;
its predictions against bf16: bench/quantization.py, docs/performance.md)."""
import numpy as np
import pytest

import jittor as jt
from Data.tiny_base import random_base_weights
from Models import load_base_model
from Models.formats import hf
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits
from Models.kernels.bf16 import cpu_has_bf16_units
from Models.kernels.nf4 import NF4_CODES, Nf4Linear, nf4_dequantized, nf4_linear, nf4_quantize
from Models.kernels.switch import fused_kernels_on
from Models.ModelArgs import ModelArgs

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")
units_choices = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_has_bf16_units(), reason="this CPU has no bf16 units (avx512_bf16 / amx_bf16)"))]


def bf16(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as fp32."""
    return bf16_bits_to_float32(float32_to_bf16_bits(a.astype(np.float32)))


def numpy_nf4(w: np.ndarray) -> tuple:
    """(codes [N,K] 0..15, scales [N, ceil(K/64)] fp32, packed bytes [N,K/2]) of w by QLoRA's NF4, written apart
    from the kernels: per 64 weights along a row the absmax rounded to bf16 is the scale (0 below 1e-30), each
    weight times 1/scale takes the nearest code (a midpoint the lower); blocks of 32 weights (the last one what is
    left, L) pack weight i into byte i's low nibble and weight L/2 + i into its high one."""
    N, K = w.shape
    codebook = np.array(NF4_CODES, np.float32)
    mids = (codebook[:-1] + codebook[1:]) / np.float32(2)
    codes, scales = np.zeros((N, K), np.uint8), np.zeros((N, -(-K // 64)), np.float32)
    for g, k0 in enumerate(range(0, K, 64)):
        group = w[:, k0:k0 + 64]
        top = bf16(np.abs(group).max(1))
        scales[:, g] = np.where(top >= 1e-30, top, 0)
        inv = np.where(scales[:, g] > 0, np.float32(1) / np.maximum(scales[:, g], np.float32(1e-30)), 0)
        codes[:, k0:k0 + 64] = np.searchsorted(mids, group * inv.astype(np.float32)[:, None], side="left")
    packed = []
    for b0 in range(0, K, 32):
        half = min(32, K - b0) // 2
        packed.append(codes[:, b0:b0 + half] | codes[:, b0 + half:b0 + 2 * half] << 4)
    return codes, scales, np.concatenate(packed, 1).astype(np.uint8)


def weights(rng, N, K) -> np.ndarray:
    """Normal rows of spread scales, a row of zeros, a group of values below 1e-30, an outlier, huge values."""
    w = (rng.standard_normal((N, K)) * np.exp(2 * rng.standard_normal((N, 1)))).astype(np.float32)
    w[1] = 0.0
    w[2, :40] = 1e-31
    w[3, -1] = 1e4
    w[4] *= np.float32(1e30)
    return w


@pytest.mark.parametrize("K", [64, 176, 352, 2, 130, 4096])
def test_quantize_is_numpys_nf4(K):
    """The fused op and its plain reference give numpy's codes, scales and bytes, bit for bit, for in-dimensions
    that end in a short group (176: 64 + 64 + 48) or a short block (130: a group of 2), and the matrix they stand
    for is bf16(NF4[code] * scale), within half a code step of w."""
    rng = np.random.default_rng(K)
    w = weights(rng, 9, K)
    codes, scales, packed = numpy_nf4(w)
    for side in (nf4_quantize.fused, nf4_quantize.plain):
        q, s = side(jt.array(w))
        np.testing.assert_array_equal(q.numpy(), packed)
        np.testing.assert_array_equal(s.float32().numpy(), scales)
        assert q.dtype == "uint8" and s.dtype == "bfloat16"
    group_scale = np.repeat(scales, 64, 1)[:, :K]
    standing = bf16(np.array(NF4_CODES, np.float32)[codes] * group_scale)
    np.testing.assert_array_equal(nf4_dequantized(q, s).numpy(), standing)
    assert not standing[1].any() and not standing[2, :40].any() and standing[3, -1] == bf16(np.array([1e4]))[0]
    assert len(np.unique(codes)) == 16 or K < 64  # the whole codebook in use
    gap = np.diff(NF4_CODES).max() / 2
    assert (np.abs(standing - w) <= gap * group_scale * 1.01 + 1e-30).all()


def test_quantize_refuses_non_finite_and_odd():
    w = np.ones((4, 8), np.float32)
    w[2, 3] = np.nan
    with pytest.raises(RuntimeError, match="row 2 of a 4 x 8 matrix holds a non-finite value"):
        nf4_quantize.fused(jt.array(w))[0].sync()
    with pytest.raises(ValueError, match="a matrix: --precision nf4 stores two weights a byte, and its in-dimension "
                                         "7 is odd"):
        nf4_quantize(jt.ones((3, 7)))


# 3 rows: the GEMV pass (K 352: a short group, and 4096); 2 x 40 = 80 rows: training and prefill, 1024 weight rows
# widened at a time (N=2100: two full panels and a partial one); on the bf16 units and without them
@pytest.mark.parametrize("units", units_choices)
@pytest.mark.parametrize("shape, N", [((3, 352), 150), ((1, 4096), 37), ((2, 40, 176), 2100)])
def test_nf4_linear(shape, N, units):
    """The input (and, backwards, the gradient) rounded to bf16, products with the bf16 matrix the codes stand
    for summed in fp32: the plain reference's numbers and float64's on the rounded operands, to fp32 summation."""
    rng = np.random.default_rng(N)
    K = shape[-1]
    codes, scale = (v.stop_grad() for v in nf4_quantize(jt.array(rng.standard_normal((N, K)).astype(np.float32))))
    x = jt.array(rng.standard_normal(shape).astype(np.float32))
    flat = x.reshape(-1, K)
    matrix = nf4_dequantized(codes, scale).numpy().astype(np.float64)
    fused, plain = Nf4Linear(units=units)(flat, codes, scale), nf4_linear.plain(flat, codes, scale)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(fused.numpy(), bf16(flat.numpy()) @ matrix.T, rtol=1e-5, atol=1e-4)
    out_grad = jt.array(rng.standard_normal(fused.shape).astype(np.float32))
    got, = jt.grad((fused * out_grad).sum(), [flat])
    want, = jt.grad((plain * out_grad).sum(), [flat])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got.numpy(), bf16(out_grad.numpy()) @ matrix, rtol=1e-5, atol=1e-4)


RUNTIME = dict(max_seq_len=16, max_batch_size=1)
QWEN3 = dict(architecture="qwen3", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
             vocab_size=160, qk_norm=True)


def test_an_odd_in_dimension_is_refused(tmp_path):
    """Two codes a byte: a base whose down projection reads an odd FFN width is refused naming the matrix (the
    entry points' refusal: tests/refusals/test_refused_bases.py)."""
    odd = ModelArgs(**{**QWEN3, "ffn_dim": 95}, tied_embeddings=True)
    hf.write_hf_base(str(tmp_path), odd, random_base_weights(odd, 3), bf16=True)
    with pytest.raises(ValueError, match=r"llama.layers.0.feed_forward.w2.weight: --precision nf4 stores two weights a "
                                         "byte, and its in-dimension 95 is odd"):
        load_base_model(str(tmp_path), precision="nf4", **RUNTIME)
