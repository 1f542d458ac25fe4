"""The choices of --precision nf4 measured, not assumed: NF4 variants emulated in numpy against the bf16 base.

python bench/nf4_variants.py
The bases and tokens of bench/quantization.py (the golden checkpoints', the demo base's 4,096 positions). Each
variant quantizes the base's matrices in numpy and loads them, dequantized, into an fp32 model, whose logits are
compared with the bf16 base's (top-1 agreement, max abs difference): `shipped` is --precision nf4's rule (a bf16
absmax per 64 weights, the embedding bf16, the output matrix nf4; it matches --precision nf4 itself to the
emulation's fp32 products); `fp32 scales`; `double-quantized` scales as QLoRA (the mean-centred scales in 8 bits
per block of 256 with an fp32 scale each: linear absmax, standing in for bitsandbytes' dynamic 8-bit map);
`least-error scales` (each group's scale the one of 16 between 0.7 and 1 times its absmax whose codes leave the
least squared error: the same storage, a search at load); `groups of 32`; `int4` (plain symmetric int4, 15 levels,
in place of the NF4 codes); `embedding nf4`; `output bf16` (the output matrix kept bf16, as transformers'
bitsandbytes loading keeps lm_head). Then the floor no code reaches: `bound R` replaces each matrix row w
(variance v) by the Gaussian test channel of R bits a weight, a w + sqrt(a D) z with D = v 2^(-2R) and
a = 1 - D / v, z standard normal: the least mean square error any code of R bits a weight achieves on Gaussian
weights (Shannon's distortion-rate bound; these bases' weights are Gaussian: kurtosis 2.92, entropy power 0.998 of
the variance), its top-1 agreement the mean of three draws of z. Prints a markdown table.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quantization import BASES, SEQ, golden_tokens, problem_tokens  # noqa: E402  (bench/quantization.py)
import jittor as jt  # noqa: E402

from Models import load_base_model  # noqa: E402
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits  # noqa: E402
from Models.kernels.nf4 import NF4_CODES  # noqa: E402
from Models.kernels.precision import BaseLinear  # noqa: E402

CODES = np.array(NF4_CODES, np.float32)
INT4 = np.arange(-7, 8, dtype=np.float32) / np.float32(7)  # symmetric absmax int4: 15 evenly spaced levels
VARIANTS = {"shipped": {}, "fp32 scales": dict(scales="fp32"), "double-quantized": dict(scales="dq"),
            "least-error scales": dict(scales="mse"),
            "groups of 32": dict(group=32), "int4": dict(codebook=INT4), "embedding nf4": dict(embedding=True),
            "output bf16": dict(output=False), "bound 4.25": dict(bits=4.25), "bound 6": dict(bits=6),
            "bound 7": dict(bits=7)}
DRAWS = 3  # of a bound's noise
MSE_FACTORS = np.linspace(0.7, 1.0, 16)  # the least-error scales' candidates, times a group's absmax


def bf16(a):
    return bf16_bits_to_float32(float32_to_bf16_bits(np.asarray(a, np.float32)))


def scales_of(top, kind):
    if kind == "bf16":
        return bf16(top)
    if kind == "fp32":
        return top
    flat = top.reshape(-1)
    mean = flat.mean(dtype=np.float64).astype(np.float32)
    out = np.empty_like(flat)
    for i in range(0, flat.size, 256):
        block = flat[i:i + 256] - mean
        step = max(float(np.abs(block).max()), 1e-30) / 127
        out[i:i + 256] = np.round(block / step) * step + mean
    return out.reshape(top.shape)


def nf4(w, group=64, scales="bf16", codebook=CODES):
    """The matrix [N,K] that NF4 codes of w (or the codes of another `codebook` of values in [-1, 1]) stand for."""
    N, K = w.shape
    padded = np.zeros((N, -(-K // group) * group), np.float32)
    padded[:, :K] = w
    groups = padded.reshape(N, -1, group)
    top = np.abs(groups).max(2)

    def dequantized(s):
        s = np.where(s >= 1e-30, s, 0).astype(np.float32)
        inv = np.where(s > 0, np.float32(1) / np.maximum(s, np.float32(1e-30)), 0).astype(np.float32)
        codes = np.searchsorted((codebook[:-1] + codebook[1:]) / np.float32(2), groups * inv[..., None], side="left")
        return bf16(codebook[codes] * s[..., None])
    if scales != "mse":
        return dequantized(scales_of(top, scales)).reshape(N, -1)[:, :K]
    # each group's scale the one of MSE_FACTORS x its absmax whose codes leave the least squared error (the first)
    candidates = (dequantized(bf16(top * np.float32(factor))) for factor in MSE_FACTORS)
    best = next(candidates)
    least = ((best - groups) ** 2).sum(2)
    for got in candidates:
        error = ((got - groups) ** 2).sum(2)
        best, least = np.where((error < least)[..., None], got, best), np.minimum(error, least)
    return best.reshape(N, -1)[:, :K]


def gaussian_channel(w, bits, rng):
    """w [N,K] through the distortion-rate bound's test channel at `bits` bits a weight, row by row."""
    v = w.astype(np.float64).var(1, keepdims=True)
    d = v * 2.0 ** (-2 * bits)
    a = 1 - d / np.maximum(v, 1e-300)
    return (a * w + np.sqrt(a * d) * rng.standard_normal(w.shape)).astype(np.float32)


def logits(model, tokens):
    with jt.no_grad():
        return np.concatenate([model.llama(jt.array(tokens[i:i + 8])).numpy() for i in range(0, len(tokens), 8)])


def variant_logits(folder, tokens, embedding=False, output=True, bits=None, draw=0, **options):
    model = load_base_model(folder, precision="fp32", max_seq_len=SEQ, max_batch_size=8)
    tables = {id(model.llama.tok_embeddings.weight)}
    rng = np.random.default_rng(draw)
    for name, module in model.named_modules():
        if isinstance(module, BaseLinear) and id(module.weight) not in tables and (output or name != "llama.output"):
            w = module.weight.numpy()
            module.weight.assign(jt.array(nf4(w, **options) if bits is None else gaussian_channel(w, bits, rng)))
    if embedding:
        table = model.llama.tok_embeddings.weight
        table.assign(jt.array(nf4(table.numpy(), **options)))
    return logits(model, tokens)


def main():
    print("| base | positions | " + " | ".join(VARIANTS) + " |")
    print("| --- | --- |" + " --- |" * len(VARIANTS))
    for name, folder in BASES.items():
        tokens, mask = golden_tokens(folder), None
        reference = load_base_model(folder, precision="bf16", max_seq_len=SEQ, max_batch_size=8)
        if tokens is None:
            tokens, mask = problem_tokens(folder, reference.args.vocab_size, 32)
        mask = np.ones(tokens.shape, bool) if mask is None else mask
        want = logits(reference, tokens)
        del reference
        cells = []
        for options in VARIANTS.values():
            draws = [variant_logits(folder, tokens, draw=draw, **options)
                     for draw in range(DRAWS if "bits" in options else 1)]
            agree = np.mean([(got.argmax(-1) == want.argmax(-1))[mask].mean() for got in draws])
            cells.append(f"{100 * agree:.1f}% ({max(np.abs(got - want)[mask].max() for got in draws):.3g})")
        print(f"| {name} | {int(mask.sum())} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
