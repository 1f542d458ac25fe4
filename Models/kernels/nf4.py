"""`--precision nf4` (QLoRA's 4-bit NormalFloat): a base matrix as 4-bit codes and bf16 group scales, its matmul.

The projections and an untied output matrix are stored as a code per
weight, two a byte, and a bf16 scale (the absmax) per 64 weights along the input (cpp/nf4.h): 4.25 bits a
weight. Weight k stands for bf16(NF4[code] * scale), so an nf4 matrix is a bf16 matrix in a quarter of the
bytes and its products are that matrix's under the bf16 rule (bf16.py); its plain reference widens it whole
(`nf4_dequantized`) and runs plain_bf16_linear. Measured by bench/nf4_variants.py (docs/performance.md): the
scales stay bf16, which keep the bf16 base's next tokens exactly where fp32 scales do, while QLoRA's double
quantization (8-bit scales in blocks of 256) kept no more of them and would save 0.12 bits a weight (3%) for a
second widening in every group; plain int4 kept fewer. The embedding table stays bf16, as with int8: in nf4 it
kept fewer of the demo base's next tokens (80.2% against 82.2%), and a lookup reads one row per token, so 4 bits
there would only save memory (1.1 GB at Qwen3-32B's shape). An in-dimension must be even (two codes a byte);
one not a multiple of 64 ends its rows with a shorter group.
"""
import re

import Utils.jittor_env  # noqa: F401
import jittor as jt

from . import cpp
from .bf16 import StoredLinear, plain_bf16_linear, rounded_to_bf16, to_bf16
from .int8 import QUANTIZED_MIN
from .switch import Kernel

NF4_HEADER = cpp.source("nf4.h")
NF4_FORWARD = cpp.source("nf4_forward.cc")
NF4_BACKWARD = cpp.source("nf4_backward.cc")
NF4_QUANTIZE = cpp.source("nf4_quantize.cc")
NF4_GROUP = cpp.constant("nf4.h", "NF4_GROUP")  # weights a scale serves
NF4_BLOCK = cpp.constant("nf4.h", "NF4_BLOCK")  # weights a run of 16 bytes holds (cpp/nf4.h: the packing)
# bitsandbytes' NF4 codebook (cpp/nf4.h's NF4_CODES), read from the header: one home for the 16 values
NF4_CODES = [float(v) for v in re.findall(r"(-?[0-9.]+)f", NF4_HEADER.split("NF4_CODES[16] = {", 1)[1].split("}")[0])]


def nf4_width(K: int, name: str = "a matrix") -> int:
    """The in-dimension K of a matrix [N,K] about to be stored in nf4; an odd one is refused, naming the matrix."""
    if K % 2:
        raise ValueError(f"{name}: --precision nf4 stores two weights a byte, and its in-dimension {K} is odd")
    return K


