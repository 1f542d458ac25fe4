"""The choices of --precision nf4 measured, not assumed: NF4 variants emulated in numpy against the bf16 base.

python bench/nf4_variants.py
The bases and tokens of bench/quantization.py (the golden checkpoints', the demo base's 4,096 positions). Each
variant quantizes the base's matrices in numpy and loads them, dequantized, into an fp32 model, whose logits are
compared with the bf16 base's (top-1 agreement, max abs difference): `shipped` is --precision nf4's rule (a bf16
absmax per 64 weights, the embedding bf16, the output matrix nf4; it matches --precision nf4 itself to the
emulation's fp32 products); `fp32 scales`; `double-quantized` scales as QLoRA (the mean-centred scales in 8 bits
per block of 256 with an fp32 scale each: linear absmax, standing in for bitsandbytes' dynamic 8-bit map); `groups
of 32`; `int4` (plain symmetric int4, 15 levels, in place of the NF4 codes); `embedding nf4`; `output bf16` (the
output matrix kept bf16, as transformers' bitsandbytes loading keeps lm_head). Prints a markdown table.
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
            "groups of 32": dict(group=32), "int4": dict(codebook=INT4), "embedding nf4": dict(embedding=True),
            "output bf16": dict(output=False)}


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
    s = scales_of(np.abs(groups).max(2), scales)
    s = np.where(s >= 1e-30, s, 0).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / np.maximum(s, np.float32(1e-30)), 0).astype(np.float32)
    codes = np.searchsorted((codebook[:-1] + codebook[1:]) / np.float32(2), groups * inv[..., None], side="left")
    return bf16(codebook[codes] * s[..., None]).reshape(N, -1)[:, :K]


def logits(model, tokens):
    with jt.no_grad():
        return np.concatenate([model.llama(jt.array(tokens[i:i + 8])).numpy() for i in range(0, len(tokens), 8)])


def variant_logits(folder, tokens, embedding=False, output=True, **options):
    model = load_base_model(folder, precision="fp32", max_seq_len=SEQ, max_batch_size=8)
    tables = {id(model.llama.tok_embeddings.weight)}
    for name, module in model.named_modules():
        if isinstance(module, BaseLinear) and id(module.weight) not in tables and (output or name != "llama.output"):
            module.weight.assign(jt.array(nf4(module.weight.numpy(), **options)))
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
            got = variant_logits(folder, tokens, **options)
            cells.append(f"{100 * (got.argmax(-1) == want.argmax(-1))[mask].mean():.1f}% "
                         f"({np.abs(got - want)[mask].max():.3g})")
        print(f"| {name} | {int(mask.sum())} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
