"""A decode step's MoA layer in two ops: the layer's input side (routing, Q/K/V, RoPE) and its
output side (attention over the cache and the prompt, O, the FFN, the parallel adapter).

A decode step has at most GEMV_ROWS rows, so a layer's cost is its ops, not their arithmetic:
built op by op it is about 25 ops, each a few microseconds of Python and of Jittor's executor.
Here it is four: these two, and the two cache writes between them. Each projection is
projections.lora_project (a GEMV pass over the base's weights and its LoRA expert under its type
weight), so the numbers are those of the op-by-op path, which stays the plain reference
(TransformerBlock.execute) and serves everything else: training, scoring, a GPU, mixtures of
several experts per family and the baselines.
"""
import math

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .elementwise import RMS_HEADER, ROTATE_HEADER
from .linear import CodeInputs
from .projections import LORA_PROJECT_HEADER
from .routing import ROUTE_ROW, TYPE_WEIGHTS_HEADER, router_declarations
from .switch import decoding

LAYER_HEADER = (LORA_PROJECT_HEADER + RMS_HEADER + ROTATE_HEADER + TYPE_WEIGHTS_HEADER + """
#include <algorithm>
// out [hd] += gain * softmax_s(q . k_s * scale) v_s over the n keys/values k_s, v_s (row stride ld)
static void attend(const float *q, const float *k, const float *v, int64_t n, int64_t ld, int64_t hd,
                   float scale, float gain, float *out, float *scores) {
    float top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < n; s++) { scores[s] = dot(q, k + s * ld, hd) * scale; top = std::max(top, scores[s]); }
    for (int64_t s = 0; s < n; s++) { scores[s] = std::exp(scores[s] - top); total += scores[s]; }
    for (int64_t s = 0; s < n; s++) {
        const float p = gain * scores[s] / total;
        for (int64_t i = 0; i < hd; i++) out[i] += p * v[s * ld + i];
    }
}
static inline float column(const float *probs, int64_t NT, int64_t m, int64_t col) { return col < 0 ? 1.f : probs[m * NT + col]; }
""")

# x [M,D] -> q [M,H*hd], k, v [M,Hkv*hd] (rotated q, k), type weights [M,NT], Gamma [M,1] (Sparse)
LAYER_INPUT = """
std::vector<float> xn(M * D);
for (int64_t m = 0; m < M; m++) {
    const float inv = rms_inverse(x + m * D, D, eps);
    for (int64_t i = 0; i < D; i++) xn[m * D + i] = x[m * D + i] * inv * ATTENTION_NORM[i];
}
for (int64_t m = 0; m < M; m++) {
    const float *xm = x + m * D;
    float *probs_row = PROBS + m * NT, gamma = 0.f;
""" + ROUTE_ROW + """
    if (SPARSE) GAMMAS[m] = gamma;
}
lora_project<M>(H * hd, D, R, xn.data(), WQ, BASE_BF16, A_Q, B_Q, COL_Q < 0 ? nullptr : PROBS + COL_Q, NT, scale, out0_p);
lora_project<M>(Hkv * hd, D, R, xn.data(), WK, BASE_BF16, A_K, B_K, COL_K < 0 ? nullptr : PROBS + COL_K, NT, scale, out1_p);
lora_project<M>(Hkv * hd, D, R, xn.data(), WV, BASE_BF16, A_V, B_V, COL_V < 0 ? nullptr : PROBS + COL_V, NT, scale, out2_p);
for (int64_t m = 0; m < M; m++) {
    const float *c = COS + (m % T) * (hd / 2), *s = SIN + (m % T) * (hd / 2);
    for (int64_t h = 0; h < H; h++) rotate_pairs_row(out0_p + (m * H + h) * hd, out0_p + (m * H + h) * hd, c, s, hd / 2, 1.f);
    for (int64_t h = 0; h < Hkv; h++) rotate_pairs_row(out1_p + (m * Hkv + h) * hd, out1_p + (m * Hkv + h) * hd, c, s, hd / 2, 1.f);
}
"""