def nf4_shapes(N: int, K: int) -> list:
    """[the codes' shape, the scales'] of an nf4 matrix [N,K]: two codes a byte, a scale per NF4_GROUP weights."""
    return [(N, K // 2), (N, -(-K // NF4_GROUP))]


def fused_nf4_quantize(weight: jt.Var) -> tuple:
    N, K = weight.shape[0], nf4_width(weight.shape[1])
    numbers = cpp.Numbers().declare(N=N, K=K)
    return tuple(jt.code(nf4_shapes(N, K), ["uint8", "bfloat16"], [weight.float32()],
                         cpu_header=NF4_HEADER, cpu_src=numbers.code + NF4_QUANTIZE, data=numbers.data))


def nf4_halves(codes: jt.Var) -> tuple:
    """codes [N,K] as (the blocks' halves whose codes take the low nibbles, those that take the high ones), each
    [N,K/2] in byte order (cpp/nf4.h's packing)."""
    N, K = codes.shape
    whole = K // NF4_BLOCK * NF4_BLOCK
    runs = codes[:, :whole].reshape(N, K // NF4_BLOCK, 2, NF4_BLOCK // 2)
    parts = [(runs[:, :, 0].reshape(N, -1), runs[:, :, 1].reshape(N, -1))]
    if whole < K:
        tail = codes[:, whole:].reshape(N, 2, (K - whole) // 2)
        parts.append((tail[:, 0], tail[:, 1]))
    return tuple(jt.concat(list(p), 1) if len(p) > 1 else p[0] for p in zip(*parts))


def plain_nf4_quantize(weight: jt.Var) -> tuple:
    N, K = weight.shape[0], nf4_width(weight.shape[1])
    G = -(-K // NF4_GROUP)
    w = weight.float32()
    padded = jt.concat([w, jt.zeros((N, G * NF4_GROUP - K))], 1) if G * NF4_GROUP > K else w
    groups = padded.reshape(N, G, NF4_GROUP)
    top = rounded_to_bf16(groups.abs().max(dim=2))  # [N,G]
    scale = jt.where(top >= QUANTIZED_MIN, top, jt.zeros_like(top))
    inv = jt.where(scale > 0, 1.0 / scale.maximum(QUANTIZED_MIN), jt.zeros_like(scale))
    codebook = jt.array(NF4_CODES, "float32")
    mids = (codebook[:-1] + codebook[1:]) * 0.5
    codes = (((groups * inv.unsqueeze(2)).unsqueeze(3) > mids).int32().sum(3)).reshape(N, -1)[:, :K]
    low, high = nf4_halves(codes)
    return (low + high * 16).uint8(), to_bf16(scale)


# weight [N,K] (K even) -> (codes [N,K/2] uint8, scales [N, ceil(K/64)] bf16): each group's absmax rounded to bf16
# is its scale, each weight / scale takes the nearest NF4 value (a midpoint the lower)
nf4_quantize = Kernel(fused_nf4_quantize, plain_nf4_quantize)


def nf4_dequantized(codes: jt.Var, scale: jt.Var) -> jt.Var:
    """The fp32 matrix [N,K] of bf16 values that an nf4 one stands for: bf16(NF4[code] * scale)."""
    N, K = codes.shape[0], 2 * codes.shape[1]
    low, high = (codes & 15).int32(), (codes >> 4).int32()
    whole = K // NF4_BLOCK * NF4_BLOCK
    half = NF4_BLOCK // 2
    parts = [jt.stack([low[:, :whole // 2].reshape(N, -1, half), high[:, :whole // 2].reshape(N, -1, half)], 2)
             .reshape(N, whole)]
    if whole < K:
        parts.append(jt.concat([low[:, whole // 2:], high[:, whole // 2:]], 1))
    indices = jt.concat(parts, 1) if len(parts) > 1 else parts[0]
    scales = scale.float32().unsqueeze(2).broadcast((N, scale.shape[1], NF4_GROUP)).reshape(N, -1)[:, :K]
    return rounded_to_bf16(jt.array(NF4_CODES, "float32")[indices] * scales)


class Nf4Linear(StoredLinear):
    """x [M,K] fp32 @ (the nf4 matrix of codes [N,K/2] and scales)^T -> [M,N] fp32 by the bf16 rule on the matrix it
    stands for. A product of at most GEMV_ROWS rows reads the codes once, widened in registers (cpp/nf4.h)."""
    HEADER, FORWARD, BACKWARD = NF4_HEADER, NF4_FORWARD, NF4_BACKWARD

    @staticmethod
    def in_features(codes: jt.Var) -> int:
        return 2 * codes.shape[1]


def plain_nf4_linear(x: jt.Var, codes: jt.Var, scale: jt.Var) -> jt.Var:
    return plain_bf16_linear(x, to_bf16(nf4_dequantized(codes, scale)))


# x [..., K] fp32 @ (the nf4 matrix of codes [N,K/2] uint8 and scales [N, ceil(K/64)] bf16)^T -> [..., N] fp32
nf4_linear = Kernel(Nf4Linear.fused, plain_nf4_linear)
