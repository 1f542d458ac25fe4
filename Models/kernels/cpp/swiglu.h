// The SwiGLU product silu(g) * u of one element, and its gradients for an incoming d.
#ifndef MOA_SWIGLU_H
#define MOA_SWIGLU_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include "gemv.h"
// exp's argument is capped at 80 (exp(80) = 5.5e34): beyond about 88 exp is inf, and the vectorised division
// (a reciprocal estimate refined by a Newton step) turns 1 / inf into NaN; below the cap the bits are unchanged
static inline float exp_capped(float v) { return std::exp(std::min(v, 80.f)); }
static inline float sigmoid(float v) { return 1.f / (1.f + exp_capped(-v)); }
static inline float swiglu(float g, float u) { return g / (1.f + exp_capped(-g)) * u; }
// 1 - s as e s: the vectorised division leaves s an ulp or two off 1 for a large g, and g (1 - s) multiplied
// that by g (a gate of 3e7 had its gradient 2.8 times too large; one of 2,000, 1e-4 off)
static inline void swiglu_grads(float g, float u, float d, float *dg, float *du) {
    const float e = exp_capped(-g), s = 1.f / (1.f + e);
    *dg = d * u * s * (1.f + g * (e * s));
    *du = d * g * s;
}
// gate and up as training keeps them for the backward: fp32, or bf16 bits under the bf16 rule
static inline float kept_value(float v) { return v; }
static inline float kept_value(uint16_t v) { return widen(v); }
// The threaded passes over n elements: hidden = silu(gate) * up, and the gradients of gate and up for an
// incoming dhidden d (the SwiGLU's ops, and projections.py's op that reads the hidden without keeping it)
template <typename G>
static inline void swiglu_into(const G *gate, const G *up, int64_t n, float *hidden) {
    #pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) hidden[i] = swiglu(kept_value(gate[i]), kept_value(up[i]));
}
template <typename G>
static inline void swiglu_grads_into(const G *gate, const G *up, const float *d, int64_t n, float *dgate,
                                     float *dup) {
    #pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) swiglu_grads(kept_value(gate[i]), kept_value(up[i]), d[i], dgate + i, dup + i);
}
#endif
