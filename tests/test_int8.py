"""--precision int8: row quantization, the int8 matmul against its plain reference and float64, and the base
(int8, and nf4 beside it: tests/test_nf4.py) quantized as its checkpoint streams in (the kernels shared with bf16 and fp32 are checked with int8 bases in
tests/test_kernels.py; the golden bases in int8 in tests/test_golden.py)."""
import numpy as np
import pytest

import jittor as jt
from conftest import GOLDEN
from Data.tiny_base import random_base_weights
from Models import load_base_model
from Models.formats import hf
from Models.formats.reading import NonFiniteBase
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits
from Models.kernels.bf16 import cpu_has_bf16_units
from Models.kernels.int8 import Int8Linear, dequantized, int8_linear, quantize
from Models.kernels.precision import set_base_precision
from Models.kernels.switch import DECODE_ROWS, decoding, fused_kernels_on
from Models.ModelArgs import ModelArgs

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")
units_choices = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_has_bf16_units(), reason="this CPU has no bf16 units (avx512_bf16 / amx_bf16)"))]


def normal(rng, shape, scale=1.0):
    return jt.array((scale * rng.standard_normal(shape)).astype(np.float32))


def rounded(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as float64."""
    return bf16_bits_to_float32(float32_to_bf16_bits(a.astype(np.float32))).astype(np.float64)


def test_quantize_rows():
    """Each row's largest magnitude maps to +-127 and the rest to the nearest step (half up), a row of zeros
    to zeros with scale 0; the fused op and its plain reference give the same bytes."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 300)).astype(np.float32) * np.exp(rng.standard_normal((40, 1))).astype(np.float32)
    w[7] = 0.0
    w[9, 5] = 40.0  # an outlier sets its row's step
    fused, plain = quantize.fused(jt.array(w)), quantize.plain(jt.array(w))
    values, scale = fused[0].numpy(), fused[1].numpy()
    np.testing.assert_array_equal(values, plain[0].numpy())
    np.testing.assert_array_equal(scale, plain[1].numpy())
    assert values.dtype == np.int8 and scale[7] == 0 and not values[7].any()
    np.testing.assert_allclose(scale, np.abs(w).max(1) / 127, rtol=1e-6)
    assert (np.abs(values).max(1)[np.arange(40) != 7] == 127).all()
    err = np.abs(dequantized(*fused).numpy() - w)
    assert (err <= scale[:, None] * 0.5001).all() and err.max() > 0.1 * scale.max()


def test_quantize_refuses_a_non_finite_weight():
    w = np.ones((4, 8), np.float32)
    w[2, 3] = np.inf
    with pytest.raises(RuntimeError, match="row 2 of a 4 x 8 matrix holds a non-finite value"):
        quantize.fused(jt.array(w))[0].sync()


def int8_weight(rng, shape):
    values, scale = quantize(normal(rng, shape, 0.1))
    return values.stop_grad(), scale.stop_grad()


# 3 rows: the GEMV pass; 2 x 40 = 80 rows: training and prefill, 1024 weight rows widened at a time (N=2100: two
# full panels and a partial one, the backward summing over them); on the bf16 units and without them
@pytest.mark.parametrize("units", units_choices)
@pytest.mark.parametrize("shape, N", [((3, 96), 150), ((2, 40, 96), 2100)])
def test_int8_linear(shape, N, units):
    """The input (and, backwards, the gradient times the row scales) rounded to bf16, products with the int8
    values summed in fp32, then the row scales: the plain reference's numbers and float64's on the rounded
    operands, to fp32 summation."""
    rng = np.random.default_rng(8)
    x, (values, scale) = normal(rng, shape), int8_weight(rng, (N, 96))
    flat = x.reshape(-1, 96)
    fused, plain = Int8Linear(units=units)(flat, values, scale), int8_linear.plain(flat, values, scale)
    q, s = values.numpy().astype(np.float64), scale.numpy().astype(np.float64)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(fused.numpy(), (rounded(flat.numpy()) @ q.T) * s, rtol=1e-5, atol=2e-5)
    out_grad = normal(rng, fused.shape)
    got, = jt.grad((fused * out_grad).sum(), [flat])
    want, = jt.grad((plain * out_grad).sum(), [flat])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got.numpy(), rounded(out_grad.numpy() * scale.numpy()) @ q, rtol=1e-5, atol=2e-5)


