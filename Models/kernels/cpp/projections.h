// Training's projections of one input with their LoRA experts (Models/kernels/projections.py), per
// projection. Forward: y = base(x) (+ the expert), u = x A^T kept. Backward: dx = beta dx + g W (+ du A)
// with du = (g B) w scale, dA = du^T x, dB = g^T (u w scale), dw = scale (g B . u); no dx where dx is
// null (an input that needs no gradient).
#ifndef MOA_PROJECTIONS_H
#define MOA_PROJECTIONS_H
#include "lora_project.h"
#include "swiglu.h"
// xb: x narrowed to bf16 once for all the op's base products (bf16 units), or null
static void project_forward(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const uint16_t *xb,
                            const BaseMatrix &W, const float *A, const float *Bw, const float *w, float scale, float *y,
                            float *u) {
    if (!A) { base_product(M, N, K, x, W, 0.f, y, xb); return; }
    std::vector<float> uw(M * R);
    dnnl_sgemm('N', 'T', M, R, K, 1.f, x, K, A, K, 0.f, u, R);
    for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) uw[m * R + r] = u[m * R + r] * scale * (w ? w[m] : 1.f);
    dnnl_sgemm('N', 'T', M, N, R, 1.f, uw.data(), R, Bw, R, 0.f, y, N);
    base_product(M, N, K, x, W, 1.f, y, xb);
}
static void project_backward(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const BaseMatrix &W,
                             const float *A, const float *Bw, const float *w, float scale, const float *u,
                             const float *g, float beta, float *dx, float *dA, float *dB, float *dw) {
    if (A) {
        std::vector<float> gu(M * R), du(M * R), uw(M * R);
        dnnl_sgemm('N', 'N', M, R, N, 1.f, g, N, Bw, R, 0.f, gu.data(), R);
        for (int64_t m = 0; m < M; m++) {
            const float ws = scale * (w ? w[m] : 1.f);
            float dot = 0.f;
            for (int64_t r = 0; r < R; r++) {
                dot += gu[m * R + r] * u[m * R + r];
                du[m * R + r] = gu[m * R + r] * ws;
                uw[m * R + r] = u[m * R + r] * ws;
            }
            if (dw) dw[m] = dot * scale;
        }
        narrow_weight_grad(M, N, R, g, uw.data(), dB);
        dnnl_sgemm('T', 'N', R, K, M, 1.f, du.data(), R, x, K, 0.f, dA, K);
        if (!dx) return;
        dnnl_sgemm('N', 'N', M, K, R, 1.f, du.data(), R, A, K, beta, dx, K);
        beta = 1.f;
    }
    if (dx) base_input_grad(M, N, K, g, W, beta, dx);
}
#endif
