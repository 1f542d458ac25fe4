// A decode step's projection with its LoRA expert (Models/kernels/projections.py, decode_layer.py):
// y [M,N] = base(x) + w[m] * scale * (x A^T) B^T in GEMV passes, inference only. The base's weights are
// fp32, bf16 or int8 (x rounded for the last two as base_linear does; through the rows kernel of bf16_rows.h
// where rows_kernel_serves), the expert's fp32 (none when A is null); u = x A^T [M,R] is tiny. w is read
// with a stride (a column of the type weights), or null (weight 1).
#ifndef MOA_LORA_PROJECT_H
#define MOA_LORA_PROJECT_H
#include "base_matrix.h"
static void lora_project(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const BaseMatrix &base,
                         const float *A, const float *Bw, const float *w, int64_t w_stride, float scale, float *y) {
    base_product(M, N, K, x, base, true, 0.f, y, nullptr, true);
    if (!A) return;
    std::vector<float> u(M * R);
    gemv(M, R, K, x, A, u.data());
    for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) u[m * R + r] *= scale * (w ? w[m * w_stride] : 1.f);
    #pragma omp parallel for if (N * R >= 32768)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.f;
            for (int64_t r = 0; r < R; r++) sum += u[m * R + r] * Bw[n * R + r];
            y[m * N + n] += sum;
        }
}
#endif
