"""The experts: LoRA (MOELoraLayer) and the parallel adapter (PAdapterLayer).

Prompt tuning lives in Block.Attention: it needs the layer's queries and projections.

A single LoRA expert is a term of its projection, `term(route_weight)`: an ExpertTerm that the
projection kernels (Models/kernels/projections.py) add to the base product. Any other expert is
called as expert(base, x, route, family): it adds its output on x, under the weight
route.weight(family) [B,T] (None: unweighted), to the tensor it sits beside (base), in one fused
pass; a single parallel adapter applies the weight to its last projection's narrow input
(kernels/experts.add_projected), so its [B,T,D] output is never kept for the backward. The block
owns the routing between families (Models/Routing.py); a family of several experts mixes them with
its own softmax router and reports it on `route`.
"""
import math

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import init, nn

from .kernels.decode_layer import AdapterExperts, LoraExperts
from .kernels.experts import add_projected, add_weighted
from .kernels.linear import Linear, linear
from .kernels.projections import ExpertTerm


def zero_linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    layer = Linear(in_features, out_features, bias=bias)
    layer.weight = jt.zeros((out_features, in_features), "float32")
    if bias:
        layer.bias = jt.zeros((out_features,), "float32")
    return layer


def xavier_linear(in_features: int, out_features: int, gain: float) -> Linear:
    """Xavier-uniform weight and zero bias: the parallel adapter starts as (almost) nothing."""
    layer = Linear(in_features, out_features, bias=True)
    bound = gain * math.sqrt(6.0 / (in_features + out_features))
    layer.weight = init.uniform((out_features, in_features), "float32", -bound, bound)
    layer.bias = jt.zeros((out_features,), "float32")
    return layer


def add_expert(base: jt.Var, delta: jt.Var, weight, scale: float) -> jt.Var:
    """base + delta * scale, times the family's weight [B,T] when the method routes families."""
    if weight is None:
        return base + delta * scale
    return add_weighted(base, delta, weight, scale)


def mix_experts(gate: jt.Var, outputs: list) -> jt.Var:
    """sum_e gate[..., e] * outputs[e]; gate [B,T,E], outputs E x [B,T,F]."""
    mixed = outputs[0] * gate[:, :, 0:1]
    for e in range(1, len(outputs)):
        mixed = mixed + outputs[e] * gate[:, :, e:e + 1]
    return mixed


def mix_low_rank(x: jt.Var, gate: jt.Var, A_weights: list, B_weights: list) -> jt.Var:
    """sum_e gate[..., e] * (x A_e^T) B_e^T, as one LoRA of rank E*r whose rank blocks are gated:
    two matmuls instead of 2E small ones. A_weights: E matrices [r,in], or one that every B reads
    (HydraLoRA); B_weights: E matrices [out,r]."""
    # x [B,T,in], gate [B,T,E] -> [B,T,out]
    E, r = len(B_weights), B_weights[0].shape[1]
    rows = x.shape[:-1]
    if len(A_weights) == 1:
        low = linear(x, A_weights[0]).unsqueeze(-2)  # [B,T,1,r], shared by every expert
    else:
        low = linear(x, jt.concat(A_weights, dim=0)).reshape(*rows, E, r)  # [B,T,E,r]
    gated = (low * gate.unsqueeze(-1)).reshape(*rows, E * r)
    return linear(gated, jt.concat(B_weights, dim=1))


