"""RMSNorm, Attention and FeedForward, each with its experts built in by construction.

`route` below is the layer's Routing.LayerRoute: the weight [B,T] of each expert family
(Q, K, V, PROMPT, O, FFN_UP, FFN_GATE, FFN_DOWN) from the layer's router, or None.
"""

import math

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .kernels.attention import attention, prompt_attention
from .Experts import MOELoraLayer
from .SparseLoRA import SparseLoRAMoE
from .kernels.elementwise import rms_norm, rms_norm_branches, rope, silu_gate
from .kernels.projections import Projection, lora_projections, swiglu_down
from .ModelArgs import SPARSE_MOE_METHODS, ModelArgs
from .kernels.bf16 import cast_to
from .kernels.precision import BaseLinear, bf16_rule


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = jt.ones((dim,), "float32")

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., D] -> [..., D], statistics in fp32
        return rms_norm(x, self.weight, self.eps)

    def with_branches(self, x: jt.Var, n: int) -> tuple:
        """(the normed x, then x itself n times for its other readers): one backward sums them all."""
        return rms_norm_branches(x, self.weight, self.eps, n)


def lora_for(args: ModelArgs, layer_id: int, target: str, in_features: int, out_features: int):
    """The LoRA expert (or sparse mixture of LoRA experts) on `target` in this layer, or None."""
    if layer_id not in args.lora_layer_set or target not in args.targets:
        return None
    if args.method in SPARSE_MOE_METHODS:
        return SparseLoRAMoE(in_features, out_features, args.lora_rank, args.lora_alpha, args.expert_num,
                             args.method, args.top_k)
    return MOELoraLayer(in_features, out_features, args.lora_rank, args.lora_alpha,
                        args.expert_num, args.hydra_moe)


def single_expert(lora) -> bool:
    """No expert, or one LoRA expert (not a mixture): a term of its projection's kernel."""
    return lora is None or (isinstance(lora, MOELoraLayer) and lora.expert_num == 1)


def projection(base: BaseLinear, lora, route, family: str) -> Projection:
    """base and its single LoRA expert (or none) under the family's route weight, as the kernels take them."""
    return Projection(base.weight, None if lora is None else lora.term(route.weight(family)), base.weight_scale)


def with_loras(x: jt.Var, projections, route) -> list:
    """[base(x) + route.weight(family) * expert(x) for each (base, expert, family) of `projections`]:
    with no expert or a single LoRA each, all of them in one kernel; mixtures add their own output."""
    if all(single_expert(lora) for _, lora, _ in projections):
        return lora_projections(x, [projection(base, lora, route, family) for base, lora, family in projections])
    return [base(x) if lora is None else lora(base(x), x, route, family) for base, lora, family in projections]


