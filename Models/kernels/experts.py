"""The experts' fused CPU kernels: adding an expert's output under its router weight.

An expert's output is added to the projection it sits beside, times its type weight
[B,T]. A mixture adds a ready [B,T,N] delta (add_weighted); a single expert adds its
last projection fused with the weight (add_projected), so only its narrow input is
kept for the backward; the FFN's down-projection LoRA reads the SwiGLU hidden
through gated_projection, which recomputes that [B,T,F] hidden in the backward
instead of keeping it. A base projection and its LoRA expert as one op is Models/kernels/projections.py.
Each is a switch.Kernel beside its plain-Jittor reference.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .elementwise import silu_gate
from .linear import linear
from .bf16 import bf16_values, to_bf16
from .switch import Kernel

EXPERTS_HEADER = cpp.source("sgemm_ops.h")

ADD_WEIGHTED_FORWARD = cpp.source("add_weighted_forward.cc")
ADD_WEIGHTED_BACKWARD = cpp.source("add_weighted_backward.cc")


class AddWeighted(jt.Function):
    """base + delta * weight[..., None] * scale: an expert's output added under its router weight."""

    def execute(self, base, delta, weight, scale):
        F = base.shape[-1]
        self.numbers = cpp.Numbers().declare(N=base.numel() // F, F=F).declare("float", scale=scale)
        self.saved = (delta, weight)
        return jt.code(base.shape, "float32", [base, delta, weight], cpu_src=self.numbers.code + ADD_WEIGHTED_FORWARD,
                       data=self.numbers.data)

    def grad(self, grad_out):
        delta, weight = self.saved
        ddelta, dweight = jt.code([delta.shape, weight.shape], ["float32", "float32"], [delta, weight, grad_out],
                                  cpu_src=self.numbers.code + ADD_WEIGHTED_BACKWARD, data=self.numbers.data)
        return grad_out, ddelta, dweight, None


# base [..., F] + delta [..., F] * weight [...] * scale, all fp32 (a mixture of experts' output)
add_weighted = Kernel(
    lambda base, delta, weight, scale: AddWeighted.apply(base.float32(), delta.float32(), weight.float32(), scale),
    lambda base, delta, weight, scale: base + delta * scale * weight.unsqueeze(-1))


# out = base + w * scale * (u up^T + bias): the weight applied on the R-wide side, so neither pass holds
# the [M,N] expert output
ADD_PROJECTED_FORWARD = cpp.source("add_projected_forward.cc")
ADD_PROJECTED_BACKWARD = cpp.source("add_projected_backward.cc")
ADD_PROJECTED_BIAS_GRAD = cpp.source("add_projected_bias_grad.cc")


class AddProjected(jt.Function):
    """base + w * scale * (u up^T + bias): a single expert's last projection and its router weight,
    fused. Only u and w are kept for the backward: [M,R] instead of the [M,N] expert output."""

    def execute(self, base, u, up, weight, scale, bias=None):
        N, R = up.shape
        M = base.numel() // N
        self.numbers = cpp.Numbers().declare(M=M, N=N, R=R).declare("float", scale=scale)
        self.numbers.code += f"const float *bias = {'in4_p' if bias is not None else 'nullptr'};\n"
        self.saved = (u, up, weight, bias)
        inputs = [base, u, up, weight] + ([bias] if bias is not None else [])
        return jt.code(base.shape, "float32", inputs, cpu_header=EXPERTS_HEADER, data=self.numbers.data,
                       cpu_src=self.numbers.code + "const float *base = in0_p, *u = in1_p, *up = in2_p, *w = in3_p;\n"
                       + ADD_PROJECTED_FORWARD)

    def grad(self, grad_out):
        u, up, weight, bias = self.saved
        has_bias = bias is not None
        outputs = [u.shape, up.shape, weight.shape] + ([bias.shape] if has_bias else [])
        inputs = [u, up, weight, grad_out] + ([bias] if has_bias else [])
        grads = jt.code(outputs, ["float32"] * len(outputs), inputs,
                        cpu_header=EXPERTS_HEADER, data=self.numbers.data,
                        cpu_src=self.numbers.code + "const float *u = in0_p, *up = in1_p, *w = in2_p, *g = in3_p;\n"
                        + ADD_PROJECTED_BACKWARD + (ADD_PROJECTED_BIAS_GRAD if has_bias else ""))
        du, dup, dw = grads[:3]
        return (grad_out, du, dup, dw, None) + ((grads[3],) if has_bias else ())


def fused_add_projected(base, u, up, bias, weight, scale):
    args = (base.float32(), u.float32(), up, weight.float32(), scale)
    return AddProjected.apply(*args) if bias is None else AddProjected.apply(*args, bias)


def plain_add_projected(base, u, up, bias, weight, scale):
    projected = nn.matmul_transpose(u, up) if bias is None else nn.matmul_transpose(u, up) + bias
    return base + projected * scale * weight.unsqueeze(-1)


# base [..., N] + weight [...] * scale * (u [..., R] up [N,R]^T + bias [N]), all fp32
add_projected = Kernel(fused_add_projected, plain_add_projected)


# hidden = silu(gate) * up and u = hidden A^T in one op that keeps only gate and up; the backward
# rebuilds the hidden a block of rows at a time instead of keeping it
GATED_FORWARD = cpp.source("gated_projection_forward.cc")
GATED_BACKWARD = cpp.source("gated_projection_backward.cc")


class GatedProjection(jt.Function):
    """(silu(gate) * up, (silu(gate) * up) A^T): the SwiGLU hidden and a LoRA's low-rank view of it.
    Only gate and up are kept, as bf16 bits with `bf16` (and the hidden made from those); one pass gives
    both gradients for the two uses of the hidden."""

    def execute(self, gate, up, A, bf16):
        R, F = A.shape
        M = gate.numel() // F
        if bf16:
            gate, up = to_bf16(gate), to_bf16(up)
        self.numbers = cpp.Numbers().declare(M=M, F=F, R=R)
        self.numbers.code += f"typedef {'uint16_t' if bf16 else 'float'} GATE_T;\n"
        self.saved = (gate, up, A)
        return tuple(jt.code([gate.shape, (M, R)], ["float32", "float32"], [gate, up, A], cpu_header=EXPERTS_HEADER,
                             cpu_src=self.numbers.code + GATED_FORWARD, data=self.numbers.data))

    def grad(self, grad_hidden, grad_u):
        gate, up, A = self.saved
        if grad_hidden is None:
            grad_hidden = jt.zeros(gate.shape, "float32")
        if grad_u is None:
            grad_u = jt.zeros((gate.numel() // A.shape[1], A.shape[0]), "float32")
        return tuple(jt.code([gate.shape, up.shape, A.shape], ["float32"] * 3, [gate, up, A, grad_hidden, grad_u],
                             cpu_header=EXPERTS_HEADER, cpu_src=self.numbers.code + GATED_BACKWARD,
                             data=self.numbers.data))


def fused_gated_projection(gate, up, A, bf16=False):
    hidden, u = GatedProjection.apply(gate.float32(), up.float32(), A, bf16)
    return hidden, u.reshape(*gate.shape[:-1], A.shape[0])


def plain_gated_projection(gate, up, A, bf16=False):
    if bf16:
        gate, up = bf16_values(gate), bf16_values(up)
    hidden = silu_gate.plain(gate, up)
    return hidden, linear(hidden, A)


# gate, up [..., F], A [R,F] -> hidden = silu(gate) * up [..., F], hidden A^T [..., R]; with bf16, gate and
# up rounded to bf16 first
gated_projection = Kernel(fused_gated_projection, plain_gated_projection)
