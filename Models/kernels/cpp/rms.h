// RMSNorm's statistic of one row.
#ifndef MOA_RMS_H
#define MOA_RMS_H
#include <cmath>
#include <cstdint>
static inline float rms_inverse(const float *x, int64_t D, float eps) {  // 1 / sqrt(mean(x^2) + eps)
    float squares = 0.f;
    for (int64_t i = 0; i < D; i++) squares += x[i] * x[i];
    return 1.f / std::sqrt(squares / D + eps);
}
#endif
