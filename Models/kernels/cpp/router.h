// One row's type routing for a decode step (route_row.cc): the SwiGLU element and a dot product.
#ifndef MOA_ROUTER_H
#define MOA_ROUTER_H
#include "swiglu.h"
#include <algorithm>
#include <vector>
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
#endif