class MOELoraLayer(nn.Module):
    """LoRA on one projection: (x A^T) B^T * alpha/r.

    expert_num > 1 (MoE-LoRA) mixes `lora_B_l.<e>(lora_A_l.<e>(x))` by a bias-free
    softmax `router`; with hydra (HydraLoRA) one `lora_A` serves every B. Names are
    the authors'. B starts at zero, so the layer adds nothing until trained; the
    router keeps nn.Linear's default uniform(+-1/sqrt(in)) start, which is the
    authors' (PyTorch's default Linear init).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 expert_num: int = 1, hydra: bool = False):
        self.scaling = alpha / rank
        self.expert_num, self.hydra = expert_num, hydra
        if expert_num == 1:
            self.lora_A = Linear(in_features, rank, bias=False)
            self.lora_B = zero_linear(rank, out_features)
            return
        self.router = Linear(in_features, expert_num, bias=False)
        if hydra:
            self.lora_A = Linear(in_features, rank, bias=False)
        else:
            self.lora_A_l = nn.ModuleList([Linear(in_features, rank, bias=False) for _ in range(expert_num)])
        self.lora_B_l = nn.ModuleList([zero_linear(rank, out_features) for _ in range(expert_num)])

    def term(self, route_weight) -> ExpertTerm:
        """The single expert (expert_num 1) as its projection's term: route_weight [B,T] (None: weight 1)
        * scaling * B(A x)."""
        return ExpertTerm(self.lora_A.weight, self.lora_B.weight, route_weight, self.scaling)

    def decode_experts(self) -> LoraExperts:
        """The experts as the decode layer takes them: one, or the softmax mixture (one A with hydra)."""
        if self.expert_num == 1:
            return LoraExperts([self.lora_A.weight], [self.lora_B.weight], self.scaling)
        A = [self.lora_A.weight] if self.hydra else [a.weight for a in self.lora_A_l]
        return LoraExperts(A, [b.weight for b in self.lora_B_l], self.scaling, "SOFTMAX", self.router.weight)

    def execute(self, base: jt.Var, x: jt.Var, route, family: str) -> jt.Var:
        """base + the experts (expert_num > 1) on x mixed by the expert router, times route.weight(family)."""
        # base [B,T,out], x [B,T,in] -> [B,T,out]
        logits = self.router(x)
        gate = nn.softmax(logits, dim=-1)  # [B,T,E]
        route.report(family, expert_router_logits=logits, expert_weights=gate)
        A = [self.lora_A.weight] if self.hydra else [a.weight for a in self.lora_A_l]  # hydra: one A feeds every B
        delta = mix_low_rank(x, gate, A, [b.weight for b in self.lora_B_l])
        return add_expert(base, delta, route.weight(family), self.scaling)


class PAdapterLayer(nn.Module):
    """Parallel adapter beside the FFN: up(silu(down(x))), biases on, near-zero start.

    expert_num > 1 mixes `up_proj_l.<e>` by a softmax `router` (with bias, nn.Linear's
    default start as in the authors' code); with hydra one `down_proj` feeds every
    up projection. Without hydra each expert has its own `down_proj_l.<e>`: the
    authors build these but their forward indexes `down_proj` instead and crashes,
    so that form has no reference; ours runs and keeps their parameter names.
    """

    def __init__(self, dim: int, size: int, expert_num: int = 1, hydra: bool = False):
        self.expert_num, self.hydra = expert_num, hydra
        if expert_num == 1:
            self.down_proj = xavier_linear(dim, size, gain=1e-4)
            self.up_proj = xavier_linear(size, dim, gain=1e-4)
            return
        self.router = Linear(dim, expert_num, bias=True)
        if hydra:
            self.down_proj = xavier_linear(dim, size, gain=1e-4)
        else:
            self.down_proj_l = nn.ModuleList([xavier_linear(dim, size, 1e-4) for _ in range(expert_num)])
        self.up_proj_l = nn.ModuleList([xavier_linear(size, dim, 1e-4) for _ in range(expert_num)])

    def unweighted(self, x: jt.Var, route) -> jt.Var:
        """up(silu(down(x))), mixed by the adapter router when expert_num > 1; before the type weight."""
        # x [B,T,D] -> [B,T,D]
        if self.expert_num == 1:
            return self.up_proj(nn.silu(self.down_proj(x)))
        logits = self.router(x)
        gate = nn.softmax(logits, dim=-1)  # [B,T,E]
        route.report("PADAPTER", expert_router_logits=logits, expert_weights=gate)
        if self.hydra:
            hidden = nn.silu(self.down_proj(x))  # one down projection feeds every up
            outputs = [u(hidden) for u in self.up_proj_l]
        else:
            outputs = [u(nn.silu(d(x))) for d, u in zip(self.down_proj_l, self.up_proj_l)]
        return mix_experts(gate, outputs)

    def decode_experts(self) -> AdapterExperts:
        """The experts as the decode layer takes them: one, or the softmax mixture (one down with hydra)."""
        if self.expert_num == 1:
            return AdapterExperts([self.down_proj.weight], [self.down_proj.bias], [self.up_proj.weight],
                                  [self.up_proj.bias])
        downs = [self.down_proj] if self.hydra else list(self.down_proj_l)
        return AdapterExperts([d.weight for d in downs], [d.bias for d in downs], [u.weight for u in self.up_proj_l],
                              [u.bias for u in self.up_proj_l], self.router.weight, self.router.bias)

    def execute(self, base: jt.Var, x: jt.Var, route) -> jt.Var:
        # base [B,T,D] + the adapter's output on x [B,T,D] (the normalised FFN input), weighted by route [B,T]
        weight = route.weight("PADAPTER")
        if self.expert_num == 1 and weight is not None:  # the weight applied to the up projection's input
            hidden = nn.silu(self.down_proj(x))  # [B,T,size]
            return add_projected(base, hidden, self.up_proj.weight, self.up_proj.bias, weight, 1.0)
        return add_expert(base, self.unweighted(x, route), weight, 1.0)
