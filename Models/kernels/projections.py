"""A frozen base projection and its LoRA expert as one op: y = base(x) + w * scale * (x A^T) B^T.

A `Projection` is a frozen base weight and, if it has one, its expert's `ExpertTerm`. Decoding (no
gradient, a few rows): one GEMV pass over the base's weights and the expert's, per projection
(gemv_lora_projections). Training: the projections that read one input (Q, K and V; the FFN's gate
and up) are one op forward and one backward (LoRAProjections): each expert's output is written
first and the base's product adds onto it (beta 1), and backward every projection's share of dx,
the experts' and the bases', accumulates into one dx. No expert output, no per-projection dx and
no gradient addition exists as a tensor, and a projection without an expert is just its base
product. The FFN's down projection reads the SwiGLU hidden (swiglu_down). All keep the bf16 rule of
Models/kernels/bf16.py for bf16, int8 and nf4 base weights.
"""
from dataclasses import dataclass, replace
from typing import Optional

import Utils.jittor_env  # noqa: F401
import jittor as jt

from . import cpp
from .elementwise import silu_gate
from .experts import add_projected, gated_projection
from .linear import linear
from .bf16 import bf16_values, to_bf16
from .precision import base_linear, bf16_rule, matrix_code
from .switch import Kernel, decoding

LORA_PROJECT_HEADER = cpp.source("lora_project.h")
LORA_PROJECT = cpp.source("lora_project.cc")
PROJECTIONS_HEADER = cpp.source("projections.h")
PROJECTIONS_FORWARD = cpp.source("projections_forward.cc")


@dataclass(frozen=True)
class ExpertTerm:
    """One LoRA expert's term of the mixture, route_weight * scale * (x A^T) B^T, added to the output of
    the projection it sits beside."""
    A: jt.Var  # [r, in]
    B: jt.Var  # [out, r]
    route_weight: Optional[jt.Var]  # [...] (x's rows): its family's type weight; None: weight 1
    scale: float  # alpha / r


@dataclass(frozen=True)
class Projection:
    """base(x) = x W^T for the frozen base_weight W [out, in] (fp32, bf16, or int8 with its row scales
    base_scale [out]), plus its expert's term."""
    base_weight: jt.Var
    expert: Optional[ExpertTerm] = None
    base_scale: Optional[jt.Var] = None


def flat_vars(projections: list) -> list:
    """The projections' Vars in one list, as LoRAProjections takes them: every base weight, then each
    expert's A, B and route weight (where it has one)."""
    experts = [p.expert for p in projections if p.expert is not None]
    return ([p.base_weight for p in projections]
            + [v for e in experts for v in (e.A, e.B, e.route_weight) if v is not None])


def with_vars(projections: list, tensors) -> list:
    """The projections with their Vars replaced by `tensors`, given in flat_vars' order: a jt.Function's
    execute gets taped copies of its Var arguments, and the op must read those for the gradient."""
    supply = iter(tensors)
    bases = [next(supply) for _ in projections]

    def term(e: ExpertTerm) -> ExpertTerm:
        A, B = next(supply), next(supply)
        return ExpertTerm(A, B, None if e.route_weight is None else next(supply), e.scale)
    return [Projection(W, None if p.expert is None else term(p.expert), p.base_scale)
            for W, p in zip(bases, projections)]


def expert_pointers(inputs: cpp.CodeInputs, expert) -> tuple:
    """The C++ names of an expert's A, B and route weight, added to `inputs` (nullptr where absent)."""
    if expert is None:
        return "nullptr", "nullptr", "nullptr"
    return inputs.pointer(expert.A), inputs.pointer(expert.B), inputs.pointer(expert.route_weight)


def projection_numbers(numbers: cpp.Numbers, i: int, p: Projection) -> tuple:
    """The C++ reading projection i's output size N, its expert's rank and scale (0 and 0.0 for none)."""
    e = p.expert
    return (numbers.value(f"N{i}", p.base_weight.shape[0]), numbers.value(f"R{i}", 0 if e is None else e.A.shape[0]),
            numbers.value(f"scale{i}", 0.0 if e is None else e.scale, "float"))


