"""Attention through oneDNN's sgemm: causal (with the KV cache) and to Soft MoA's learned prompt.

Jittor's CPU `matmul` maps 2-D products to oneDNN, but batched ones
([B,H,T,hd] @ [B,H,hd,S]) fall back to a broadcast-multiply-reduce that ran
4-8x slower and dominated our training step, and its softmax is single-threaded.
FusedAttention calls oneDNN's sgemm per (batch, head) on strided views instead.
Each is a switch.Kernel beside its plain-Jittor reference.
"""
import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .bf16 import cpu_has_bf16_units
from .switch import GEMV_ROWS, Kernel

# The products take the base's precision (cpp/attention.h); the causal attention's two bodies each
# start with cpp/attention_key_spans.cc.
ATTENTION_HEADER = cpp.source("attention.h")
ATTENTION_FORWARD = cpp.source("attention_forward.cc")
ATTENTION_BACKWARD = cpp.source("attention_backward.cc")


def operand_type(bf16: bool) -> tuple:
    """(the C++ operand type of the products, the Jittor dtype of a kept operand): fp32, bf16 bits on
    the bf16 units, else rounded fp32."""
    if not bf16:
        return "typedef float E; const bool ROUND = false;\n", "float32"
    if cpu_has_bf16_units():
        return "typedef uint16_t E; const bool ROUND = true;\n", "bfloat16"
    return "typedef float E; const bool ROUND = true;\n", "float32"


class FusedAttention(jt.Function):
    """softmax(q k^T * scale + mask) v with grouped kv heads, in the [B,T,heads,hd] layout.

    One C++ loop per (batch, head) calls oneDNN's gemm with strides instead of
    transposing, and does the masked softmax in place, a block of 64 queries at a time;
    the backward recomputes each block's probabilities from the rows' log-sum-exp
    and accumulates each kv head's gradient over its query group. bf16: the products'
    operands rounded to bf16 (see ATTENTION_HEADER); when a gradient will be asked for, the
    forward keeps those rounded q, k, v (bf16 bits on the bf16 units: half the bytes of the
    fp32 q, k, v, which are then not kept) and the backward reads them as they are.
    """

    def execute(self, q, k, v, mask, bf16=False):
        # q [B,T,H,hd], k/v [B,S,Hkv,hd] (fp32, or a bf16 KV cache when no gradient is asked), mask [T,S]
        # -> out [B,T,H,hd]
        B, T, H, hd = q.shape
        S, Hkv = k.shape[1], k.shape[2]
        operand, kept_type = operand_type(bf16)
        numbers = (cpp.Numbers().declare(B=B, T=T, H=H, hd=hd, S=S, Hkv=Hkv, n_rep=H // Hkv)
                   .declare("float", scale=1.0 / float(np.sqrt(hd))).declare("bool", KV_BITS=k.dtype == "bfloat16"))
        numbers.code += operand
        keep = bf16 and not jt.flags.no_grad  # the rounded operands, for the backward
        kept = "(E *)out2_p, *k_kept = (E *)out3_p, *v_kept = (E *)out4_p" if keep else \
            "nullptr, *k_kept = nullptr, *v_kept = nullptr"
        outputs = jt.code([(B, T, H, hd), (B, H, T)] + ([q.shape, k.shape, v.shape] if keep else []),
                          ["float32", "float32"] + [kept_type] * (3 if keep else 0), [q, k, v, mask],
                          cpu_header=ATTENTION_HEADER, data=numbers.data,
                          cpu_src=numbers.code + f"const float *mask = in3_p; E *q_kept = {kept};\n"
                          + ATTENTION_FORWARD)
        out, lse = outputs[:2]
        operands = [t.detach() for t in outputs[2:]] if keep else [q, k, v]
        self.saved = (operands, lse.detach(), mask, numbers)
        return out

    def grad(self, grad_out):
        (q, k, v), lse, mask, numbers = self.saved
        dq, dk, dv = jt.code([q.shape, k.shape, v.shape], ["float32"] * 3, [q, k, v, lse, grad_out, mask],
                             cpu_header=ATTENTION_HEADER, data=numbers.data,
                             cpu_src=numbers.code + "const float *mask = in5_p;\n" + ATTENTION_BACKWARD)
        return dq, dk, dv, None, None


def fused_attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var, bf16: bool = False) -> jt.Var:
    # a decode step's few queries stay fp32: rounding would cost a pass over the whole cache; a bf16
    # cache is read as it is there (widening it whole would cost that pass too)
    bf16 = bf16 and q.shape[0] * q.shape[1] > GEMV_ROWS
    if not bf16 and k.dtype == "bfloat16" and jt.flags.no_grad:
        return FusedAttention.apply(q.float32(), k, v, mask, False)
    return FusedAttention.apply(q.float32(), k.float32(), v.float32(), mask, bf16)


