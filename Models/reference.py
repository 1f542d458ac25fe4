"""One MoA layer's forward in plain Jittor ops, top to bottom, for reading.

The equation of LLM.TransformerBlock without kernels, fusions or the KV cache, for a MoA layer
(Soft or Sparse) with one expert per family and an fp32 base, on a TransformerBlock's own
parameters. The model never calls it; tests/test_reference.py checks that it equals the layer.
"""
import math

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn


def dense(x: jt.Var, weight: jt.Var, bias=None) -> jt.Var:
    # x [..., in] @ weight [out,in]^T (+ bias [out]) -> [..., out]
    out = jt.matmul(x, weight.transpose())
    return out if bias is None else out + bias


def rms_norm(x: jt.Var, weight: jt.Var, eps: float) -> jt.Var:
    # x [..., D] -> [..., D]
    return x * jt.rsqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x: jt.Var, cos: jt.Var, sin: jt.Var) -> jt.Var:
    """Each (even, odd) pair of x [B,T,H,hd] rotated by its position's angle; cos/sin [T,hd/2]."""
    B, T, H, hd = x.shape
    even, odd = x[..., 0::2], x[..., 1::2]  # [B,T,H,hd/2]
    cos, sin = cos.reshape(1, T, 1, hd // 2), sin.reshape(1, T, 1, hd // 2)
    return jt.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).reshape(B, T, H, hd)


def attend(q: jt.Var, k: jt.Var, v: jt.Var, mask) -> jt.Var:
    """softmax(q k^T / sqrt(hd) + mask) v per head: q [B,T,H,hd], k/v [B,S,H,hd] -> [B,T,H,hd]."""
    scores = jt.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)) / math.sqrt(q.shape[-1])  # [B,H,T,S]
    if mask is not None:
        scores = scores + mask
    return jt.matmul(nn.softmax(scores, dim=-1), v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def type_weights(block, x: jt.Var) -> dict:
    """Each routed family's weight [B,T,1] from the raw residual stream x [B,T,D]."""
    r = block.adapter_type_router
    if hasattr(r, "w1"):  # SwiGLU: w2(silu(w1 x + b1) * (w3 x + b3)) + b2
        logits = dense(nn.silu(dense(x, r.w1.weight, r.w1.bias)) * dense(x, r.w3.weight, r.w3.bias), r.w2.weight, r.w2.bias)
    else:
        logits = dense(x, r.weight, r.bias)
    w = jt.sigmoid(logits)  # [B,T,n_types], Soft MoA's weights
    g = block.adapter_threshold_fn
    if g is not None:  # Sparse MoA: a family whose weight is below Gamma(x) [B,T,1] is off
        gamma = g.max_threshold * (1.0 if g.const else jt.sigmoid(dense(x, g.weight, g.bias)))
        w = w * (w >= gamma).float32()
    return {family: w[:, :, i:i + 1] for i, family in enumerate(block.type_names)}


def moa_layer(block, x: jt.Var, cos: jt.Var, sin: jt.Var, mask) -> jt.Var:
    """block(x) for a whole sequence: x [B,T,D], cos/sin [T,hd/2], mask [T,T] additive -> [B,T,D]."""
    B, T, D = x.shape
    attn, ffn = block.attention, block.feed_forward
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w = type_weights(block, x)

    def project(inputs, base, lora, family):
        """base(x) + w_family(x) * s (x A^T) B^T: the frozen projection and its LoRA expert."""
        out = dense(inputs, base.weight)
        if lora is None:
            return out
        return out + w.get(family, 1.0) * lora.scaling * dense(dense(inputs, lora.lora_A.weight), lora.lora_B.weight)

    # attention, with the prompt expert beside it
    def head_norm(t, norm):
        """Qwen3's RMSNorm over each query or key head [..., hd], after the experts; LLaMA has none."""
        return t if norm is None else rms_norm(t, norm.weight, norm.eps)

    n = rms_norm(x, block.attention_norm.weight, block.attention_norm.eps)
    q = rope(head_norm(project(n, attn.wq, attn.lora_Q, "Q").reshape(B, T, H, hd), attn.q_norm), cos, sin)
    k = rope(head_norm(project(n, attn.wk, attn.lora_K, "K").reshape(B, T, Hkv, hd), attn.k_norm), cos, sin)
    v = project(n, attn.wv, attn.lora_V, "V").reshape(B, T, Hkv, hd)
    repeat = H // Hkv  # grouped kv heads: kv head h // repeat serves query head h
    k, v = (t.reshape(B, T, Hkv, 1, hd).broadcast((B, T, Hkv, repeat, hd)).reshape(B, T, H, hd) for t in (k, v))
    out = attend(q, k, v, mask)  # [B,T,H,hd]
    if attn.has_prompt:  # keys and values of the learned prompt rows [L,D], no RoPE, no mask
        L = attn.prompt.weight.shape[0]
        keys = head_norm(dense(attn.prompt.weight, attn.wk.weight).reshape(L, Hkv, hd), attn.k_norm)
        values = dense(attn.prompt.weight, attn.wv.weight).reshape(L, Hkv, hd)
        prompt_k, prompt_v = (t.reshape(1, L, Hkv, 1, hd).broadcast((B, L, Hkv, repeat, hd)).reshape(B, L, H, hd)
                              for t in (keys, values))
        gate = attn.prompt_gate.reshape(1, 1, H, 1)
        out = out + w.get("PROMPT", 1.0).unsqueeze(-1) * gate * attend(q, prompt_k, prompt_v, None)
    h = x + project(out.reshape(B, T, H * hd), attn.wo, attn.lora_O, "O")

    # SwiGLU feed-forward, with the parallel adapter beside it
    n = rms_norm(h, block.ffn_norm.weight, block.ffn_norm.eps)
    hidden = nn.silu(project(n, ffn.w1, ffn.lora_GATE, "FFN_GATE")) * project(n, ffn.w3, ffn.lora_UP, "FFN_UP")
    out = h + project(hidden, ffn.w2, ffn.lora_DOWN, "FFN_DOWN")
    a = block.p_adapter
    if a is not None:
        down = nn.silu(dense(n, a.down_proj.weight, a.down_proj.bias))
        out = out + w.get("PADAPTER", 1.0) * dense(down, a.up_proj.weight, a.up_proj.bias)
    if block.clamp is not None:  # the authors' fp16 guard
        out = jt.clamp(out, -block.clamp, block.clamp)
    return out
