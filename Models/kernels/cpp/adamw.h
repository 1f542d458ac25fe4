// AdamW's update of one element, in Jittor's operation order (so the same float32 roundings). Per
// parameter, h = (decay, b0, 1 - b0, b1, 1 - b1, step_size, bc2_root, eps) (adamw.step_numbers):
// p' = p * decay - step_size * m' / (sqrt(v') / bc2_root + eps), m' = b0 m + (1 - b0) g,
// v' = b1 v + (1 - b1) g g.
#ifndef MOA_ADAMW_H
#define MOA_ADAMW_H
#include <cmath>
#include <cstdint>
static inline void adamw_element(const float *h, float p, float g, float m, float v, float *po, float *mo, float *vo) {
    const float decayed = p * h[0];
    const float m2 = h[1] * m + h[2] * g, v2 = h[3] * v + h[4] * g * g;
    *mo = m2; *vo = v2;
    *po = decayed - h[5] * m2 / (std::sqrt(v2) / h[6] + h[7]);
}
#endif