def plain_attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var, bf16: bool = False) -> jt.Var:
    """The same attention in plain Jittor ops, fp32 products (bf16 is the fused kernels' rule only); k and
    v may be a bf16 KV cache."""
    k, v = k.float32(), v.float32()
    n_rep = q.shape[2] // k.shape[2]
    keys = repeat_kv(k, n_rep).transpose(0, 2, 3, 1)  # [B,H,hd,S]
    values = repeat_kv(v, n_rep).transpose(0, 2, 1, 3)  # [B,H,S,hd]
    scores = nn.matmul(q.transpose(0, 2, 1, 3), keys) / float(np.sqrt(q.shape[-1])) + mask  # [B,H,T,S]
    return nn.matmul(nn.softmax(scores.float32(), dim=-1), values).transpose(0, 2, 1, 3)  # [B,T,H,hd]


def repeat_kv(x: jt.Var, n_rep: int) -> jt.Var:
    """[B,S,Hkv,hd] -> [B,S,Hkv*n_rep,hd], each kv head repeated n_rep times in a row."""
    if n_rep == 1:
        return x
    B, S, Hkv, hd = x.shape
    return x.reshape(B, S, Hkv, 1, hd).broadcast((B, S, Hkv, n_rep, hd)).reshape(B, S, Hkv * n_rep, hd)


# q [B,T,H,hd], k/v [B,S,Hkv,hd], additive mask [T,S], bf16 (the products' rule) -> [B,T,H,hd]
attention = Kernel(fused_attention, plain_attention)


# Attention to the learned prompt (Soft MoA's prompt expert): L keys and values shared by the whole
# batch, no mask. The batch's rows are one matrix per head, so each product is one sgemm over all
# B*T rows (a few dozen calls per layer) instead of one per (sequence, head, block of 64 queries):
# with L in the tens, those calls cost more than they computed. The op also weighs the result by
# the head's gate and the row's type weight and adds it to `base` (the causal attention's output).
PROMPT_ATTENTION_HEADER = cpp.source("prompt_attention.h")
PROMPT_ATTENTION_FORWARD = cpp.source("prompt_attention_forward.cc")
PROMPT_ATTENTION_BACKWARD = cpp.source("prompt_attention_backward.cc")


class PromptAttention(jt.Function):
    """base + gate[h] * type_weight[b,t] * softmax(q k^T * scale) v over L prompt rows shared by the
    batch; keeps the probabilities [B,T,H,L] (small) for the backward."""

    def execute(self, q, k, v, gate, type_weight, base):
        # q [B,T,H,hd], k/v [L, Hkv*hd], gate [H], type_weight [B,T], base [B,T,H,hd] -> [B,T,H,hd]
        B, T, H, hd = q.shape
        L, Hkv = k.shape[0], k.shape[1] // hd
        self.numbers = (cpp.Numbers().declare(BT=B * T, H=H, hd=hd, L=L, Hkv=Hkv, n_rep=H // Hkv)
                        .declare("float", scale=1.0 / float(np.sqrt(hd))))
        out, probs = jt.code([(B, T, H, hd), (B, T, H, L)], ["float32", "float32"], [q, k, v, gate, type_weight, base],
                             cpu_header=PROMPT_ATTENTION_HEADER, cpu_src=self.numbers.code + PROMPT_ATTENTION_FORWARD,
                             data=self.numbers.data)
        self.saved = (q, k, v, probs.detach(), gate, type_weight)
        return out

    def grad(self, grad_out):
        q, k, v, probs, gate, type_weight = self.saved
        dq, dk, dv, dgate, dweight = jt.code([q.shape, k.shape, v.shape, gate.shape, type_weight.shape], ["float32"] * 5,
                                             [q, k, v, probs, grad_out, gate, type_weight],
                                             cpu_header=PROMPT_ATTENTION_HEADER, data=self.numbers.data,
                                             cpu_src=self.numbers.code + PROMPT_ATTENTION_BACKWARD)
        return dq, dk, dv, dgate, dweight, grad_out


def fused_prompt_attention(q, k, v, gate, type_weight, base):
    B, T = q.shape[:2]
    if type_weight is None:  # not routed: weight 1
        type_weight = jt.ones((B, T), "float32").stop_grad()
    return PromptAttention.apply(q.float32(), k.float32(), v.float32(), gate.float32(), type_weight.float32(),
                                 base.float32())


def plain_prompt_attention(q, k, v, gate, type_weight, base):
    B, T, H, hd = q.shape
    L, Hkv = k.shape[0], k.shape[1] // hd
    kv_shape = (B, L, Hkv, hd)
    keys, values = (t.reshape(1, L, Hkv, hd).broadcast(kv_shape) for t in (k, v))
    out = plain_attention(q, keys, values, jt.zeros((T, L), "float32")) * gate.reshape(1, 1, H, 1)
    return base + (out if type_weight is None else out * type_weight.reshape(B, T, 1, 1))


# base [B,T,H,hd] + gate [H] * type_weight [B,T] (or None) * attention of q [B,T,H,hd] to the prompt's
# keys/values [L, Hkv*hd] (the same for every sequence) -> [B,T,H,hd]
prompt_attention = Kernel(fused_prompt_attention, plain_prompt_attention)
