"""Threaded single-pass CPU kernels for the elementwise work around the matmuls.

Jittor runs its own elementwise and reduction kernels on one thread; these run
each op (RoPE, the loss through the output matrix, the SwiGLU gate, RMSNorm) in one
OpenMP-parallel pass forward and one backward; the experts' own are in experts.py.
Each is a switch.Kernel: the fused pass next to its plain-Jittor reference, one switch between them.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .bf16 import bf16_bits_input_grad
from .precision import base_input_grad, base_linear
from .switch import Kernel

ROTATE_HEADER = cpp.source("rotate.h")
ROTATE_PAIRS = cpp.source("rope.cc")


def rotate_pairs(x: jt.Var, cos: jt.Var, sin: jt.Var, sign: float) -> jt.Var:
    """Rotate each (even, odd) pair of x [B,T,H,hd] by +-angle; cos/sin [T,hd/2]."""
    B, T, H, hd = x.shape
    numbers = cpp.Numbers().declare(B=B, T=T, H=H, half=hd // 2).declare("float", sign=sign)
    return jt.code(x.shape, "float32", [x.float32(), cos, sin], cpu_header=ROTATE_HEADER,
                   cpu_src=numbers.code + ROTATE_PAIRS, data=numbers.data)


class Rope(jt.Function):
    """RoPE in one threaded pass; its gradient is the rotation by the opposite angle."""

    def execute(self, x, cos, sin):
        self.saved = (cos, sin)
        return rotate_pairs(x, cos, sin, 1.0)

    def grad(self, grad_out):
        cos, sin = self.saved
        return rotate_pairs(grad_out, cos, sin, -1.0), None, None


def plain_rope(x: jt.Var, cos: jt.Var, sin: jt.Var) -> jt.Var:
    B, T, H, hd = x.shape
    pairs = x.reshape(B, T, H, hd // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # [B,T,H,hd/2]
    cos = cos.reshape(1, T, 1, hd // 2)
    sin = sin.reshape(1, T, 1, hd // 2)
    rotated = jt.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)  # [B,T,H,hd/2,2]
    return rotated.reshape(B, T, H, hd)


# Rotate adjacent pairs (x[2i], x[2i+1]) of each head vector: x [B,T,H,hd], cos/sin [T,hd/2] -> [B,T,H,hd]
rope = Kernel(lambda x, cos, sin: Rope.apply(x, cos, sin), plain_rope)


# nll [N] and, when a gradient will be asked for, softmax - onehot [N,V] (fp32, or bf16 bits for a bf16
# output matrix: cpp/cross_entropy.cc; an int8 one scales it by its rows' scales before rounding)
CROSS_ENTROPY_HEADER = cpp.source("cross_entropy.h")
CROSS_ENTROPY = cpp.source("cross_entropy.cc")

LOGIT_BYTES = 32 << 20  # fp32 logits alive at once: 2048 rows at a vocabulary of 4096, 65 at LLaMA-3's 128256
# Up to this many chunks of the loss run in the step's lazily built graph, which holds less at the step's peak than a
# forward run chunk by chunk (medium bf16: 467 against 747 MB, bench/loss_memory.py); more run one by one
LAZY_CHUNKS = 2


def logit_rows(vocab_size: int) -> int:
    return max(1, LOGIT_BYTES // (4 * vocab_size))


class ChunkedNLL(jt.Function):
    """nll [N] of h [N,D] through the frozen output matrix weight [V,D] (with its row scales [V] when int8),
    logit_rows(V) rows at a time (`chunk`, a subclass's). Past LAZY_CHUNKS chunks each runs before the next is
    built (sync), so [N,V] logits never exist. When a gradient will be asked for, each chunk's gradient to h before
    the per-row loss weight, (softmax - onehot) weight [n,D], is made while its logits exist: the backward only
    scales it by grad_nll, so the output matrix costs two matmuls, not three, and no logits are kept."""

    def execute(self, h, weight, targets, scale=None):
        wants_grad = not jt.flags.no_grad and not h.is_stop_grad()
        self.inputs = 3 if scale is None else 4
        rows = logit_rows(weight.shape[0])
        starts = range(0, h.shape[0], rows)
        nlls, grads = [], []
        for start in starts:
            nll, grad = self.chunk(h[start:start + rows], weight, targets[start:start + rows], scale, wants_grad)
            grads += [grad] if wants_grad else []
            if len(starts) > LAZY_CHUNKS:
                jt.sync([nll] + grads[-1:])
            nlls.append(nll)
        self.grad_h = jt.concat(grads) if len(grads) > 1 else (grads[0] if grads else None)
        return jt.concat(nlls) if len(nlls) > 1 else nlls[0]

    def grad(self, grad_nll):
        return (self.grad_h * grad_nll.unsqueeze(1),) + (None,) * (self.inputs - 1)


class FusedNLL(ChunkedNLL):
    """A chunk's nll and gradient in one op, cpp/cross_entropy.cc."""

    @staticmethod
    def chunk(h, weight, targets, scale, wants_grad) -> tuple:
        bits = weight.dtype == "bfloat16"
        with jt.no_grad():
            logits = base_linear(h, weight, scale)  # [n,V]
            n, V = logits.shape
            numbers = cpp.Numbers().declare(N=n, V=V)
            numbers.code += (f"#define GRAD {'out1_p' if wants_grad else 'nullptr'}\n"
                             f"typedef {'uint16_t' if bits else 'float'} GRAD_T;\n")
            outputs = jt.code([(n,)] + ([(n, V)] if wants_grad else []),
                              ["float32"] + (["bfloat16" if bits else "float32"] if wants_grad else []),
                              [logits, targets], cpu_header=CROSS_ENTROPY_HEADER,
                              cpu_src=numbers.code + CROSS_ENTROPY, data=numbers.data)
            if not wants_grad:
                return outputs[0], None
            grad = bf16_bits_input_grad(outputs[1], weight) if bits else base_input_grad(outputs[1], weight, scale)
            return outputs[0], grad  # [n], [n,D]


class PlainNLL(ChunkedNLL):
    """A chunk's nll through Jittor's own ops (rows_nll) and its gradient by Jittor's autograd through them: a GPU's
    path, where no [N,V] logits exist either."""

    @staticmethod
    def chunk(h, weight, targets, scale, wants_grad) -> tuple:
        rows = h.detach()
        if not wants_grad:
            return rows_nll(rows, weight, targets, scale), None
        rows.start_grad()
        nll = rows_nll(rows, weight, targets, scale)
        return nll.detach(), jt.grad(nll.sum(), rows)


def rows_nll(h: jt.Var, weight: jt.Var, targets: jt.Var, scale=None) -> jt.Var:
    """-log softmax(h weight^T)[target] of rows h [n,D], targets [n] -> [n], in Jittor's own ops."""
    log_probs = nn.log_softmax(base_linear(h, weight, scale), dim=-1)  # [n,V]
    return -jt.gather(log_probs, 1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_nll(chunks, h: jt.Var, weight: jt.Var, targets: jt.Var, scale=None) -> jt.Var:
    """h [B,T,D], targets [B,T] -> nll [B,T] through `chunks` (FusedNLL or PlainNLL)."""
    B, T, D = h.shape
    inputs = [h.reshape(B * T, D), weight.stop_grad(), targets.reshape(B * T).int32()]
    return chunks.apply(*inputs, *([] if scale is None else [scale])).reshape(B, T)


def fused_output_nll(h: jt.Var, weight: jt.Var, targets: jt.Var, scale=None) -> jt.Var:
    return chunked_nll(FusedNLL, h, weight, targets, scale)


def plain_output_nll(h: jt.Var, weight: jt.Var, targets: jt.Var, scale=None) -> jt.Var:
    return chunked_nll(PlainNLL, h, weight, targets, scale)


# -log softmax(h weight^T)[target] without [B,T,V] logits: h [B,T,D] fp32, weight [V,D] frozen (int8 with
# its row scales `scale` [V]), targets [B,T] int -> [B,T]
output_nll = Kernel(fused_output_nll, plain_output_nll)


SWIGLU_HEADER = cpp.source("swiglu.h")
SWIGLU_FORWARD = cpp.source("swiglu_forward.cc")
SWIGLU_BACKWARD = cpp.source("swiglu_backward.cc")


class SiluGate(jt.Function):
    """silu(gate) * up, the SwiGLU product, with its two gradients in one pass."""

    def execute(self, gate, up):
        self.saved = (gate, up)
        self.numbers = cpp.Numbers().declare(N=gate.numel())
        return jt.code(gate.shape, "float32", [gate, up], cpu_header=SWIGLU_HEADER,
                       cpu_src=self.numbers.code + SWIGLU_FORWARD, data=self.numbers.data)

    def grad(self, grad_out):
        gate, up = self.saved
        return jt.code([gate.shape, up.shape], ["float32", "float32"], [gate, up, grad_out],
                       cpu_header=SWIGLU_HEADER, cpu_src=self.numbers.code + SWIGLU_BACKWARD, data=self.numbers.data)


# silu(gate) * up for two fp32 tensors of one shape
silu_gate = Kernel(lambda gate, up: SiluGate.apply(gate.float32(), up.float32()), lambda gate, up: nn.silu(gate) * up)


RMS_HEADER = cpp.source("rms.h")
RMS_NORM_FORWARD = cpp.source("rms_norm_forward.cc")
RMS_NORM_BACKWARD = cpp.source("rms_norm_backward.cc")


class FrozenRMSNorm(jt.Function):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim; the gradient reaches x only
    (the norm weights belong to the frozen base).

    With branches=n it also returns x itself n times, for the other readers of x (the residual
    add, the router): the backward adds their gradients into dx in its own pass. Jittor would sum
    the gradients of a var read n + 1 times with n adds of its own, each one pass on one thread."""

    def execute(self, x, weight, eps, branches=0):
        D = x.shape[-1]
        self.numbers = cpp.Numbers().declare(N=x.numel() // D, D=D).declare("float", eps=eps)
        y, inv = jt.code([x.shape, (x.numel() // D,)], ["float32", "float32"], [x, weight],
                         cpu_header=RMS_HEADER, cpu_src=self.numbers.code + RMS_NORM_FORWARD, data=self.numbers.data)
        self.saved = (x, weight, inv.detach())
        return (y, *(x.reshape(x.shape) for _ in range(branches))) if branches else y

    def grad(self, grad_out, *branch_grads):
        x, weight, inv = self.saved
        present = [g for g in branch_grads if g is not None]
        if grad_out is None:  # only the branches were read
            return (sum_of(present) if present else None), None, None, None
        added = "".join(f" + in{4 + i}_p[r * D + i]" for i in range(len(present)))
        dx = jt.code(x.shape, "float32", [x, weight, inv, grad_out] + present,
                     cpu_src=self.numbers.code + f"#define BRANCH_GRADS{added}\n" + RMS_NORM_BACKWARD,
                     data=self.numbers.data)
        return dx, None, None, None


SUM_OF = cpp.source("sum_of.cc")


def sum_of(terms: list) -> jt.Var:
    """The elementwise sum of fp32 tensors of one shape, in one threaded pass."""
    if len(terms) == 1:
        return terms[0]
    added = " + ".join(f"in{i}_p[i]" for i in range(len(terms)))
    numbers = cpp.Numbers().declare(N=terms[0].numel())
    return jt.code(terms[0].shape, "float32", terms, cpu_src=numbers.code + f"#define TERMS {added}\n" + SUM_OF,
                   data=numbers.data)


class Sum(jt.Function):
    """a + b in one threaded pass (Jittor's add is one thread); the gradient reaches both as it is."""

    def execute(self, a, b):
        return sum_of([a, b])

    def grad(self, grad_out):
        return grad_out, grad_out


class Branches(jt.Function):
    """x returned n times for n readers, their gradients summed in one threaded pass (Jittor's own
    sum of a var's gradients is an add per extra reader, each on one thread)."""

    def execute(self, x, n):
        return tuple(x.reshape(x.shape) for _ in range(n))

    def grad(self, *grads):
        present = [g for g in grads if g is not None]
        return (sum_of(present) if present else None), None


def plain_rms_norm(x: jt.Var, weight: jt.Var, eps: float) -> jt.Var:
    x32 = x.float32()
    normed = x32 * jt.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    return normed.cast(x.dtype) * weight


# x [..., D] -> [..., D], statistics in fp32; the fused pass only for fp32 input and a frozen weight
rms_norm = Kernel(lambda x, weight, eps: FrozenRMSNorm.apply(x, weight, eps, 0), plain_rms_norm,
                  when=lambda x, weight, eps: x.dtype == "float32" and not weight.requires_grad)


def fused_rms_norm_branches(x, weight, eps, n):
    outputs = FrozenRMSNorm.apply(x, weight, eps, n)
    # a stop-grad x (layer 0's, from the frozen embedding) makes stop-grad outputs, so the kernels that read
    # them (the projections) skip the gradient to them
    return [y.stop_grad() for y in outputs] if x.is_stop_grad() else outputs


def plain_rms_norm_branches(x, weight, eps, n):
    return (rms_norm(x, weight, eps), *([x] * n))


def training_fp32(x, weight, *_):
    return not jt.flags.no_grad and x.dtype == "float32" and not weight.requires_grad


# (rms_norm(x), x, ..., x): the norm and n more readers of x [..., D], one backward for all
rms_norm_branches = Kernel(fused_rms_norm_branches, plain_rms_norm_branches, when=training_fp32)
# a + b, two fp32 tensors of one shape (the residual stream's adds)
residual_add = Kernel(lambda a, b: Sum.apply(a, b), lambda a, b: a + b,
                      when=lambda a, b: a.dtype == b.dtype == "float32" and a.shape == b.shape)
# x [...] fp32 for n readers: (x, ..., x), one backward for all
branches = Kernel(lambda x, n: Branches.apply(x, n), lambda x, n: (x,) * n,
                  when=lambda x, n: not jt.flags.no_grad and x.dtype == "float32")
