"""Linears through oneDNN's sgemm and, for the few rows of a decode step, one GEMV pass."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .switch import GEMV_ROWS, Kernel

LINEAR_HEADER = cpp.source("linear.h")
GEMV_PRODUCT = cpp.source("linear_gemv.cc")
SGEMM_PRODUCT = cpp.source("linear_sgemm.cc")
ADD_BIAS = cpp.source("linear_bias.cc")
INPUT_GRAD = cpp.source("linear_input_grad.cc")
LINEAR_BACKWARD = cpp.source("linear_backward.cc")


class FusedLinear(jt.Function):
    """x [M,K] @ w [N,K]^T + b [N] as one oneDNN sgemm op: Jittor's own nn.Linear builds a
    broadcast-multiply-sum in Python (reshapes, broadcasts, a flag scope) at every call,
    which dominated a decode step."""

    def execute(self, x, weight, bias=None):
        (M, K), N = x.shape, weight.shape[0]
        self.trains = weight.requires_grad or (bias is not None and bias.requires_grad)  # frozen: dx only
        self.numbers = cpp.Numbers().declare(M=M, N=N, K=K)
        self.saved = (x if self.trains else None, weight, bias)  # a frozen weight's dx needs no x
        self.x_shape = (M, K)
        product = GEMV_PRODUCT if M <= GEMV_ROWS else SGEMM_PRODUCT
        if bias is None:
            return jt.code((M, N), "float32", [x, weight], cpu_header=LINEAR_HEADER,
                           cpu_src=self.numbers.code + product, data=self.numbers.data)
        return jt.code((M, N), "float32", [x, weight, bias], cpu_header=LINEAR_HEADER,
                       cpu_src=self.numbers.code + product + ADD_BIAS, data=self.numbers.data)

    def grad(self, grad_out):
        x, weight, bias = self.saved
        (M, K), N = self.x_shape, weight.shape[0]
        if not self.trains:  # a frozen weight: no [N,K] gradient buffer at all
            dx = fused_linear_input_grad(grad_out, weight)
            return (dx, None, None) if bias is not None else (dx, None)
        dx, dw, db = jt.code([(M, K), (N, K), (N,)], ["float32"] * 3, [grad_out, x, weight],
                             cpu_header=LINEAR_HEADER,
                             cpu_src=self.numbers.code + "const float *W = in2_p;\n" + LINEAR_BACKWARD,
                             data=self.numbers.data)
        return (dx, dw, db) if bias is not None else (dx, dw)


def fused_linear_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    """grad_out [M,N] @ weight [N,K] -> [M,K], fp32: the gradient a linear passes to its input."""
    (M, N), K = grad_out.shape, weight.shape[1]
    numbers = cpp.Numbers().declare(M=M, N=N, K=K)
    return jt.code((M, K), "float32", [grad_out, weight], cpu_header=LINEAR_HEADER,
                   cpu_src=numbers.code + "const float *W = in1_p;\n" + INPUT_GRAD, data=numbers.data)


def fused_linear(x: jt.Var, weight: jt.Var, bias=None) -> jt.Var:
    rows = x.shape[:-1]
    flat = x.float32().reshape(-1, x.shape[-1])
    out = FusedLinear.apply(flat, weight) if bias is None else FusedLinear.apply(flat, weight, bias)
    return out.reshape(*rows, weight.shape[0])


def plain_linear(x: jt.Var, weight: jt.Var, bias=None) -> jt.Var:
    out = nn.matmul_transpose(x, weight)
    return out if bias is None else out + bias


# x [..., K] @ weight [N,K]^T (+ bias [N]) -> [..., N], all fp32
linear = Kernel(fused_linear, plain_linear, when=lambda x, weight, bias=None: weight.dtype == "float32")


class Linear(nn.Linear):
    """nn.Linear (same init, same `weight`/`bias` names) through the `linear` kernel."""

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out]
        return linear(x, self.weight, self.bias)
