// A loss gradient stored as GRAD_T: fp32, or bf16 bits (rounded) for a bf16 output matrix.
#ifndef MOA_CROSS_ENTROPY_H
#define MOA_CROSS_ENTROPY_H
#include "bf16_bits.h"
#include <cmath>
#include <algorithm>
static inline void store(float *d, float v) { *d = v; }
static inline void store(uint16_t *d, float v) { *d = narrow(v); }
#endif
