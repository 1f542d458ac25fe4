"""The frozen base's precision: its projections as BaseLinear, bf16, int8 and nf4 storage, their matmuls.

`--precision bf16` stores the frozen base's matrices (projections, embedding,
output) in bf16; `--precision int8` stores the projections and an untied output
matrix as int8 values with a scale per row (symmetric absmax, cpp/int8.h), the
embedding in bf16. Adapters, routers, Gamma, norms, softmax, loss and the optimizer
stay fp32. A bf16 projection runs `base_linear`, fp32 in and out, with one rule
on every machine: the input is rounded to bf16 (to nearest, ties to even) and
the products of the two bf16 operands are summed in fp32, which is what torch's
autocast and a GPU's half matmul do (the authors' bf16 mode); the backward rounds
the incoming gradient the same way. Attention's products follow the same rule in
training and prefill (Models/kernels/attention.py; a decode step's stay fp32), and
training keeps the SwiGLU's gate and up for its backward as bf16 where the down
projection has at most one expert (projections.keep_gate_up: half the bytes of the step's
largest activations; the hidden is made from those values, which the down projection
rounds to bf16 anyway; a mixture of experts there keeps them fp32). Only the route differs:
- a CPU with bf16 units (avx512_bf16 or amx_bf16 in /proc/cpuinfo): oneDNN's
  gemm_bf16bf16f32;
- any other CPU with oneDNN: the rounded input and the weights widened to fp32
  (exact: bf16 is the top half of an fp32) a panel at a time, through oneDNN's
  sgemm; decoding reads half the weight bytes;
- plain Jittor (a GPU, or no oneDNN): on a GPU Jittor's own half-precision matmul,
  on a CPU the same rounding and widening in Jittor ops.
Jittor's own CPU cast to bf16 truncates; `to_bf16` rounds to nearest even, and every
fp32 -> bf16 conversion of the project (set_base_precision, checkpoint loads) goes
through it.

An int8 matrix's product keeps the same rule on its values, which bf16 holds exactly: y = s * (bf16(x)
q^T), backwards dx = bf16(dy * s) q, the values widened inside the kernel (cpp/int8.h); its plain
reference widens them whole, on a GPU to bf16 for the half matmul. A matrix is quantized row by row as
its checkpoint streams in (Models/formats/reading.py) or, in memory, by `quantize`, both through one
C++ function.

`--precision nf4` (QLoRA's 4-bit NormalFloat) stores the projections and an untied output matrix as a code per
weight, two a byte, and a bf16 scale (the absmax) per 64 weights along the input (cpp/nf4.h): 4.25 bits a
weight. Weight k stands for bf16(NF4[code] * scale), so an nf4 matrix is a bf16 matrix in a quarter of the
bytes and its products are that matrix's under the bf16 rule; its plain reference widens it whole
(`nf4_dequantized`) and runs plain_bf16_linear. Measured by bench/nf4_variants.py (docs/performance.md): the
scales stay bf16, which keep the bf16 base's next tokens exactly where fp32 scales do, while QLoRA's double
quantization (8-bit scales in blocks of 256) kept no more of them and would save 0.12 bits a weight (3%) for a
second widening in every group; plain int4 kept fewer. The embedding table stays bf16, as with int8: in nf4 it
kept fewer of the demo base's next tokens (80.2% against 82.2%), and a lookup reads one row per token, so 4 bits
there would only save memory (1.1 GB at Qwen3-32B's shape). An in-dimension must be even (two codes a byte);
one not a multiple of 64 ends its rows with a shorter group.
"""
import functools
import re

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .linear import fused_linear_input_grad, linear
from .switch import Kernel, decoding

# --precision: the frozen base matrices' storage type (int8, nf4: the projections' and an untied output's;
# the embedding table takes bf16)
STORAGE_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8", "nf4": "uint8"}
# each storage type's name in C++ (cpp/storage.h)
STORAGES = {"float32": "FP32", "bfloat16": "BF16", "int8": "INT8", "uint8": "NF4"}