# x [M,D] (the layer's input), q [M,H*hd], the cache [B,S,Hkv,hd] (this step written) -> [M,D]
LAYER_OUTPUT = """
std::vector<int64_t> span(T, 0);
for (int64_t t = 0; t < T; t++) for (int64_t s = 0; s < S; s++) if (mask[t * S + s] > -1e30f) span[t] = s + 1;
std::vector<float> att(M * H * hd, 0.f), h(M * D), hn(M * D), gate(M * F), up(M * F);
#pragma omp parallel for collapse(2)
for (int64_t m = 0; m < M; m++)
for (int64_t head = 0; head < H; head++) {
    std::vector<float> scores(std::max(S, L));
    const int64_t b = m / T, g = head / n_rep;
    float *out = att.data() + (m * H + head) * hd;
    const float *qh = q + (m * H + head) * hd;
    attend(qh, cache_k + b * S * Hkv * hd + g * hd, cache_v + b * S * Hkv * hd + g * hd, span[m % T], Hkv * hd, hd,
           scale, 1.f, out, scores.data());
    if (L > 0) attend(qh, PROMPT_K + g * hd, PROMPT_V + g * hd, L, Hkv * hd, hd, scale,
                      PROMPT_GATE[head] * column(probs, NT, m, COL_PROMPT), out, scores.data());
}
lora_project<M>(D, H * hd, R, att.data(), WO, BASE_BF16, A_O, B_O, COL_O < 0 ? nullptr : probs + COL_O, NT, lora_scale, h.data());
for (int64_t m = 0; m < M; m++) {
    for (int64_t i = 0; i < D; i++) h[m * D + i] += x[m * D + i];
    const float inv = rms_inverse(h.data() + m * D, D, eps);
    for (int64_t i = 0; i < D; i++) hn[m * D + i] = h[m * D + i] * inv * FFN_NORM[i];
}
lora_project<M>(F, D, R, hn.data(), W1, BASE_BF16, A_GATE, B_GATE, COL_GATE < 0 ? nullptr : probs + COL_GATE, NT, lora_scale, gate.data());
lora_project<M>(F, D, R, hn.data(), W3, BASE_BF16, A_UP, B_UP, COL_UP < 0 ? nullptr : probs + COL_UP, NT, lora_scale, up.data());
for (int64_t i = 0; i < M * F; i++) gate[i] = swiglu(gate[i], up[i]);
float *y = out0_p;
lora_project<M>(D, F, R, gate.data(), W2, BASE_BF16, A_DOWN, B_DOWN, COL_DOWN < 0 ? nullptr : probs + COL_DOWN, NT, lora_scale, y);
for (int64_t i = 0; i < M * D; i++) y[i] += h[i];
if (P > 0) {  // the parallel adapter on the FFN's input: up(silu(down(hn) + b) + b), weighted
    std::vector<float> a(M * P), z(M * D);
    gemv<M>(P, D, hn.data(), PA_DOWN_W, a.data());
    for (int64_t m = 0; m < M; m++) for (int64_t j = 0; j < P; j++) {
        const float v = a[m * P + j] + PA_DOWN_B[j];
        a[m * P + j] = v * sigmoid(v);
    }
    gemv<M>(D, P, a.data(), PA_UP_W, z.data());
    for (int64_t m = 0; m < M; m++) {
        const float w = column(probs, NT, m, COL_PADAPTER);
        for (int64_t i = 0; i < D; i++) y[m * D + i] += w * (z[m * D + i] + PA_UP_B[i]);
    }
}
if (CLAMP) for (int64_t i = 0; i < M * D; i++) y[i] = std::min(std::max(y[i], -CLAMP_LIMIT), CLAMP_LIMIT);
"""


def columns(block, families: dict) -> str:
    """COL_<name> = the type router's column of each family (-1: not routed, weight 1)."""
    return "".join(f"const int64_t COL_{name} = {block.type_names.index(f) if f in block.type_names else -1};\n"
                   for name, f in families.items())


def lora_scaling_rank(block) -> tuple:
    """The layer's LoRA scaling alpha/r and rank r (the same for every target); (1, 1) without LoRA."""
    loras = [lora for lora in (block.attention.lora_Q, block.attention.lora_K, block.attention.lora_V,
                               block.attention.lora_O, block.feed_forward.lora_UP, block.feed_forward.lora_GATE,
                               block.feed_forward.lora_DOWN) if lora is not None]
    return (loras[0].scaling, loras[0].lora_A.weight.shape[0]) if loras else (1.0, 1)


def fuses_decode_step(block, x: jt.Var, start_pos) -> bool:
    """A decode step (KV cache, no gradient, few rows) of a MoA layer with one expert per family and
    no per-head query/key norm (a Qwen3 layer's decode step runs op by op)."""
    return (start_pos is not None and block.method == "moa" and block.attention.expert_num == 1
            and block.attention.q_norm is None and decoding(x))


def layer_input(block, x, cos, sin):
    # x [B,T,D] -> q [M,H*hd], k, v [M,Hkv*hd], probs [M,NT], gamma [M,1] or None; M = B*T
    B, T, D = x.shape
    M, attn = B * T, block.attention
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    inputs = CodeInputs()
    inputs.add("x", x.float32().reshape(M, D))
    inputs.add("ATTENTION_NORM", block.attention_norm.weight)
    weights, declarations, n_types = router_declarations(block.adapter_type_router, block.adapter_threshold_fn,
                                                         len(inputs.vars), D)
    inputs.vars += weights
    inputs.code += declarations
    for name, base in (("WQ", attn.wq), ("WK", attn.wk), ("WV", attn.wv)):
        inputs.add(name, base.weight, "const void *")
    for target, lora in (("Q", attn.lora_Q), ("K", attn.lora_K), ("V", attn.lora_V)):
        inputs.lora_expert(target, lora)
    inputs.add("COS", cos)
    inputs.add("SIN", sin)
    sparse = block.adapter_threshold_fn is not None
    scale, R = lora_scaling_rank(block)
    sizes = (f"const int64_t M = {M}, T = {T}, H = {H}, Hkv = {Hkv}, hd = {hd}, R = {R};\n"
             f"const float eps = {block.attention_norm.eps!r}f, scale = {float(scale)!r}f;\n"
             f"const bool BASE_BF16 = {str(attn.wq.weight.dtype == 'bfloat16').lower()};\n"
             + columns(block, dict(Q="Q", K="K", V="V"))
             + f"float *PROBS = out3_p, *GAMMAS = {'out4_p' if sparse else 'nullptr'};\n")
    shapes = [(M, H * hd), (M, Hkv * hd), (M, Hkv * hd), (M, max(n_types, 1))] + ([(M, 1)] if sparse else [])
    outputs = jt.code(shapes, ["float32"] * len(shapes), inputs.vars, cpu_header=LAYER_HEADER,
                      cpu_src=inputs.code + sizes + LAYER_INPUT)
    return outputs[0], outputs[1], outputs[2], outputs[3], (outputs[4] if sparse else None)


