// AdamW's update of one element, in Jittor's operation order (so the same float32 roundings). Per
// parameter, h = (decay, b0, 1 - b0, b1, 1 - b1, step_size, bc2_root, eps) (adamw.step_numbers):
// p' = p * decay - step_size * m' / (sqrt(v') / bc2_root + eps), m' = b0 m + (1 - b0) g,
// v' = b1 v + (1 - b1) g g.
//
// Jittor compiles with -Ofast, which vectorises sqrtf as v * rsqrt(v) (Newton-refined, guarded for v == 0
// only) and a division as a Newton-refined reciprocal. The 128/256-bit rsqrt reads a subnormal v as 0 and
// returns inf; where the thread's MXCSR has DAZ off (which threads have it depends on which -Ofast library
// each loaded), the guard sees v != 0 and the inf becomes NaN. rsqrt(inf) = 0 makes NaN too. So v's two
// ends are settled by its exponent bits, which no flag changes: a subnormal or zero v' has sqrt(v') below
// 1.1e-19, under half an ulp of eps (adamw.exact_for says when), so the denominator is eps; an infinite v'
// (g g overflowed) makes the step m' / inf, 0 for a finite m'.
#ifndef MOA_ADAMW_H
#define MOA_ADAMW_H
#include <cmath>
#include <cstdint>
#include <cstring>
static inline uint32_t float_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline void adamw_element(const float *h, float p, float g, float m, float v, float *po, float *mo, float *vo) {
    const float decayed = p * h[0];
    const float m2 = h[1] * m + h[2] * g, v2 = h[3] * v + h[4] * g * g;
    *mo = m2; *vo = v2;
    const uint32_t v_bits = float_bits(v2) & 0x7fffffffu, m_exponent = float_bits(m2) & 0x7f800000u;
    const bool v_tiny = v_bits < 0x00800000u, v_inf = v_bits == 0x7f800000u;
    const float root = v_tiny ? 0.f : std::sqrt(v2);
    const float step = h[5] * m2 / (root / h[6] + h[7]);
    // an infinite v' beside a finite m' steps by 0; beside a non-finite m', the step's NaN stays
    *po = decayed - (v_inf && m_exponent != 0x7f800000u ? 0.f : step);
}
#endif
