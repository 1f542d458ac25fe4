"""Sparse MoE-LoRA, the paper's sparse homogeneous baselines: per token, a router picks some of E
LoRA experts of one projection. Top-k keeps the k most probable, renormalised; AdaMoLE keeps those
whose probability clears a learned per-token threshold, weighted by the margin. Both add a
load-balancing loss. Names are the authors' (LLaMA3_sparse_moe): `experts.<e>.lora_A/lora_B`,
`router.topkroute_linear` (top-k), `router` and `threshold_fn` (AdaMoLE).

Every expert runs on every token and unselected pairs get weight 0: the same outputs and gradients
as running the selected pairs only (an unselected expert gets a zero gradient). The authors' AdaMoLE
skips an expert no token selected, so its gradient is None and AdamW leaves it alone for that step;
here it gets a zero gradient, and weight decay still applies to it.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .Experts import add_expert, mix_low_rank, zero_linear
from .kernels.decode_layer import LoraExperts
from .kernels.linear import Linear


class LoraExpert(nn.Module):
    """One expert's lora_A and lora_B (B zero at start); the mixture runs all experts at once."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        self.lora_A = Linear(in_features, rank, bias=False)
        self.lora_B = zero_linear(rank, out_features)


class TopkRouter(nn.Module):
    """The authors' NoisyTopkRouter with its noise off (the paper's runs; the noise is refused)."""

    def __init__(self, in_features: int, expert_num: int):
        self.topkroute_linear = Linear(in_features, expert_num, bias=True)

    def execute(self, x: jt.Var) -> jt.Var:
        # x [B,T,in] -> router logits [B,T,E]
        return self.topkroute_linear(x)


def load_balancing(chosen: jt.Var, share: jt.Var) -> jt.Var:
    """E * sum_e f_e * P_e over every position (padding too, as the authors'): f_e = chosen[..., e]
    summed over positions / N (no gradient), P_e = share[..., e] averaged over positions."""
    # chosen, share [B,T,E] -> scalar
    E = share.shape[-1]
    n = share.shape[0] * share.shape[1]
    f = chosen.stop_grad().reshape(n, E).sum(0) / n
    P = share.reshape(n, E).sum(0) / n
    return E * (f * P).sum()


class SparseLoRAMoE(nn.Module):
    """E LoRA experts on one projection, sparsely routed per token (top-k, or AdaMoLE's threshold)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, expert_num: int,
                 method: str, top_k: int):
        self.scaling = alpha / rank
        self.method, self.top_k = method, top_k
        self.experts = nn.ModuleList([LoraExpert(in_features, out_features, rank) for _ in range(expert_num)])
        if method == "topk":
            self.router = TopkRouter(in_features, expert_num)
        else:  # adamole
            self.router = Linear(in_features, expert_num, bias=True)
            self.threshold_fn = Linear(in_features, 1, bias=True)

    def route(self, x: jt.Var, route, family: str) -> jt.Var:
        """Each expert's weight per token [B,T,E] (zero where unselected); reports and adds its loss."""
        logits = self.router(x)  # [B,T,E]
        probs = nn.softmax(logits, dim=-1)
        E = probs.shape[-1]
        if self.method == "topk":
            top, indices = jt.topk(probs, self.top_k, dim=-1)  # [B,T,k], descending
            chosen = (probs >= top[:, :, -1:]).float32().stop_grad()  # [B,T,E]
            kept = probs * chosen
            weights = kept / kept.sum(-1, keepdims=True)
            route.report(family, expert_router_logits=logits, expert_probs=probs, expert_weights=weights,
                         topk_indices=indices)
            route.add_aux(family, load_balancing(chosen, probs))
            return weights
        threshold = jt.sigmoid(self.threshold_fn(x)) / E  # [B,T,1]; the authors' max_threshold is 1/E
        margin = probs - threshold
        chosen = (margin >= 0).float32().stop_grad()
        kept = margin * chosen
        total = kept.sum(-1, keepdims=True)
        weights = kept / jt.where(total == 0, jt.ones_like(total), total)
        route.report(family, expert_router_logits=logits, expert_probs=probs, expert_weights=weights,
                     thresholds=threshold, margin=margin, selected=chosen)
        route.add_aux(family, load_balancing(chosen, margin))
        return weights

    def decode_experts(self) -> LoraExperts:
        """The mixture as the decode layer takes them: route()'s weights, computed in its op."""
        A, B = [e.lora_A.weight for e in self.experts], [e.lora_B.weight for e in self.experts]
        if self.method == "topk":
            linear = self.router.topkroute_linear
            return LoraExperts(A, B, self.scaling, "TOP_K", linear.weight, linear.bias, top_k=self.top_k)
        return LoraExperts(A, B, self.scaling, "THRESHOLD", self.router.weight, self.router.bias,
                           self.threshold_fn.weight, self.threshold_fn.bias)

    def execute(self, base: jt.Var, x: jt.Var, route, family: str) -> jt.Var:
        # base [B,T,out] + the mixture's output on x [B,T,in] -> [B,T,out]
        weights = self.route(x, route, family)
        delta = mix_low_rank(x, weights, [e.lora_A.weight for e in self.experts],
                             [e.lora_B.weight for e in self.experts])
        return add_expert(base, delta, route.weight(family), self.scaling)
