"""The frozen base's precision: its projections as BaseLinear, bf16 and int8 storage, their matmuls.

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
"""
import functools

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .linear import fused_linear_input_grad, linear
from .switch import Kernel, decoding

# --precision: the frozen base matrices' storage type (int8: the projections' and an untied output's;
# the embedding table takes bf16)
STORAGE_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8"}
# each storage type's name in C++ (cpp/storage.h)
STORAGES = {"float32": "FP32", "bfloat16": "BF16", "int8": "INT8"}

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


def bf16_rule(weight: jt.Var) -> bool:
    """Whether products with this base weight (and attention beside it) take the bf16 rule: a bf16 or
    int8 base."""
    return weight.dtype != "float32"


def matrix_code(inputs: cpp.CodeInputs, weight: jt.Var, scale=None) -> str:
    """The C++ BaseMatrix (cpp/storage.h) of a base weight and an int8 weight's row scales, their
    Vars and storage added to `inputs`."""
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


def base_linear(x: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """x [..., K] fp32 @ weight [N,K]^T -> [..., N] fp32, for a weight in the base's storage: fp32, bf16, or
    int8 with its row scales `scale` [N]."""
    if weight.dtype == "int8":
        return int8_linear(x, weight, scale)
    return linear(x, weight) if weight.dtype == "float32" else bf16_linear(x, weight)


def base_input_grad(grad_out: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """grad_out [M,N] fp32 @ weight [N,K] -> [M,K] fp32 for an fp32 or int8 base weight, fused."""
    if weight.dtype == "int8":
        return int8_input_grad(grad_out, weight, scale)
    return fused_linear_input_grad(grad_out, weight)


class BaseLinear(nn.Module):
    """A frozen base projection without bias (Meta's wq, w1, output, ...): `weight` [out,in], fp32, bf16 or
    int8; beside int8 values `weight_scale` [out] (fp32), row n of the matrix being weight[n] * weight_scale[n]."""

    def __init__(self, in_features: int, out_features: int):
        self.weight = nn.Linear(in_features, out_features, bias=False).weight
        self.weight_scale = None

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out] fp32
        return base_linear(x, self.weight, self.weight_scale)


SCALE_SUFFIX = "_scale"  # an int8 matrix `<name>.weight` keeps its row scales as `<name>.weight_scale`


def split_scales(base: dict) -> tuple:
    """A base's parameters (name -> Var) as (the tensors a checkpoint holds, {int8 matrix's name: its row
    scales}): the scales are made from the matrix as it loads."""
    scales = {name[:-len(SCALE_SUFFIX)]: var for name, var in base.items() if name.endswith(SCALE_SUFFIX)}
    return {name: var for name, var in base.items() if not name.endswith(SCALE_SUFFIX)}, scales


def set_base_precision(model, precision: str):
    """Store the frozen base's matrices in the precision's storage (int8: the BaseLinears' whose matrix is
    not an embedding table, the tables in bf16); 1-D norm weights stay fp32."""
    if precision not in STORAGE_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(STORAGE_DTYPES)}")
    dtype = STORAGE_DTYPES[precision]
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if not isinstance(module, BaseLinear):
            continue
        quantized = module.weight_scale is not None
        if dtype == "int8" and not quantized and id(module.weight) not in tables:
            values, scale = quantize(module.weight)
            module.weight.assign(values.stop_grad())
            module.weight_scale = scale.stop_grad()
        elif dtype != "int8" and quantized:  # back from int8: fp32 here, cast below
            module.weight.assign(dequantized(module.weight, module.weight_scale).stop_grad())
            module.weight_scale = None
    table_dtype = "bfloat16" if dtype == "int8" else dtype
    for param in model.base_parameters().values():
        if len(param.shape) == 2 and param.dtype not in (table_dtype, "int8"):
            param.assign(cast_to(param, table_dtype).stop_grad())
    model.freeze_base()