class LoRAProjections(jt.Function):
    """Projections of one x [M,K]: y_i = base_i(x) + w_i * scale_i * (x A_i^T) B_i^T for those with an
    expert, base_i(x) for the others; one op forward (keeping x and each u_i = x A_i^T) and one
    backward (dx whole; dA_i, dB_i, dw_i). Called as apply(projections, x, *flat_vars(projections))."""

    def execute(self, projections, x, *tensors):
        return self.forward([x], projections, tensors)

    def input_code(self, pointers: list, outputs: cpp.CodeOutputs) -> str:
        """C++ declaring x [M,K] from the op's inputs (their names in `pointers`); scratch it needs is
        among `outputs` after the op's own."""
        return f"const float *x = {pointers[0]};\n"

    def input_grads_code(self, pointers: list, outputs: cpp.CodeOutputs, needs_x: bool, needs_dx: bool) -> tuple:
        """(C++ declaring x (where the experts' dA read it) and dx [M,K] (null where no gradient is asked
        for the input), with the inputs' gradients first among `outputs`; C++ ending the backward)."""
        dx = outputs.pointer(self.saved[0][0].shape) if needs_dx else "nullptr"
        return f"const float *x = {pointers[0]};\nfloat *dx = {dx};\n", ""

    def forward(self, xs, projections, tensors):
        projections = with_vars(projections, tensors)
        M, K = xs[0].shape
        self.saved = (xs, projections)
        self.numbers = (cpp.Numbers().declare(M=M, K=K)
                        .declare("bool", BF16_RULE=bf16_rule(projections[0].base_weight)))
        inputs, outputs = cpp.CodeInputs(), cpp.CodeOutputs()
        pointers = [inputs.pointer(v) for v in xs]
        bases = [matrix_code(inputs, p.base_weight, p.base_scale) for p in projections]
        experts = [expert_pointers(inputs, p.expert) for p in projections]
        ys = [outputs.pointer((M, p.base_weight.shape[0])) for p in projections]
        us = [outputs.pointer((M, p.expert.A.shape[0])) if p.expert else "nullptr" for p in projections]
        code = self.input_code(pointers, outputs) + PROJECTIONS_FORWARD
        for i, (p, W, (A, B, w), y, u) in enumerate(zip(projections, bases, experts, ys, us)):
            N, R, scale = projection_numbers(self.numbers, i, p)
            code += f"project_forward(M, {N}, K, {R}, x, xb, {W}, {A}, {B}, {w}, {scale}, {y}, {u});\n"
        results = jt.code(outputs.shapes, ["float32"] * len(outputs.shapes), inputs.vars,
                          cpu_header=inputs.header(PROJECTIONS_HEADER), cpu_src=self.numbers.code + code,
                          data=self.numbers.data)
        kept = iter(results[len(projections):])
        self.us = [next(kept).detach() if p.expert else None for p in projections]
        return tuple(results[:len(projections)]) if len(projections) > 1 else results[0]

    def grad(self, *grads):
        xs, projections = self.saved
        M = xs[0].shape[0]
        # a stop-grad input (layer 0's, from the frozen embedding: LLaMA.hidden) gets no gradient computed
        needs_dx = self.input_mask[1] != -2
        inputs, outputs = cpp.CodeInputs(), cpp.CodeOutputs()
        pointers = [inputs.pointer(v) for v in xs]
        bases = [matrix_code(inputs, p.base_weight, p.base_scale) for p in projections]
        experts = [expert_pointers(inputs, p.expert) for p in projections]
        us = [inputs.pointer(u) for u in self.us]
        gs = [inputs.pointer(g if g is not None else jt.zeros((M, p.base_weight.shape[0]), "float32"))
              for g, p in zip(grads, projections)]
        code, end = self.input_grads_code(pointers, outputs, any(p.expert for p in projections), needs_dx)
        n = len(outputs.shapes)  # the inputs' gradients come first
        for i, (p, W, (A, B, w), u, g) in enumerate(zip(projections, bases, experts, us, gs)):
            N, R, scale = projection_numbers(self.numbers, i, p)
            e = p.expert
            dA, dB, dw = ((outputs.pointer(e.A.shape), outputs.pointer(e.B.shape),
                           outputs.pointer(e.route_weight.shape) if e.route_weight is not None else "nullptr")
                          if e else ("nullptr",) * 3)
            code += (f"project_backward(M, {N}, K, {R}, x, {W}, {A}, {B}, {w}, {scale}, {u}, {g}, "
                     f"{'0.f' if i == 0 else '1.f'}, dx, {dA}, {dB}, {dw});\n")
        results = jt.code(outputs.shapes, ["float32"] * len(outputs.shapes), inputs.vars,
                          cpu_header=inputs.header(PROJECTIONS_HEADER), cpu_src=self.numbers.code + code + end,
                          data=self.numbers.data)
        # gradients in apply's argument order: projections, the inputs, then flat_vars (the experts' A, B,
        # w follow the inputs' gradients)
        return (None, *results[:n], *[None] * (len(xs) - n)) + (None,) * len(projections) + tuple(results[n:])


