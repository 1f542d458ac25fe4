// A decode step's projection with its LoRA expert (Models/kernels/projections.py, decode_layer.py):
// y [M,N] = base(x) + w[m] * scale * (x A^T) B^T in GEMV passes, inference only. The base's weights are
// fp32, bf16 or int8 (x rounded for the last two as base_linear does; through the rows kernel of bf16_rows.h
// where rows_kernel_serves), the expert's fp32 (none when A is null); u = x A^T [M,R] is tiny. w is read
// with a stride (a column of the type weights), or null (weight 1). experts_project: the same for a
// projection's LoraExperts, one or a mixture gated per row (the decode layer's projections).
#ifndef MOA_LORA_PROJECT_H
#define MOA_LORA_PROJECT_H
#include "base_matrix.h"
#include "lora_experts.h"
typedef float vf8 __attribute__((vector_size(32)));
// y [M,N] += U [M,E*R] (B_0 | ... | B_{E-1})^T, B_e [N,R]: each dot product in eight lanes of independent sums
// (one sum a row was a chain of dependent adds: 1.5 GFLOP/s where this reads B at memory speed)
static void add_low_rank(int64_t M, int64_t N, int64_t E, int64_t R, const float *U, const float *const *B,
                         float *y) {
    const int64_t R8 = R / 8 * 8;
    #pragma omp parallel for if (N * E * R >= 32768)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            vf8 lanes = {};
            float sum = 0.f;
            for (int64_t e = 0; e < E; e++) {
                const float *u = U + (m * E + e) * R, *b = B[e] + n * R;
                for (int64_t r = 0; r < R8; r += 8) {
                    vf8 ur, br;
                    std::memcpy(&ur, u + r, 32);
                    std::memcpy(&br, b + r, 32);
                    lanes += ur * br;
                }
                for (int64_t r = R8; r < R; r++) sum += u[r] * b[r];
            }
            for (int i = 0; i < 8; i++) sum += lanes[i];
            y[m * N + n] += sum;
        }
}
static void lora_project(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const BaseMatrix &base,
                         const float *A, const float *Bw, const float *w, int64_t w_stride, float scale, float *y) {
    base_product(M, N, K, x, base, 0.f, y, nullptr, true);
    if (!A) return;
    std::vector<float> u(M * R);
    gemv(M, R, K, x, A, u.data());
    for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) u[m * R + r] *= scale * (w ? w[m * w_stride] : 1.f);
    add_low_rank(M, N, 1, R, u.data(), &Bw, y);
}
// y [M,N] = base(x) + w[m] * scale * sum_e gate[m,e] (x A_e^T) B_e^T for the projection's experts `ex`
// (lora_experts.h): none or one as lora_project, a mixture as one LoRA of rank E*R whose rank blocks are gated
static void experts_project(int64_t M, int64_t N, int64_t K, const float *x, const BaseMatrix &base,
                            const LoraExperts &ex, const float *w, int64_t w_stride, float *y) {
    if (ex.mixing == SINGLE) {
        lora_project(M, N, K, ex.R, x, base, ex.E ? ex.A[0] : nullptr, ex.B[0], w, w_stride, ex.scale, y);
        return;
    }
    base_product(M, N, K, x, base, 0.f, y, nullptr, true);
    const int64_t E = ex.E, R = ex.R;
    std::vector<float> low(ex.NA * M * R), u(M * E * R), logits(M * E), threshold(M, 0.f);
    for (int64_t a = 0; a < ex.NA; a++) gemv(M, R, K, x, ex.A[a], low.data() + a * M * R);  // [NA][M][R]
    gemv(M, E, K, x, ex.router_w, logits.data());
    if (ex.mixing == THRESHOLD) gemv(M, 1, K, x, ex.threshold_w, threshold.data());
    for (int64_t m = 0; m < M; m++)
        mixture_row(ex, logits.data() + m * E, threshold[m], low.data(), M, m, ex.scale * (w ? w[m * w_stride] : 1.f),
                    u.data());
    add_low_rank(M, N, E, R, u.data(), ex.B, y);
}
#endif
