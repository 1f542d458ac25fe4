// RoPE on one head vector x [2*half]: each (even, odd) pair rotated by +-angle (sign); y may be x.
#ifndef MOA_ROTATE_H
#define MOA_ROTATE_H
#include <cstdint>
static inline void rotate_pairs_row(const float *x, float *y, const float *c, const float *s, int64_t half, float sign) {
    for (int64_t i = 0; i < half; i++) {
        float even = x[2 * i], odd = x[2 * i + 1], sine = sign * s[i];
        y[2 * i] = even * c[i] - odd * sine;
        y[2 * i + 1] = even * sine + odd * c[i];
    }
}
#endif