def layer_output(block, x, q, cache_k, cache_v, mask, probs, start_pos):
    # x [B,T,D], q [M,H*hd], cache [B,S,Hkv,hd], mask [T,S], probs [M,NT] -> [B,T,D]
    B, T, D = x.shape
    M, attn, ffn = B * T, block.attention, block.feed_forward
    H, Hkv, hd, S = attn.n_heads, attn.n_kv_heads, attn.head_dim, cache_k.shape[1]
    inputs = CodeInputs()
    for name, var in (("x", x.float32().reshape(M, D)), ("q", q), ("cache_k", cache_k), ("cache_v", cache_v),
                      ("mask", mask), ("probs", probs)):
        inputs.add(name, var)
    L = 0
    if attn.has_prompt:
        prompt_k, prompt_v = attn.prompt_keys_values(start_pos)
        L = prompt_k.shape[0]
        inputs.add("PROMPT_K", prompt_k)
        inputs.add("PROMPT_V", prompt_v)
        inputs.add("PROMPT_GATE", attn.prompt_gate.reshape(H))
    else:
        inputs.code += "const float *PROMPT_K = nullptr, *PROMPT_V = nullptr, *PROMPT_GATE = nullptr;\n"
    inputs.add("WO", attn.wo.weight, "const void *")
    inputs.lora_expert("O", attn.lora_O)
    inputs.add("FFN_NORM", block.ffn_norm.weight)
    for name, base in (("W1", ffn.w1), ("W3", ffn.w3), ("W2", ffn.w2)):
        inputs.add(name, base.weight, "const void *")
    for target, lora in (("GATE", ffn.lora_GATE), ("UP", ffn.lora_UP), ("DOWN", ffn.lora_DOWN)):
        inputs.lora_expert(target, lora)
    adapter = block.p_adapter
    for name, layer, part in (("PA_DOWN_W", "down_proj", "weight"), ("PA_DOWN_B", "down_proj", "bias"),
                              ("PA_UP_W", "up_proj", "weight"), ("PA_UP_B", "up_proj", "bias")):
        inputs.add(name, None if adapter is None else getattr(getattr(adapter, layer), part))
    scale, R = lora_scaling_rank(block)
    sizes = (f"const int64_t M = {M}, T = {T}, S = {S}, D = {D}, H = {H}, Hkv = {Hkv}, hd = {hd}, "
             f"n_rep = {H // Hkv}, L = {L}, F = {ffn.w1.weight.shape[0]}, R = {R}, "
             f"NT = {probs.shape[1]}, P = {0 if adapter is None else adapter.down_proj.weight.shape[0]};\n"
             f"const float eps = {block.ffn_norm.eps!r}f, scale = {1.0 / math.sqrt(hd)!r}f, "
             f"lora_scale = {float(scale)!r}f, CLAMP_LIMIT = {float(block.clamp or 0.0)!r}f;\n"
             f"const bool BASE_BF16 = {str(attn.wo.weight.dtype == 'bfloat16').lower()}, "
             f"CLAMP = {str(block.clamp is not None).lower()};\n"
             + columns(block, dict(PROMPT="PROMPT", O="O", GATE="FFN_GATE", UP="FFN_UP", DOWN="FFN_DOWN",
                                   PADAPTER="PADAPTER")))
    out = jt.code((M, D), "float32", inputs.vars, cpu_header=LAYER_HEADER, cpu_src=inputs.code + sizes + LAYER_OUTPUT)
    return out.reshape(B, T, D)


def decode_layer(block, x, cos, sin, mask, start_pos, record):
    """block(x) for one decode step through the KV cache, in two ops and the two cache writes."""
    # x [B,T,D] -> [B,T,D]
    B, T, _ = x.shape
    attn = block.attention
    q, k, v, probs, gamma = layer_input(block, x, cos, sin)
    if record is not None and block.type_names:
        record.update(type_weight=probs.reshape(B, T, -1), threshold=None if gamma is None else gamma.reshape(B, T, 1))
    cache_k, cache_v = attn.update_cache(k.reshape(B, T, attn.n_kv_heads, attn.head_dim),
                                         v.reshape(B, T, attn.n_kv_heads, attn.head_dim), start_pos)
    return layer_output(block, x, q, cache_k, cache_v, mask, probs, start_pos)

