"""The experts: LoRA (MOELoraLayer) and the parallel adapter (PAdapterLayer).

Prompt tuning lives in Block.Attention: it needs the layer's queries and projections.

Every expert is called as expert(base, x, type_weight): it adds its output on x,
under its per-token type weight [B,T], to the tensor it sits beside (base), in one
fused pass; the block owns the routing.
"""
import math

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import init, nn

from .fused import add_weighted
from .kernels import Linear


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


def mix_experts(gate: jt.Var, outputs: list) -> jt.Var:
    """sum_e gate[..., e] * outputs[e]; gate [B,T,E], outputs E x [B,T,F]."""
    mixed = outputs[0] * gate[:, :, 0:1]
    for e in range(1, len(outputs)):
        mixed = mixed + outputs[e] * gate[:, :, e:e + 1]
    return mixed


class MOELoraLayer(nn.Module):
    """LoRA on one projection: (x A^T) B^T * alpha/r.

    expert_num > 1 mixes several LoRAs with a bias-free softmax router (MoE-LoRA);
    hydra shares one A across the experts (HydraLoRA). B starts at zero, so the
    layer adds nothing until trained.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 expert_num: int = 1, hydra: bool = False):
        self.scaling = alpha / rank
        self.expert_num = expert_num
        if expert_num == 1:
            self.lora_A = Linear(in_features, rank, bias=False)
            self.lora_B = zero_linear(rank, out_features)
        else:
            self.lora_router = Linear(in_features, expert_num, bias=False)
            n_a = 1 if hydra else expert_num
            self.lora_A = nn.ModuleList([Linear(in_features, rank, bias=False) for _ in range(n_a)])
            self.lora_B = nn.ModuleList([zero_linear(rank, out_features) for _ in range(expert_num)])

    def unweighted(self, x: jt.Var) -> jt.Var:
        """B(A x), mixed by the expert router when expert_num > 1; before scaling and type weight."""
        if self.expert_num == 1:
            return self.lora_B(self.lora_A(x))
        gate = nn.softmax(self.lora_router(x), dim=-1)  # [B,T,E]
        shared = [a(x) for a in self.lora_A]  # hydra: one A serves every B
        return mix_experts(gate, [b(shared[e % len(shared)]) for e, b in enumerate(self.lora_B)])

    def execute(self, base: jt.Var, x: jt.Var, type_weight: jt.Var) -> jt.Var:
        # base [B,T,out] + the expert's output on x [B,T,in], weighted by type_weight [B,T] -> [B,T,out]
        return add_weighted(base, self.unweighted(x), type_weight, self.scaling)


class PAdapterLayer(nn.Module):
    """Parallel adapter beside the FFN: up(silu(down(x))), biases on, near-zero start."""

    def __init__(self, dim: int, size: int, expert_num: int = 1, hydra: bool = False):
        self.expert_num = expert_num
        if expert_num == 1:
            self.down_proj = xavier_linear(dim, size, gain=1e-4)
            self.up_proj = xavier_linear(size, dim, gain=1e-4)
        else:
            self.adapter_router = Linear(dim, expert_num, bias=True)
            self.adapter_router.bias = jt.zeros((expert_num,), "float32")
            n_down = 1 if hydra else expert_num
            self.down_proj = nn.ModuleList([xavier_linear(dim, size, 1e-4) for _ in range(n_down)])
            self.up_proj = nn.ModuleList([xavier_linear(size, dim, 1e-4) for _ in range(expert_num)])

    def unweighted(self, x: jt.Var) -> jt.Var:
        """up(silu(down(x))), mixed by the adapter router when expert_num > 1; before the type weight."""
        if self.expert_num == 1:
            return self.up_proj(nn.silu(self.down_proj(x)))
        gate = nn.softmax(self.adapter_router(x), dim=-1)  # [B,T,E]
        hidden = [nn.silu(d(x)) for d in self.down_proj]
        return mix_experts(gate, [u(hidden[e % len(hidden)]) for e, u in enumerate(self.up_proj)])

    def execute(self, base: jt.Var, x: jt.Var, type_weight: jt.Var) -> jt.Var:
        # base [B,T,D] + the adapter's output on x [B,T,D] (the normalised FFN input), weighted by type_weight [B,T]
        return add_weighted(base, self.unweighted(x), type_weight, 1.0)
