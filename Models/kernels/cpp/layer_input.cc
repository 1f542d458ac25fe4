// The layer's input side: x [M,D] -> q [M,H*hd], the keys and values [2,M,Hkv*hd] (q and k rotated; k and v as bf16
// bits where KV_BITS, the cache's type, rounded as the cache write would), the type weights
// PROBS [M,NT], Gamma GAMMAS [M,1] (Sparse) and a prompt mixture's shares PROMPT_MIX [M,PROMPT_E]; the experts
// weighted by WEIGHTS [M,NW]: PROBS, or GATES given per sequence (instance-level routing: no router here). Qwen3
// (Q_NORM, K_NORM not null): each query and key head RMS-normed after its projection and expert, before RoPE.
// Names and sizes: decode_layer.layer_input's declarations.
std::vector<float> xn(M * D);
for (int64_t m = 0; m < M; m++) {
    const float inv = rms_inverse(x + m * D, D, eps);
    for (int64_t i = 0; i < D; i++) xn[m * D + i] = x[m * D + i] * inv * ATTENTION_NORM[i];
}
for (int64_t m = 0; m < M; m++) {
    const float *xm = x + m * D;
    float *probs_row = PROBS + m * NT, gamma = 0.f;
#include "route_row.cc"
    if (SPARSE) GAMMAS[m] = gamma;
}
if (PROMPT_E > 1)  // a mixture of prompt experts: each row's shares of them, for layer_output
    router_shares(M, PROMPT_E, D, xn.data(), PROMPT_ROUTER_W, PROMPT_ROUTER_B, PROMPT_MIX);
const int64_t KV = M * Hkv * hd;
std::vector<float> kv_values(KV_BITS ? 2 * KV : 0);
float *k = KV_BITS ? kv_values.data() : (float *)out1_p, *v = k + KV;
experts_project(M, H * hd, D, xn.data(), WQ, LORA_Q, COL_Q < 0 ? nullptr : WEIGHTS + COL_Q, NW, out0_p);
experts_project(M, Hkv * hd, D, xn.data(), WK, LORA_K, COL_K < 0 ? nullptr : WEIGHTS + COL_K, NW, k);
experts_project(M, Hkv * hd, D, xn.data(), WV, LORA_V, COL_V < 0 ? nullptr : WEIGHTS + COL_V, NW, v);
if (Q_NORM) head_norms(out0_p, M * H, hd, Q_NORM, head_eps);
if (K_NORM) head_norms(k, M * Hkv, hd, K_NORM, head_eps);
for (int64_t m = 0; m < M; m++) {
    const float *c = COS + (m % T) * (hd / 2), *s = SIN + (m % T) * (hd / 2);
    for (int64_t h = 0; h < H; h++) rotate_pairs_row(out0_p + (m * H + h) * hd, out0_p + (m * H + h) * hd, c, s, hd / 2, 1.f);
    for (int64_t h = 0; h < Hkv; h++) rotate_pairs_row(k + (m * Hkv + h) * hd, k + (m * Hkv + h) * hd, c, s, hd / 2, 1.f);
}
if (KV_BITS) {
    round_into(k, 2 * KV, (uint16_t *)out1_p);  // k, then v
}