ROUND_HEADER = cpp.source("bf16_bits.h")
ROUND = cpp.source("bf16_round.cc")
BF16_HEADER = cpp.source("bf16.h")
BF16_FORWARD = cpp.source("bf16_forward.cc")
BF16_BACKWARD = cpp.source("bf16_backward.cc")
BF16_BACKWARD_BITS = cpp.source("bf16_backward_bits.cc")
INT8_HEADER = cpp.source("int8.h")
QUANTIZED_MIN = 1e-30  # rows below it quantize to zeros (cpp/int8.h)
INT8_FORWARD = cpp.source("int8_forward.cc")
INT8_BACKWARD = cpp.source("int8_backward.cc")
QUANTIZE = cpp.source("int8_quantize.cc")
NF4_HEADER = cpp.source("nf4.h")
NF4_FORWARD = cpp.source("nf4_forward.cc")
NF4_BACKWARD = cpp.source("nf4_backward.cc")
NF4_QUANTIZE = cpp.source("nf4_quantize.cc")
NF4_GROUP = cpp.constant("nf4.h", "NF4_GROUP")  # weights a scale serves
NF4_BLOCK = cpp.constant("nf4.h", "NF4_BLOCK")  # weights a run of 16 bytes holds (cpp/nf4.h: the packing)
# bitsandbytes' NF4 codebook (cpp/nf4.h's NF4_CODES), read from the header: one home for the 16 values
NF4_CODES = [float(v) for v in re.findall(r"(-?[0-9.]+)f", NF4_HEADER.split("NF4_CODES[16] = {", 1)[1].split("}")[0])]


def bf16_rule(weight: jt.Var) -> bool:
    """Whether products with this base weight (and attention beside it) take the bf16 rule: a bf16, int8 or
    nf4 base."""
    return weight.dtype != "float32"


def matrix_code(inputs: cpp.CodeInputs, weight: jt.Var, scale=None) -> str:
    """The C++ BaseMatrix (cpp/storage.h) of a base weight and a quantized weight's scales, their Vars and
    storage added to `inputs`."""
    storage = STORAGES[str(weight.dtype)]
    inputs.storages.add(storage)
    return f"BaseMatrix{{{inputs.pointer(weight)}, {inputs.pointer(scale)}, {storage}}}"


def rounding_op(x: jt.Var, dtype: str) -> jt.Var:
    """x (fp32) rounded to bf16: its bits (dtype bfloat16) or their fp32 values (float32)."""
    out_type = "uint16_t" if dtype == "bfloat16" else "float"
    numbers = cpp.Numbers().declare(N=x.numel())
    return jt.code(x.shape, dtype, [x.float32()], cpu_header=ROUND_HEADER,
                   cpu_src=numbers.code + f"typedef {out_type} OUT_T;\n" + ROUND, data=numbers.data)


def to_bf16(x: jt.Var) -> jt.Var:
    """x (fp32) as bf16, rounded to nearest even; Jittor's CPU cast truncates. A GPU's cast rounds."""
    if x.dtype == "bfloat16" or jt.flags.use_cuda:
        return x.cast("bfloat16")
    return rounding_op(x, "bfloat16")


def rounded_to_bf16(x: jt.Var) -> jt.Var:
    """x (fp32) rounded to the nearest bf16 value, kept in fp32."""
    return rounding_op(x, "float32")


def bf16_values(x: jt.Var) -> jt.Var:
    """x (fp32) rounded to bf16 values, kept in fp32, its gradient passing through unchanged (the plain
    form of what a fused op keeps as bf16 bits)."""
    rounded = x.cast("bfloat16").float32() if jt.flags.use_cuda else rounded_to_bf16(x)
    return x + (rounded - x).stop_grad()  # exact: x's rounding error is an fp32 value


def cast_to(x: jt.Var, dtype: str) -> jt.Var:
    """x as `dtype`; fp32 -> bf16 rounds to nearest even (to_bf16)."""
    if x.dtype == dtype:
        return x
    return to_bf16(x) if dtype == "bfloat16" else x.cast(dtype)


class PlainBF16Linear(jt.Function):
    """The plain reference of the bf16 matmul on a CPU: x [M,K] rounded to bf16 values @ weight [N,K]^T
    widened, and backwards the gradient rounded the same way @ weight; Jittor's own (fp32) matmuls
    (its CPU bf16 matmul is slow)."""

    def execute(self, x, weight):
        self.weight = weight
        return nn.matmul_transpose(rounded_to_bf16(x), weight.float32())

    def grad(self, grad_out):
        return plain_bf16_input_grad(grad_out, self.weight), None


