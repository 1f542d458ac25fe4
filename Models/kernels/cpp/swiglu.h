// The SwiGLU product silu(g) * u of one element, and its gradients for an incoming d.
#ifndef MOA_SWIGLU_H
#define MOA_SWIGLU_H
#include <cmath>
#include <cstdint>
static inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }
static inline float swiglu(float g, float u) { return g / (1.f + std::exp(-g)) * u; }
static inline void swiglu_grads(float g, float u, float d, float *dg, float *du) {
    const float s = sigmoid(g);
    *dg = d * u * s * (1.f + g * (1.f - s));
    *du = d * g * s;
}
// The threaded passes over n elements: hidden = silu(gate) * up, and the gradients of gate and up for an
// incoming dhidden d (the SwiGLU's ops, and projections.py's op that reads the hidden without keeping it)
static inline void swiglu_into(const float *gate, const float *up, int64_t n, float *hidden) {
    #pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) hidden[i] = swiglu(gate[i], up[i]);
}
static inline void swiglu_grads_into(const float *gate, const float *up, const float *d, int64_t n, float *dgate,
                                     float *dup) {
    #pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) swiglu_grads(gate[i], up[i], d[i], dgate + i, dup + i);
}
#endif
