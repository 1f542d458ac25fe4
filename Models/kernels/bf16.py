"""The bf16 rule and its matmul: fp32 -> bf16 rounding, bf16 base weights' products.

A bf16 projection runs `bf16_linear`, fp32 in and out, with one rule
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
fp32 -> bf16 conversion of the project (precision.set_base_precision, checkpoint loads) goes
through it. The int8 and nf4 products (int8.py, nf4.py) keep the same rule.
"""
import functools

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .switch import Kernel, decoding

ROUND_HEADER = cpp.source("bf16_bits.h")
ROUND = cpp.source("bf16_round.cc")
BF16_HEADER = cpp.source("bf16.h")
BF16_FORWARD = cpp.source("bf16_forward.cc")
BF16_BACKWARD = cpp.source("bf16_backward.cc")
BF16_BACKWARD_BITS = cpp.source("bf16_backward_bits.cc")


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
    """A bf16, int8 or nf4 product's sizes, and whether it is a decode step's."""
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


class StoredLinear(jt.Function):
    """x [M,K] fp32 @ (a base matrix stored quantized: its values and their scales)^T -> [M,N] fp32, gradient to x
    only, by the bf16 rule on the matrix it stands for, the values widened inside the kernel. A storage's subclass
    names its C++ (HEADER, FORWARD, BACKWARD), the in-dimension its values hold (in_features) and whether a decode
    step's rows past GEMV_ROWS have a kernel of their own (ROWS); units False: the widening forms (see widening)."""
    HEADER = FORWARD = BACKWARD = ""
    ROWS = False

    def __init__(self, units: bool = True):
        self.units = units

    @staticmethod
    def in_features(values: jt.Var) -> int:
        return values.shape[1]

    def execute(self, x, values, scale):
        (M, K), N = x.shape, values.shape[0]
        self.saved = values, scale
        numbers = product_numbers(M, N, K, self.ROWS and decoding(x, values))
        return jt.code((M, N), "float32", [x, values, scale], cpu_header=widening(self.HEADER, self.units),
                       cpu_src=numbers.code + self.FORWARD, data=numbers.data)

    def grad(self, grad_out):
        return self.input_grad(grad_out, *self.saved, self.units), None, None

    @classmethod
    def input_grad(cls, grad_out: jt.Var, values: jt.Var, scale: jt.Var, units: bool = True) -> jt.Var:
        """grad_out [M,N] fp32 @ the stored matrix [N,K] -> [M,K] fp32 by the rule, through the fused kernel."""
        (M, N), K = grad_out.shape, cls.in_features(values)
        numbers = product_numbers(M, N, K)
        return jt.code((M, K), "float32", [grad_out, values, scale], cpu_header=widening(cls.HEADER, units),
                       cpu_src=numbers.code + cls.BACKWARD, data=numbers.data)

    @classmethod
    def fused(cls, x: jt.Var, values: jt.Var, scale: jt.Var) -> jt.Var:
        """x [..., K] through the fused kernel: [..., N]."""
        rows = x.shape[:-1]
        return cls.apply(x.float32().reshape(-1, x.shape[-1]), values, scale).reshape(*rows, values.shape[0])


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

