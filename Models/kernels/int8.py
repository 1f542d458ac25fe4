"""`--precision int8`: a base matrix as int8 values with a scale per row (symmetric absmax, cpp/int8.h), its matmul.

An int8 matrix's product keeps the bf16 rule (bf16.py) on its values, which bf16 holds exactly: y = s * (bf16(x)
q^T), backwards dx = bf16(dy * s) q, the values widened inside the kernel (cpp/int8.h); its plain
reference widens them whole, on a GPU to bf16 for the half matmul. A matrix is quantized row by row as
its checkpoint streams in (Models/formats/reading.py) or, in memory, by `quantize`, both through one
C++ function.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .bf16 import product_numbers, rounded_to_bf16, widening
from .switch import Kernel, decoding

INT8_HEADER = cpp.source("int8.h")
QUANTIZED_MIN = 1e-30  # rows below it quantize to zeros (cpp/int8.h)
INT8_FORWARD = cpp.source("int8_forward.cc")
INT8_BACKWARD = cpp.source("int8_backward.cc")
QUANTIZE = cpp.source("int8_quantize.cc")


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