# A decode step's rows kernel over int8 weights: M = 17 (tiles of 5 rows and a rest of 2), 6 (from 5 rows on the
# bf16 units); N = 13 (blocks of 5 weight rows and single rows); K = 4200 (two chunks of 4096 columns, a rest of 8)
@pytest.mark.parametrize("units", units_choices)
@pytest.mark.parametrize("M, N, K", [(17, 13, 4200), (6, 13, 4200)])
def test_int8_rows(M, N, K, units):
    rng = np.random.default_rng(M + K)
    x, (values, scale) = normal(rng, (M, K)), int8_weight(rng, (N, K))
    want = (rounded(x.numpy()) @ values.numpy().astype(np.float64).T) * scale.numpy()
    with jt.no_grad():
        assert decoding(x, values) and not decoding(normal(rng, (DECODE_ROWS + 1, K)), values)
        fused, plain = Int8Linear(units=units)(x, values, scale), int8_linear.plain(x, values, scale)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(fused.numpy(), want, rtol=1e-5, atol=1e-4)
    training = Int8Linear(units=units)(x, values, scale).numpy()  # the panels' path
    np.testing.assert_allclose(training, want, rtol=1e-5, atol=1e-4)
    if units or M > 16:
        assert not np.array_equal(training, fused.numpy())  # another summation order: another kernel ran


RUNTIME = dict(max_seq_len=16, max_batch_size=1)


# each quantized precision's matrix and scale types
QUANTIZED = {"int8": ("int8", "float32"), "nf4": ("uint8", "bfloat16")}


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32"])
def test_streamed_quantization_is_the_in_memory_one(tmp_path, stored, precision):
    """A Hugging Face base (q/k rows reordered while read, untied) loaded in int8 or nf4 holds the bytes of the
    same base loaded in fp32 and then quantized in memory, whatever the file's float type; the embedding is bf16;
    it counts its weights (nf4: two a byte), not its bytes."""
    args = ModelArgs(architecture="qwen3", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     vocab_size=160, qk_norm=True, tied_embeddings=False)
    weights = random_base_weights(args, 3)
    if stored == "float16":
        weights = {name: value.astype(np.float16) for name, value in weights.items()}
    hf.write_hf_base(str(tmp_path), args, weights, bf16=stored == "bfloat16")
    streamed = load_base_model(str(tmp_path), precision=precision, **RUNTIME)
    in_memory = load_base_model(str(tmp_path), precision="fp32", **RUNTIME)
    set_base_precision(in_memory, precision)
    expected = in_memory.base_parameters()
    kinds = {name: str(var.dtype) for name, var in streamed.base_parameters().items()}
    matrix, scale = QUANTIZED[precision]
    assert kinds["llama.layers.0.attention.wq.weight"] == kinds["llama.output.weight"] == matrix
    assert kinds["llama.layers.0.attention.wq.weight_scale"] == scale
    assert kinds["llama.tok_embeddings.weight"] == "bfloat16" and kinds["llama.norm.weight"] == "float32"
    assert kinds == {name: str(var.dtype) for name, var in expected.items()}
    for name, var in streamed.base_parameters().items():
        np.testing.assert_array_equal(var.float32().numpy(), expected[name].float32().numpy(), err_msg=name)
    assert streamed.parameter_counts()["base"] == sum(v.size for v in weights.values())


def test_a_tied_output_stays_the_bf16_embedding():
    model = load_base_model(str(GOLDEN / "hf" / "qwen3_tiny"), precision="int8", **RUNTIME)
    assert model.llama.output.weight is model.llama.tok_embeddings.weight
    assert model.llama.output.weight.dtype == "bfloat16" and model.llama.output.weight_scale is None
    assert model.llama.layers[0].attention.wq.weight.dtype == "int8"


@pytest.mark.parametrize("precision", QUANTIZED)
def test_a_non_finite_checkpoint_weight_is_refused(tmp_path, precision):
    args = ModelArgs(architecture="qwen3", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     vocab_size=160, qk_norm=True, tied_embeddings=True)
    weights = random_base_weights(args, 3)
    weights["layers.0.feed_forward.w2.weight"][5, 7] = np.nan
    hf.write_hf_base(str(tmp_path), args, weights, bf16=True)
    with pytest.raises(NonFiniteBase, match=r"tensor 'model.layers.0.mlp.down_proj.weight' holds 1 value\(s\) that are "
                                            "NaN or inf"):
        load_base_model(str(tmp_path), precision=precision, **RUNTIME)


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("tied", [False, True])
def test_memory_check_counts_a_quantized_base_as_loaded(tmp_path, tied, precision):
    """Models/memory.base_bytes, which refuses a base before it is allocated, counts an int8 or nf4 base's bytes
    as loaded: a byte a weight and an fp32 scale per row (nf4: half a byte and a bf16 scale per 64 weights, two
    groups of the 96 in the down projection), the embedding table in bf16, the norms in fp32."""
    from Models import memory
    args = ModelArgs(architecture="qwen3", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     vocab_size=160, qk_norm=True, tied_embeddings=tied)
    hf.write_hf_base(str(tmp_path), args, random_base_weights(args, 3), bf16=True)
    model = load_base_model(str(tmp_path), precision=precision, **RUNTIME)
    assert memory.base_bytes(model.args) == sum(p.nbytes for p in model.base_parameters().values())
