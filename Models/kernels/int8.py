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
from .bf16 import StoredLinear, rounded_to_bf16
from .switch import Kernel

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


class Int8Linear(StoredLinear):
    """x [M,K] fp32 @ (scale [N] * values [N,K] int8)^T -> [M,N] fp32 by the int8 rule above. A decode step's
    product reads the values once (cpp/int8.h)."""
    HEADER, FORWARD, BACKWARD, ROWS = INT8_HEADER, INT8_FORWARD, INT8_BACKWARD, True


class PlainInt8Linear(jt.Function):
    """The plain reference of the int8 matmul on a CPU: the values widened whole, the rule's roundings in
    Jittor ops."""

    def execute(self, x, values, scale):
        self.saved = values, scale
        return nn.matmul_transpose(rounded_to_bf16(x), values.float32()) * scale

    def grad(self, grad_out):
        values, scale = self.saved
        return nn.matmul(rounded_to_bf16(grad_out * scale), values.float32()), None, None


def plain_int8_linear(x: jt.Var, values: jt.Var, scale: jt.Var) -> jt.Var:
    if jt.flags.use_cuda:  # the values widened to bf16 (exactly), the GPU's half matmul, then the row scales
        return nn.matmul_transpose(x.cast("bfloat16"), values.cast("bfloat16")).float32() * scale
    rows = x.shape[:-1]
    out = PlainInt8Linear.apply(x.float32().reshape(-1, x.shape[-1]), values, scale)
    return out.reshape(*rows, values.shape[0])


# x [..., K] fp32 @ (scale [N] * values [N,K] int8)^T -> [..., N] fp32
int8_linear = Kernel(Int8Linear.fused, plain_int8_linear)
