// fp32 -> bf16 rounding (to nearest, ties to even) and the bf16 -> fp32 widening of gemv.h.
// Jittor's own CPU cast to bf16 truncates; every fp32 -> bf16 conversion of the project rounds here.
#ifndef MOA_BF16_BITS_H
#define MOA_BF16_BITS_H
#include "gemv.h"
static inline uint16_t narrow(float f) {  // round to nearest, ties to even; NaN stays NaN
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// x rounded to bf16 as a product's operand: its bits (for the bf16 units) or their fp32 value
static inline void round_to(float x, uint16_t *dst) { *dst = narrow(x); }
static inline void round_to(float x, float *dst) { *dst = widen(narrow(x)); }
// x [n] rounded into dst [n], threaded: every whole-tensor fp32 -> bf16 pass of the project
template <typename E>
static void round_into(const float *x, int64_t n, E *dst) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) round_to(x[i], dst + i);
}
#endif
