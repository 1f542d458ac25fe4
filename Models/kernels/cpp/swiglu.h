// The SwiGLU product silu(g) * u of one element, and its gradients for an incoming d.
#ifndef MOA_SWIGLU_H
#define MOA_SWIGLU_H
#include <cmath>
static inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }
static inline float swiglu(float g, float u) { return g / (1.f + std::exp(-g)) * u; }
static inline void swiglu_grads(float g, float u, float d, float *dg, float *du) {
    const float s = sigmoid(g);
    *dg = d * u * s * (1.f + g * (1.f - s));
    *du = d * g * s;
}
#endif
