// A decode step's MoA layer in two ops (Models/kernels/decode_layer.py), from the pieces the per-op
// kernels use: lora_project, rms_inverse, rotate_pairs_row and route_row.cc; round_into gives a bf16 cache's k and v.
#ifndef MOA_DECODE_LAYER_H
#define MOA_DECODE_LAYER_H
#include "bf16_bits.h"
#include "lora_project.h"
#include "rms.h"
#include "rotate.h"
#include "router.h"
#include <algorithm>
// q . k over n elements of a KV cache held in fp32 (router.h's dot) or in bf16 (widened as read)
static inline float dot(const float *a, const uint16_t *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * widen(b[i]);
    return s;
}
// out [hd] += gain * softmax_s(q . k_s * scale) v_s over the n keys/values k_s, v_s (row stride ld), T: the
// cache's element type (float or bf16 bits). row_gates (a mixture of prompt experts, one softmax over all their
// rows): v_s also times its expert's share row_gates[s / per_gate]; null: none.
template <typename T>
static void attend(const float *q, const T *k, const T *v, int64_t n, int64_t ld, int64_t hd, float scale,
                   float gain, float *out, float *scores, const float *row_gates = nullptr, int64_t per_gate = 1) {
    float top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < n; s++) { scores[s] = dot(q, k + s * ld, hd) * scale; top = std::max(top, scores[s]); }
    for (int64_t s = 0; s < n; s++) { scores[s] = std::exp(scores[s] - top); total += scores[s]; }
    for (int64_t s = 0; s < n; s++) {
        const float p = gain * scores[s] / total * (row_gates ? row_gates[s / per_gate] : 1.f);
        for (int64_t i = 0; i < hd; i++) out[i] += p * load1(v[s * ld + i]);
    }
}
// each of the n head vectors x [n,hd] RMS-normed in place with the weights w [hd] (Qwen3's q_norm, k_norm)
static void head_norms(float *x, int64_t n, int64_t hd, const float *w, float eps) {
    for (int64_t r = 0; r < n; r++) {
        float *row = x + r * hd;
        const float inv = rms_inverse(row, hd, eps);
        for (int64_t i = 0; i < hd; i++) row[i] = row[i] * inv * w[i];
    }
}
static inline float column(const float *probs, int64_t NT, int64_t m, int64_t col) { return col < 0 ? 1.f : probs[m * NT + col]; }
// shares [M,E] = softmax(x [M,K] W^T + b) per row: a prompt or adapter mixture's router
static void router_shares(int64_t M, int64_t E, int64_t K, const float *x, const float *W, const float *b,
                          float *shares) {
    gemv(M, E, K, x, W, shares);
    for (int64_t m = 0; m < M; m++) softmax_gates(shares + m * E, b, E, shares + m * E);
}
#endif
