"""The experts of a MoA adapter exported by MoA-Jittor, as torch modules under MoA-Jittor's names: LoRA, its
mixtures (moe: softmax; topk and adamole: sparse), the type router, Sparse MoA's threshold Gamma, the parallel
adapter, and the prompt expert's output. Copied into the exported folder beside modeling_moa.py, which adds
them to transformers' model (its docstring has the equations); run by transformers, never by MoA-Jittor.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def low_rank(x, gate, As, Bs):
    """sum_e gate[..., e] * (x A_e^T) B_e^T; one A may serve every B (HydraLoRA)."""
    out = 0
    for e, B in enumerate(Bs):
        out = out + gate[..., e:e + 1] * F.linear(F.linear(x, As[e if len(As) > 1 else 0]), B)
    return out


class LoRA(nn.Module):
    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.lora_A = nn.Linear(d_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        return self.lora_B(self.lora_A(x))


class MixedLoRA(nn.Module):
    """E LoRA experts mixed by softmax(router(z)) (moe; hydra: one A)."""

    def __init__(self, d_in, d_out, rank, experts, hydra):
        super().__init__()
        self.router = nn.Linear(d_in, experts, bias=False)
        if hydra:
            self.lora_A = nn.Linear(d_in, rank, bias=False)
        else:
            self.lora_A_l = nn.ModuleList(nn.Linear(d_in, rank, bias=False) for _ in range(experts))
        self.lora_B_l = nn.ModuleList(nn.Linear(rank, d_out, bias=False) for _ in range(experts))

    def forward(self, x):
        As = [self.lora_A.weight] if hasattr(self, "lora_A") else [a.weight for a in self.lora_A_l]
        return low_rank(x, torch.softmax(self.router(x), -1), As, [b.weight for b in self.lora_B_l])


class TopkRouter(nn.Module):
    def __init__(self, d_in, experts):
        super().__init__()
        self.topkroute_linear = nn.Linear(d_in, experts)

    def forward(self, x):
        return self.topkroute_linear(x)


class SparseLoRA(nn.Module):
    """E LoRA experts, some per token: topk (the k most probable, renormalised) or adamole (those whose
    probability clears sigmoid(threshold_fn(z)) / E, weighted by the margin)."""

    def __init__(self, d_in, d_out, rank, experts, method, top_k):
        super().__init__()
        self.method, self.top_k = method, top_k
        self.experts = nn.ModuleList(LoRA(d_in, d_out, rank) for _ in range(experts))
        if method == "topk":
            self.router = TopkRouter(d_in, experts)
        else:
            self.router = nn.Linear(d_in, experts)
            self.threshold_fn = nn.Linear(d_in, 1)

    def forward(self, x):
        probs = torch.softmax(self.router(x), -1)
        if self.method == "topk":
            kept = probs * (probs >= torch.topk(probs, self.top_k, -1).values[..., -1:])
            weights = kept / kept.sum(-1, keepdim=True)
        else:
            margin = probs - torch.sigmoid(self.threshold_fn(x)) / probs.shape[-1]
            kept = margin * (margin >= 0)
            total = kept.sum(-1, keepdim=True)
            weights = kept / torch.where(total == 0, torch.ones_like(total), total)
        return low_rank(x, weights, [e.lora_A.weight for e in self.experts], [e.lora_B.weight for e in self.experts])


class SwiGLURouter(nn.Module):
    def __init__(self, dim, n_types, swi_x):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, n_types * swi_x), nn.Linear(dim, n_types * swi_x)
        self.w2 = nn.Linear(n_types * swi_x, n_types)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gamma(nn.Module):
    """Sparse MoA's per-token threshold: max_threshold * sigmoid(x W_g^T + b_g), or max_threshold itself."""

    def __init__(self, dim, max_threshold, const):
        super().__init__()
        self.max_threshold, self.const = max_threshold, const
        if not const:
            self.weight = nn.Parameter(torch.zeros(1, dim))
            self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        if self.const:
            return torch.full_like(x[..., :1], self.max_threshold)
        return self.max_threshold * torch.sigmoid(F.linear(x, self.weight, self.bias))


class PAdapter(nn.Module):
    """up(silu(down(z))) beside the MLP; E experts mixed by softmax(router(z)) (hydra: one down)."""

    def __init__(self, dim, size, experts, hydra):
        super().__init__()
        if experts == 1:
            self.down_proj, self.up_proj = nn.Linear(dim, size), nn.Linear(size, dim)
            return
        self.router = nn.Linear(dim, experts)
        if hydra:
            self.down_proj = nn.Linear(dim, size)
        else:
            self.down_proj_l = nn.ModuleList(nn.Linear(dim, size) for _ in range(experts))
        self.up_proj_l = nn.ModuleList(nn.Linear(size, dim) for _ in range(experts))

    def forward(self, z):
        if hasattr(self, "up_proj"):
            return self.up_proj(F.silu(self.down_proj(z)))
        gate = torch.softmax(self.router(z), -1)
        downs = [self.down_proj] * len(self.up_proj_l) if hasattr(self, "down_proj") else list(self.down_proj_l)
        return sum(gate[..., e:e + 1] * up(F.silu(down(z))) for e, (down, up) in enumerate(zip(downs, self.up_proj_l)))


def rotate(q, cos, sin):
    """HF's rotary embedding on q [B,T,H,hd]: the halves of each head rotated (cos, sin [B,T,hd])."""
    half = q.shape[-1] // 2
    turned = torch.cat((-q[..., half:], q[..., :half]), -1)
    return q * cos.unsqueeze(2) + turned * sin.unsqueeze(2)


def prompt_output(attn, z, q, weight):
    """w_PROMPT * g[h] * softmax(q (P W_k^T)^T / sqrt(hd)) (P W_v^T) of the attention `attn`, its input z
    [B,T,D], rotated queries q [B,T,H,hd]; several prompt experts share one softmax over all their rows, each
    row then weighted by its expert's softmax(prompt_router(z))."""
    B, T, H, hd = q.shape
    P = attn.prompt.weight  # [E*L, D]
    keys = F.linear(P, attn.k_proj.weight.float()).view(P.shape[0], -1, hd)  # [E*L, Hkv, hd]
    if getattr(attn, "k_norm", None) is not None:  # Qwen3 norms every key head
        keys = attn.k_norm(keys.to(attn.k_norm.weight.dtype)).float()
    values = F.linear(P, attn.v_proj.weight.float()).view(P.shape[0], -1, hd)
    rep = H // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)  # [E*L, H, hd]
    probs = torch.softmax(torch.einsum("bthd,lhd->bthl", q, keys) / math.sqrt(hd), -1)
    if hasattr(attn, "prompt_router"):
        gate = torch.softmax(attn.prompt_router(z), -1)  # [B,T,E]
        probs = probs * gate.repeat_interleave(P.shape[0] // gate.shape[-1], -1).unsqueeze(2)
    out = torch.einsum("bthl,lhd->bthd", probs, values) * attn.prompt_gate.view(1, 1, H, 1)
    return out if weight is None else out * weight.unsqueeze(-1)