class SwiGLUProjections(LoRAProjections):
    """The same projections of the SwiGLU hidden x = silu(gate) * up [M,K], which the op builds from
    gate and up and rebuilds in the backward instead of keeping it (the FFN's largest activation, kept
    for the expert's dA otherwise). The hidden and the gradients of gate and up are silu_gate's, in its
    own passes. Under the bf16 rule gate and up are kept as bf16 bits (keep_gate_up). Called as
    apply(projections, gate, up, *flat_vars(projections))."""

    def execute(self, projections, gate, up, *tensors):
        return self.forward(keep_gate_up(gate, up, projections[0]), projections, tensors)

    def typed(self, pointers: list) -> list:
        """gate's and up's C++ pointers, as fp32 or bf16 bits."""
        return [f"(const {'uint16_t' if self.saved[0][0].dtype == 'bfloat16' else 'float'} *){p}" for p in pointers]

    def input_code(self, pointers: list, outputs: cpp.CodeOutputs) -> str:
        gate, up = self.typed(pointers)
        hidden = outputs.pointer(self.saved[0][0].shape)  # scratch from Jittor's pool: no fresh pages per call
        return f"swiglu_into({gate}, {up}, M * K, {hidden});\nconst float *x = {hidden};\n"

    def input_grads_code(self, pointers: list, outputs: cpp.CodeOutputs, needs_x: bool, needs_dx: bool) -> tuple:
        # gate and up come from the FFN's projections: their gradients are made whether asked for or not; dhidden
        # accumulates in dgate's memory and the rebuilt hidden lives in dup's until the SwiGLU's backward
        # overwrites both (elementwise: it reads dhidden[i] before writing dgate[i])
        gate, up = self.typed(pointers)
        shape = self.saved[0][0].shape
        dgate, dup = outputs.pointer(shape), outputs.pointer(shape)
        x = f"swiglu_into({gate}, {up}, M * K, {dup});\nconst float *x = {dup};\n" if needs_x else \
            "const float *x = nullptr;\n"
        return x + f"float *dx = {dgate};\n", f"swiglu_grads_into({gate}, {up}, dx, M * K, {dgate}, {dup});\n"


def fused_lora_projections(x: jt.Var, projections: list) -> list:
    rows, K = x.shape[:-1], x.shape[-1]
    # each weighted expert reads its own [M] view of its route weight, so a weight that several
    # projections share (UniPEFT's one LoRA gate) gets its gradients summed through the views: the
    # order of the sums its fp32 gradient has (another order changes its last bits)
    projections = [p if p.expert is None or p.expert.route_weight is None else
                   replace(p, expert=replace(p.expert, route_weight=p.expert.route_weight.float32().reshape(-1)))
                   for p in projections]
    rows_x = x.float32().reshape(-1, K)
    rows_x = rows_x.stop_grad() if x.is_stop_grad() else rows_x  # a reshape does not carry stop-grad: no dx asked
    outputs = LoRAProjections.apply(projections, rows_x, *flat_vars(projections))
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [y.reshape(*rows, y.shape[-1]) for y in outputs]


def plain_lora_projections(x: jt.Var, projections: list) -> list:
    outputs = []
    for p in projections:
        e, base = p.expert, base_linear(x, p.base_weight, p.base_scale)
        if e is None:
            outputs.append(base)
        elif e.route_weight is None:
            outputs.append(base + linear(linear(x, e.A), e.B) * e.scale)
        else:
            outputs.append(add_projected.plain(base, linear(x, e.A), e.B, None, e.route_weight, e.scale))
    return outputs


