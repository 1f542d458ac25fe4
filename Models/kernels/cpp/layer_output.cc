// The layer's output side: x [M,D] (the layer's input), q [M,H*hd] and the cache's keys cache_k and values cache_v
// [B,S,Hkv,hd] (this step written) -> [M,D]: attention over the cache and the prompt (PROMPT_MIX [M,PROMPT_E]: a
// mixture's shares of each row, from layer_input), O, the FFN, the parallel adapter's experts, the clamp.
// Names and sizes: decode_layer.layer_output's declarations.
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
                      PROMPT_GATE[head] * column(probs, NT, m, COL_PROMPT), out, scores.data(),
                      PROMPT_MIX ? PROMPT_MIX + m * PROMPT_E : nullptr, L / PROMPT_E);
}
experts_project(M, D, H * hd, att.data(), WO, LORA_O, COL_O < 0 ? nullptr : probs + COL_O, NT, h.data());
for (int64_t m = 0; m < M; m++) {
    for (int64_t i = 0; i < D; i++) h[m * D + i] += x[m * D + i];
    const float inv = rms_inverse(h.data() + m * D, D, eps);
    for (int64_t i = 0; i < D; i++) hn[m * D + i] = h[m * D + i] * inv * FFN_NORM[i];
}
experts_project(M, F, D, hn.data(), W1, LORA_GATE, COL_GATE < 0 ? nullptr : probs + COL_GATE, NT, gate.data());
experts_project(M, F, D, hn.data(), W3, LORA_UP, COL_UP < 0 ? nullptr : probs + COL_UP, NT, up.data());
for (int64_t i = 0; i < M * F; i++) gate[i] = swiglu(gate[i], up[i]);
float *y = out0_p;
experts_project(M, D, F, gate.data(), W2, LORA_DOWN, COL_DOWN < 0 ? nullptr : probs + COL_DOWN, NT, y);
for (int64_t i = 0; i < M * D; i++) y[i] += h[i];
if (P > 0) {  // the parallel adapter's experts on the FFN's input: up(silu(down(hn) + b) + b), weighted by the
              // type weight and, in a mixture, by each row's shares softmax(router(hn))
    std::vector<float> a(M * P), z(M * D), shares(M * PA_E, 1.f);
    if (PA_E > 1) router_shares(M, PA_E, D, hn.data(), PA_ROUTER_W, PA_ROUTER_B, shares.data());
    for (int64_t e = 0; e < PA_E; e++) {
        if (e < PA_ND) {  // one down projection (PA_ND 1) feeds every up
            gemv(M, P, D, hn.data(), PA_DOWN_W[e], a.data());
            for (int64_t m = 0; m < M; m++) for (int64_t j = 0; j < P; j++) {
                const float v = a[m * P + j] + PA_DOWN_B[e][j];
                a[m * P + j] = v * sigmoid(v);
            }
        }
        gemv(M, D, P, a.data(), PA_UP_W[e], z.data());
        for (int64_t m = 0; m < M; m++) {
            const float w = column(probs, NT, m, COL_PADAPTER) * shares[m * PA_E + e];
            for (int64_t i = 0; i < D; i++) y[m * D + i] += w * (z[m * D + i] + PA_UP_B[e][i]);
        }
    }
}
if (CLAMP) for (int64_t i = 0; i < M * D; i++) y[i] = std::min(std::max(y[i], -CLAMP_LIMIT), CLAMP_LIMIT);