def plain_bf16_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    return nn.matmul(rounded_to_bf16(grad_out), weight.float32())


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_units() -> bool:
    """avx512_bf16 or amx_bf16 in this CPU's flags (Linux); False where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def product_numbers(M: int, N: int, K: int, decode: bool = False) -> cpp.Numbers:
    """A bf16 or int8 product's sizes, and whether it is a decode step's."""
    return cpp.Numbers().declare(M=M, N=N, K=K).declare("bool", decode=decode)


def widening(header: str, units: bool) -> str:
    """An op's header that takes the bf16 units where the CPU has them (units True), or the widening forms
    even there (False: the tests of what a CPU without the units runs; cpp/bf16_rows.h's MOA_UNITS)."""
    return header if units else "#define MOA_UNITS 0\n" + header


def bf16_input_grad(grad_out: jt.Var, weight: jt.Var, units: bool = True) -> jt.Var:
    """rounded(grad_out) [M,N] @ weight [N,K] (bf16) -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_out.shape, weight.shape[1]
    numbers = product_numbers(M, N, K)
    return jt.code((M, K), "float32", [grad_out, weight], cpu_header=widening(BF16_HEADER, units),
                   cpu_src=numbers.code + BF16_BACKWARD, data=numbers.data)


class BF16Linear(jt.Function):
    """x [M,K] fp32 @ w [N,K]^T bf16 -> [M,N] fp32, gradient to x only; units False: the widening forms (see
    widening). A decode step's product (switch.decoding) reads the weights once for all its rows (cpp/bf16.h)."""

    def __init__(self, units: bool = True):
        self.units = units

    def execute(self, x, weight):
        (M, K), N = x.shape, weight.shape[0]
        self.weight = weight
        numbers = product_numbers(M, N, K, decoding(x, weight))
        return jt.code((M, N), "float32", [x, weight], cpu_header=widening(BF16_HEADER, self.units),
                       cpu_src=numbers.code + BF16_FORWARD, data=numbers.data)

    def grad(self, grad_out):
        return bf16_input_grad(grad_out, self.weight, self.units), None


def bf16_bits_input_grad(grad_bits: jt.Var, weight: jt.Var) -> jt.Var:
    """grad_bits [M,N] (bf16, already rounded) @ weight [N,K] (bf16) -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_bits.shape, weight.shape[1]
    numbers = product_numbers(M, N, K)
    return jt.code((M, K), "float32", [grad_bits, weight], cpu_header=BF16_HEADER,
                   cpu_src=numbers.code + BF16_BACKWARD_BITS, data=numbers.data)


def fused_bf16_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    rows = x.shape[:-1]
    out = BF16Linear.apply(x.float32().reshape(-1, x.shape[-1]), weight)
    return out.reshape(*rows, weight.shape[0])


def plain_bf16_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    if jt.flags.use_cuda:  # the GPU's half-precision matmul
        return nn.matmul_transpose(x.cast(weight.dtype), weight).float32()
    rows = x.shape[:-1]
    return PlainBF16Linear.apply(x.float32().reshape(-1, x.shape[-1]), weight).reshape(*rows, weight.shape[0])


# x [..., K] fp32 @ weight [N,K]^T bf16 -> [..., N] fp32, by the bf16 rule above
bf16_linear = Kernel(fused_bf16_linear, plain_bf16_linear)


def fused_quantize(weight: jt.Var) -> tuple:
    N, K = weight.shape
    numbers = cpp.Numbers().declare(N=N, K=K)
    return tuple(jt.code([(N, K), (N,)], ["int8", "float32"], [weight.float32()], cpu_header=INT8_HEADER,
                         cpu_src=numbers.code + QUANTIZE, data=numbers.data))


def plain_quantize(weight: jt.Var) -> tuple:
    w = weight.float32()
    top = w.abs().max(dim=1)  # [N]
    inv = jt.where(top >= QUANTIZED_MIN, 127.0 / top.maximum(QUANTIZED_MIN), jt.zeros_like(top))
    values = jt.floor((w * inv.unsqueeze(1)).clamp(-127.0, 127.0) + 0.5).int8()
    return values, top / 127.0


# weight [N,K] -> (values [N,K] int8, scale [N] fp32): each row's absmax maps to 127, values rounded half up
quantize = Kernel(fused_quantize, plain_quantize)


def dequantized(values: jt.Var, scale: jt.Var) -> jt.Var:
    """The fp32 matrix [N,K] an int8 one stands for."""
    return values.float32() * scale.unsqueeze(1)


def int8_input_grad(grad_out: jt.Var, values: jt.Var, scale: jt.Var, units: bool = True) -> jt.Var:
    """bf16(grad_out [M,N] * scale) @ values [N,K] (int8) -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_out.shape, values.shape[1]
    numbers = product_numbers(M, N, K)
    return jt.code((M, K), "float32", [grad_out, values, scale], cpu_header=widening(INT8_HEADER, units),
                   cpu_src=numbers.code + INT8_BACKWARD, data=numbers.data)


class Int8Linear(jt.Function):
    """x [M,K] fp32 @ (scale [N] * values [N,K] int8)^T -> [M,N] fp32, gradient to x only, by the int8 rule
    above; units False: the widening forms (see widening). A decode step's product reads the values once
    (cpp/int8.h)."""

    def __init__(self, units: bool = True):
        self.units = units

    def execute(self, x, values, scale):
        (M, K), N = x.shape, values.shape[0]
        self.saved = values, scale
        numbers = product_numbers(M, N, K, decoding(x, values))
        return jt.code((M, N), "float32", [x, values, scale], cpu_header=widening(INT8_HEADER, self.units),
                       cpu_src=numbers.code + INT8_FORWARD, data=numbers.data)

    def grad(self, grad_out):
        return int8_input_grad(grad_out, *self.saved, self.units), None, None


class PlainInt8Linear(jt.Function):
    """The plain reference of the int8 matmul on a CPU: the values widened whole, the rule's roundings in
    Jittor ops."""

    def execute(self, x, values, scale):
        self.saved = values, scale
        return nn.matmul_transpose(rounded_to_bf16(x), values.float32()) * scale

    def grad(self, grad_out):
        values, scale = self.saved
        return nn.matmul(rounded_to_bf16(grad_out * scale), values.float32()), None, None


def fused_int8_linear(x: jt.Var, values: jt.Var, scale: jt.Var) -> jt.Var:
    rows = x.shape[:-1]
    return Int8Linear.apply(x.float32().reshape(-1, x.shape[-1]), values, scale).reshape(*rows, values.shape[0])


def plain_int8_linear(x: jt.Var, values: jt.Var, scale: jt.Var) -> jt.Var:
    if jt.flags.use_cuda:  # the values widened to bf16 (exactly), the GPU's half matmul, then the row scales
        return nn.matmul_transpose(x.cast("bfloat16"), values.cast("bfloat16")).float32() * scale
    rows = x.shape[:-1]
    out = PlainInt8Linear.apply(x.float32().reshape(-1, x.shape[-1]), values, scale)
    return out.reshape(*rows, values.shape[0])


# x [..., K] fp32 @ (scale [N] * values [N,K] int8)^T -> [..., N] fp32
int8_linear = Kernel(fused_int8_linear, plain_int8_linear)


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


def nf4_input_grad(grad_out: jt.Var, codes: jt.Var, scale: jt.Var, units: bool = True) -> jt.Var:
    """bf16(grad_out [M,N]) @ the nf4 matrix [N,K] -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_out.shape, 2 * codes.shape[1]
    numbers = product_numbers(M, N, K)
    return jt.code((M, K), "float32", [grad_out, codes, scale], cpu_header=widening(NF4_HEADER, units),
                   cpu_src=numbers.code + NF4_BACKWARD, data=numbers.data)


class Nf4Linear(jt.Function):
    """x [M,K] fp32 @ (the nf4 matrix of codes [N,K/2] and scales)^T -> [M,N] fp32, gradient to x only, by the bf16
    rule on the matrix it stands for; units False: the widening forms (see widening). A product of at most
    GEMV_ROWS rows reads the codes once, widened in registers (cpp/nf4.h)."""

    def __init__(self, units: bool = True):
        self.units = units

    def execute(self, x, codes, scale):
        (M, K), N = x.shape, codes.shape[0]
        self.saved = codes, scale
        numbers = product_numbers(M, N, K)
        return jt.code((M, N), "float32", [x, codes, scale], cpu_header=widening(NF4_HEADER, self.units),
                       cpu_src=numbers.code + NF4_FORWARD, data=numbers.data)

    def grad(self, grad_out):
        return nf4_input_grad(grad_out, *self.saved, self.units), None, None


def fused_nf4_linear(x: jt.Var, codes: jt.Var, scale: jt.Var) -> jt.Var:
    rows = x.shape[:-1]
    return Nf4Linear.apply(x.float32().reshape(-1, x.shape[-1]), codes, scale).reshape(*rows, codes.shape[0])


def plain_nf4_linear(x: jt.Var, codes: jt.Var, scale: jt.Var) -> jt.Var:
    return plain_bf16_linear(x, to_bf16(nf4_dequantized(codes, scale)))


# x [..., K] fp32 @ (the nf4 matrix of codes [N,K/2] uint8 and scales [N, ceil(K/64)] bf16)^T -> [..., N] fp32
nf4_linear = Kernel(fused_nf4_linear, plain_nf4_linear)
# each quantized storage's quantization and its inverse (the fp32 matrix it stands for)
QUANTIZERS = {"int8": quantize, "uint8": nf4_quantize}
DEQUANTIZERS = {"int8": dequantized, "uint8": nf4_dequantized}


def matrix_shape(weight: jt.Var) -> tuple:
    """The shape [N,K] of the matrix a base weight stands for (an nf4 one holds two weights a byte)."""
    return (weight.shape[0], 2 * weight.shape[1]) if weight.dtype == "uint8" else tuple(weight.shape)


def base_linear(x: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """x [..., K] fp32 @ weight [N,K]^T -> [..., N] fp32, for a weight in the base's storage: fp32, bf16, int8
    with its row scales `scale` [N], or nf4 codes with their group scales."""
    if weight.dtype == "int8":
        return int8_linear(x, weight, scale)
    if weight.dtype == "uint8":
        return nf4_linear(x, weight, scale)
    return linear(x, weight) if weight.dtype == "float32" else bf16_linear(x, weight)


def base_input_grad(grad_out: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """grad_out [M,N] fp32 @ weight [N,K] -> [M,K] fp32 for an fp32, int8 or nf4 base weight, fused."""
    if weight.dtype == "int8":
        return int8_input_grad(grad_out, weight, scale)
    if weight.dtype == "uint8":
        return nf4_input_grad(grad_out, weight, scale)
    return fused_linear_input_grad(grad_out, weight)


class BaseLinear(nn.Module):
    """A frozen base projection without bias (Meta's wq, w1, output, ...): `weight` [out,in], fp32, bf16 or
    int8, or nf4 codes [out,in/2]; beside int8 values `weight_scale` [out] (fp32), row n of the matrix being
    weight[n] * weight_scale[n], beside nf4 codes their bf16 group scales [out, ceil(in/64)]."""

    def __init__(self, in_features: int, out_features: int):
        self.weight = nn.Linear(in_features, out_features, bias=False).weight
        self.weight_scale = None

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out] fp32
        return base_linear(x, self.weight, self.weight_scale)


SCALE_SUFFIX = "_scale"  # a quantized matrix `<name>.weight` keeps its scales as `<name>.weight_scale`


def split_scales(base: dict) -> tuple:
    """A base's parameters (name -> Var) as (the tensors a checkpoint holds, {quantized matrix's name: its
    scales}): the scales are made from the matrix as it loads."""
    scales = {name[:-len(SCALE_SUFFIX)]: var for name, var in base.items() if name.endswith(SCALE_SUFFIX)}
    return {name: var for name, var in base.items() if not name.endswith(SCALE_SUFFIX)}, scales


def set_base_precision(model, precision: str):
    """Store the frozen base's matrices in the precision's storage (int8, nf4: the BaseLinears' whose matrix is
    not an embedding table, the tables in bf16); 1-D norm weights stay fp32."""
    if precision not in STORAGE_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(STORAGE_DTYPES)}")
    dtype = STORAGE_DTYPES[precision]
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not isinstance(module, BaseLinear):
            continue
        stored = str(module.weight.dtype)
        if module.weight_scale is not None and stored != dtype:  # back from int8 or nf4: fp32 here, cast below
            module.weight.assign(DEQUANTIZERS[stored](module.weight, module.weight_scale).stop_grad())
            module.weight_scale = None
        if dtype in QUANTIZERS and module.weight_scale is None and id(module.weight) not in tables:
            if dtype == "uint8":
                nf4_width(module.weight.shape[1], f"{name}.weight")
            values, scale = QUANTIZERS[dtype](module.weight)
            module.weight.assign(values.stop_grad())
            module.weight_scale = scale.stop_grad()
    table_dtype = "bfloat16" if dtype in QUANTIZERS else dtype
    for param in model.base_parameters().values():
        if len(param.shape) == 2 and param.dtype not in (table_dtype, *QUANTIZERS):
            param.assign(cast_to(param, table_dtype).stop_grad())
    model.freeze_base()