def gemv_lora_projection(x: jt.Var, p: Projection) -> jt.Var:
    """x [M,K] through one projection with its expert, in GEMV passes (a decode step) -> [M,N]."""
    N, K, e = p.base_weight.shape[0], x.shape[1], p.expert
    inputs = cpp.CodeInputs()
    inputs.add("x", x)
    inputs.code += f"const BaseMatrix W = {matrix_code(inputs, p.base_weight, p.base_scale)};\n"
    for name, var in (("A", e.A), ("B", e.B), ("WEIGHT", e.route_weight)):
        inputs.add(name, var)
    inputs.declare(M=x.shape[0], N=N, K=K, R=e.A.shape[0])
    inputs.declare("float", scale=e.scale)
    return jt.code((x.shape[0], N), "float32", inputs.vars, cpu_header=inputs.header(LORA_PROJECT_HEADER),
                   cpu_src=inputs.code + LORA_PROJECT, data=inputs.numbers.data)


def gemv_lora_projections(x: jt.Var, projections: list) -> list:
    rows, K = x.shape[:-1], x.shape[-1]
    flat = x.float32().reshape(-1, K)
    outputs = [base_linear(flat, p.base_weight, p.base_scale) if p.expert is None else gemv_lora_projection(flat, p)
               for p in projections]
    return [y.reshape(*rows, y.shape[-1]) for y in outputs]


# The projections of one x as one op each way (training, prefill)
projections_op = Kernel(fused_lora_projections, plain_lora_projections)
# x [..., K] through each Projection: base(x) + its expert's term -> [[..., N], ...]; a decode step's
# as GEMV passes, the others as projections_op
lora_projections = Kernel(gemv_lora_projections, projections_op,
                          when=lambda x, projections: decoding(x, projections[0].base_weight))


def keep_gate_up(gate: jt.Var, up: jt.Var, projection: Projection) -> list:
    """What training keeps of the SwiGLU's gate and up [M,F] for the backward (the layer's largest
    activations): under the bf16 rule their bf16 bits, half the bytes, and the hidden is made from those
    (a change within the rounding the down projection gives the hidden anyway); else themselves."""
    return [to_bf16(gate), to_bf16(up)] if bf16_rule(projection.base_weight) else [gate, up]


def fused_swiglu_down(gate: jt.Var, up: jt.Var, projection: Projection) -> jt.Var:
    # the hidden and its low-rank view x A^T in one op that rebuilds the hidden in the backward: the
    # layer's largest activation [B,T,F] is not kept for the expert's gradient
    e = projection.expert
    hidden, low_rank = gated_projection.fused(gate, up, e.A, bf16_rule(projection.base_weight))
    return add_projected.fused(base_linear(hidden, projection.base_weight, projection.base_scale), low_rank, e.B,
                               None, e.route_weight, e.scale)


def swiglu_projection(gate: jt.Var, up: jt.Var, projection: Projection) -> jt.Var:
    rows, F = gate.shape[:-1], gate.shape[-1]
    flat = [t.float32().reshape(-1, F) for t in (gate, up)]
    y = SwiGLUProjections.apply([projection], *flat, *flat_vars([projection]))
    return y.reshape(*rows, y.shape[-1])


def swiglu_then_project(gate: jt.Var, up: jt.Var, projection: Projection) -> jt.Var:
    if training(gate, up, projection) and bf16_rule(projection.base_weight):  # the values training keeps
        gate, up = bf16_values(gate), bf16_values(up)
    return lora_projections(silu_gate(gate, up), [projection])[0]


def weighted_training_term(gate: jt.Var, up: jt.Var, projection: Projection) -> bool:
    """An expert under a type weight, with a gradient or more rows than a decode step."""
    e = projection.expert
    return e is not None and e.route_weight is not None and not decoding(gate, projection.base_weight)


def training(gate: jt.Var, up: jt.Var, projection: Projection) -> bool:
    return not jt.flags.no_grad


# Training's SwiGLU inside the projections' op (the hidden rebuilt in the backward, not kept); else the
# two kernels in turn
swiglu_projection_op = Kernel(swiglu_projection, swiglu_then_project, when=training)
# The FFN's down projection of its SwiGLU hidden: gate, up [..., F] -> base(h) + the expert's term on h
# [..., D], h = silu(gate) * up. A weighted expert's training: the hidden and its low-rank view in one op,
# then the base product and the expert's (fused_swiglu_down); else swiglu_projection_op. Neither fused
# form keeps the hidden.
swiglu_down = Kernel(fused_swiglu_down, swiglu_projection_op, when=weighted_training_term)