def with_lora(base: BaseLinear, lora, x: jt.Var, route, family: str) -> jt.Var:
    return with_loras(x, [(base, lora, family)], route)[0]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        D, H, Hkv, hd = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, hd
        self.n_rep = H // Hkv
        self.max_seq_len = args.max_seq_len
        self.wq = BaseLinear(D, H * hd)
        self.wk = BaseLinear(D, Hkv * hd)
        self.wv = BaseLinear(D, Hkv * hd)
        self.wo = BaseLinear(H * hd, D)
        self.lora_Q = lora_for(args, layer_id, "Q", D, H * hd)
        self.lora_K = lora_for(args, layer_id, "K", D, Hkv * hd)
        self.lora_V = lora_for(args, layer_id, "V", D, Hkv * hd)
        self.lora_O = lora_for(args, layer_id, "O", H * hd, D)
        self.q_norm = self.k_norm = None
        if args.qk_norm:  # Qwen3: an RMSNorm over each query and key head before RoPE
            self.q_norm, self.k_norm = RMSNorm(hd, args.norm_eps), RMSNorm(hd, args.norm_eps)
        self.has_prompt = layer_id in args.prompt_layer_set
        if self.has_prompt:
            self.prompt = nn.Embedding(args.expert_num * args.prompt_len, D)  # expert e: rows e*len..
            self.prompt_gate = jt.zeros((1, H, 1, 1), "float32")  # zero: the prompt starts silent
            if args.expert_num > 1:  # softmax mixer of the experts' outputs; nn.Linear's start is the authors'
                self.prompt_router = nn.Linear(D, args.expert_num, bias=True)
        self.expert_num = args.expert_num
        self.kv_cache = args.kv_cache
        self._cache = None  # the keys and values [2,B,S,Hkv,hd], one tensor: a step writes both in one op
        self._prompt_kv = None  # the prompt's keys and values, fixed while the cache lives

    def reset_cache(self):
        self._cache = self._prompt_kv = None

    def cache_dtype(self) -> str:
        """The KV cache's element type: bf16 with a bf16 or int8 base, fp32 with an fp32 one, or fp32 whatever the
        base (ModelArgs.kv_cache)."""
        return "bfloat16" if self.kv_cache == "base" and bf16_rule(self.wq.weight) else "float32"

    def update_cache(self, xk: jt.Var, xv: jt.Var, start_pos: int):
        """Write this step's keys and values [B,T,Hkv,hd] at positions start_pos.. of the cache; returns the
        cache's keys and values [B,S,Hkv,hd] each."""
        cache = self.write_cache(jt.stack([xk.stop_grad(), xv.stop_grad()]), start_pos)
        return cache[0], cache[1]

    def write_cache(self, kv: jt.Var, start_pos: int) -> jt.Var:
        """Write keys and values kv [2,B,T,Hkv,hd] at positions start_pos.. of the cache (rounded to bf16 in a
        bf16 cache) and return it, [2,B,S,Hkv,hd].

        Jittor's setitem writes in place and takes the position as data, so every
        decode step runs the same compiled ops."""
        B, T = kv.shape[1:3]
        dtype = self.cache_dtype()
        if self._cache is None or self._cache.shape[1] != B or self._cache.dtype != dtype:
            self._cache = jt.zeros((2, B, self.max_seq_len, self.n_kv_heads, self.head_dim), dtype)
        self._cache[:, :, start_pos:start_pos + T] = cast_to(kv, dtype)
        return self._cache

    def execute(self, x, cos, sin, mask, route, start_pos=None):
        # x [B,T,D]; cos/sin [T,hd/2]; mask [T,S] additive; start_pos None (no cache) or int
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        xq, xk, xv = with_loras(x, [(self.wq, self.lora_Q, "Q"), (self.wk, self.lora_K, "K"),
                                    (self.wv, self.lora_V, "V")], route)
        xq, xk, xv = xq.reshape(B, T, H, hd), xk.reshape(B, T, Hkv, hd), xv.reshape(B, T, Hkv, hd)
        if self.q_norm is not None:  # the Q and K experts' outputs are normed too, as in the authors' Qwen3 MoA
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = rope(xq, cos, sin), rope(xk, cos, sin)
        keys, values = (xk, xv) if start_pos is None else self.update_cache(xk, xv, start_pos)
        out = attention(xq, keys, values, mask, bf16_rule(self.wq.weight))  # [B,T,H,hd]
        if self.has_prompt:
            out = self.add_prompt_output(out, x, xq, route, start_pos)
        out = out.reshape(B, T, H * hd)  # [B,T,D]
        return with_lora(self.wo, self.lora_O, out, route, "O")

    def prompt_keys_values(self, start_pos):
        """The learned prompt through the base projections (and k_norm), no RoPE: [L, Hkv*hd] each. With
        the KV cache (generation) they are computed once per prefill: the prompt does not change meanwhile."""
        if start_pos is not None and self._prompt_kv is not None:
            return self._prompt_kv
        keys = self.wk(self.prompt.weight)  # [L, Hkv*hd]
        if self.k_norm is not None:  # normed as every key is (the authors' Qwen3 code norms its prompt keys too)
            keys = self.k_norm(keys.reshape(-1, self.n_kv_heads, self.head_dim)).reshape(keys.shape)
        kv = keys, self.wv(self.prompt.weight)
        if start_pos is not None:
            self._prompt_kv = kv
        return kv

    def add_prompt_output(self, out: jt.Var, x: jt.Var, xq: jt.Var, route, start_pos=None) -> jt.Var:
        """out plus the prompt expert's output, times its per-head gate and its type weight."""
        # out [B,T,H,hd] (attention), x [B,T,D] (the layer's normalised input), xq [B,T,H,hd] (rotated queries)
        B, T, H, hd = xq.shape
        prompt_k, prompt_v = self.prompt_keys_values(start_pos)  # [L, Hkv*hd]
        type_weight = route.weight("PROMPT")
        if self.expert_num == 1:
            return prompt_attention(xq, prompt_k, prompt_v, self.prompt_gate.reshape(H), type_weight, out)
        mixed = self.mixed_prompt_output(x, xq, prompt_k, prompt_v, route) * self.prompt_gate.reshape(1, 1, H, 1)
        return out + (mixed if type_weight is None else mixed * type_weight.reshape(B, T, 1, 1))

    def mixed_prompt_output(self, x, xq, prompt_k, prompt_v, route) -> jt.Var:
        """Several prompt experts, as the authors mix them: ONE softmax over all experts'
        rows, then each expert's share of it is weighted by softmax(prompt_router(x))."""
        # x [B,T,D], xq [B,T,H,hd], prompt_k/v [E*P, Hkv*hd] -> [B,T,H,hd] (before gate and type weight)
        B, T, H, hd = xq.shape
        L, E = self.prompt.weight.shape[0], self.expert_num

        def per_head(t):  # [L, Hkv*hd] -> [B,H,L,hd]; kv head h // n_rep serves query head h
            t = t.reshape(L, self.n_kv_heads, 1, hd).broadcast((L, self.n_kv_heads, self.n_rep, hd))
            # B written out: on a GPU jt.matmul runs cublas_batched_matmul, which needs equal batch dims
            return t.reshape(L, H, hd).transpose(1, 0, 2).unsqueeze(0).broadcast((B, H, L, hd))
        keys, values = per_head(prompt_k), per_head(prompt_v)
        q = xq.transpose(0, 2, 1, 3)  # [B,H,T,hd]
        probs = nn.softmax(jt.matmul(q, keys.transpose(0, 1, 3, 2)) / math.sqrt(hd), dim=-1)  # [B,H,T,L]
        logits = self.prompt_router(x)
        gate = nn.softmax(logits, dim=-1)  # [B,T,E]
        route.report("PROMPT", expert_router_logits=logits, expert_weights=gate)
        row_gate = gate.reshape(B, 1, T, E, 1).broadcast((B, 1, T, E, L // E)).reshape(B, 1, T, L)
        out = jt.matmul(probs * row_gate, values)  # [B,H,T,hd]
        return out.transpose(0, 2, 1, 3)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate branch, w3 the up branch (Meta's names)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        D, F = args.dim, args.ffn_hidden_dim
        self.w1 = BaseLinear(D, F)
        self.w2 = BaseLinear(F, D)
        self.w3 = BaseLinear(D, F)
        self.lora_UP = lora_for(args, layer_id, "FFN_UP", D, F)
        self.lora_GATE = lora_for(args, layer_id, "FFN_GATE", D, F)
        self.lora_DOWN = lora_for(args, layer_id, "FFN_DOWN", F, D)

    def execute(self, x: jt.Var, route) -> jt.Var:
        # x [B,T,D] -> [B,T,D]; hidden [B,T,F]
        gate, up = with_loras(x, [(self.w1, self.lora_GATE, "FFN_GATE"), (self.w3, self.lora_UP, "FFN_UP")], route)
        if single_expert(self.lora_DOWN):  # the SwiGLU and the down projection with its expert, one kernel
            return swiglu_down(gate, up, projection(self.w2, self.lora_DOWN, route, "FFN_DOWN"))
        hidden = silu_gate(gate, up)
        return self.lora_DOWN(self.w2(hidden), hidden, route, "FFN_DOWN")


def attention_mask(T: int, S: int, start_pos: int) -> np.ndarray:
    """Additive causal mask [T,S]: query t (at position start_pos+t) sees keys 0..start_pos+t."""
    key_pos = np.arange(S)[None, :]
    query_pos = start_pos + np.arange(T)[:, None]
    return np.where(key_pos <= query_pos, 0.0, -np.inf).astype(np.float32)
