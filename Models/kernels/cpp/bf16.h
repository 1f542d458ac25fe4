// The bf16 matmul of a frozen base projection: fp32 x [M,K] times bf16 weights, products of bf16 values
// summed in fp32 (autocast's rule, Models/kernels/bf16.py). On a CPU with bf16 units oneDNN's
// gemm_bf16bf16f32; otherwise x rounded to bf16 values in fp32 and the weights widened a panel at a
// time, through sgemm; a decode step's few rows through the GEMV pass over the bf16 weights.
#ifndef MOA_BF16_H
#define MOA_BF16_H
#include "sgemm.h"
#include "bf16_bits.h"
#include "bf16_rows.h"
#include <vector>
#include <memory>
#include <algorithm>
static const int64_t PANEL = 1024;  // weight rows widened at once: 16 MB at K = 4096
extern "C" int dnnl_gemm_bf16bf16f32(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc);
// a [n] narrowed to bf16 bits, for the bf16 units
static std::unique_ptr<uint16_t[]> narrowed(const float *a, int64_t n) {
    auto bits = scratch<uint16_t>(n);
    round_into(a, n, bits.get());
    return bits;
}
// C [M,N] = beta C + A [M,K] (fp32, rounded to bf16 here, or given as bits ab) times op(B) (bf16) with
// fp32 sums, on the CPU's bf16 units; false where this oneDNN cannot (it answers "unimplemented" without them).
static bool gemm_bf16_units(char transb, int64_t M, int64_t N, int64_t K, const float *a,
                            const uint16_t *b, int64_t ldb, float beta, float *c, const uint16_t *ab = nullptr) {
    std::unique_ptr<uint16_t[]> own;
    if (!ab) { own = narrowed(a, M * K); ab = own.get(); }
    return dnnl_gemm_bf16bf16f32('N', transb, M, N, K, 1.f, ab, K, b, ldb, beta, c, N) == 0;
}
// The same product without bf16 units: A rounded to bf16 values in fp32, for sgemm on widened panels.
static std::unique_ptr<float[]> rounded(const float *a, int64_t n) {
    auto r = scratch<float>(n);
    round_into(a, n, r.get());
    return r;
}

// y [M,N] = beta y + x [M,K] w [N,K]^T (beta 0 or 1). Few rows (decoding): the GEMV pass, widening
// each bf16 weight as it is read, so the weights cross memory once, in bf16 (oneDNN's bf16 gemm
// repacks them every call); up to DECODE_ROWS rows of a decode step (`decode`: no gradient), the rows
// kernel (bf16_rows.h, where rows_kernel_serves), which reads them once too. Many rows (training,
// prefill): the bf16 units, else widening is cheap next to the product; PANEL weight rows at a time,
// each one threaded sgemm, so the fp32 copy stays small (the 8B output matrix widened whole is 2.1 GB).
// xb: x already narrowed (narrowed()) where several products read it, or null.
static void bf16_forward(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, float beta, float *y,
                         const uint16_t *xb = nullptr, bool decode = false) {
    if (decode && rows_kernel_serves(M)) {
        bf16_rows(M, N, K, x, w, beta, y);
    } else if (M <= GEMV_ROWS) {
        const auto xr = rounded(x, M * K);
        std::vector<float> product(beta == 0.f ? 0 : M * N);
        gemv(M, N, K, xr.get(), w, beta == 0.f ? y : product.data());
        if (beta != 0.f) for (int64_t i = 0; i < M * N; i++) y[i] += product[i];
    } else if (!(UNITS && gemm_bf16_units('T', M, N, K, x, w, K, beta, y, xb))) {
        const auto xr = rounded(x, M * K);
        auto wf = scratch<float>(std::min(N, PANEL) * K);
        for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
            const int64_t nb = std::min(PANEL, N - n0);
            #pragma omp parallel for
            for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
            dnnl_sgemm('N', 'T', M, nb, K, 1.f, xr.get(), K, wf.get(), K, beta, y + n0, N);
        }
    }
}

// dx [M,K] = beta dx + dyr [M,N] w [N,K] for dy's bf16 values dyr in fp32, without bf16 units: the sum
// over N runs PANEL widened weight rows at a time into dx.
static void widened_backward(int64_t M, int64_t N, int64_t K, const float *dyr, const uint16_t *w, float beta, float *dx) {
    auto wf = scratch<float>(std::min(N, PANEL) * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        #pragma omp parallel for
        for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
        dnnl_sgemm('N', 'N', M, K, nb, 1.f, dyr + n0, N, wf.get(), K, n0 ? 1.f : beta, dx, K);
    }
}
// dx [M,K] = beta dx + dy [M,N] w [N,K] (dy rounded to bf16); the weights are frozen, so no weight gradient.
static void bf16_backward(int64_t M, int64_t N, int64_t K, const float *dy, const uint16_t *w, float beta, float *dx) {
    if (UNITS && gemm_bf16_units('N', M, K, N, dy, w, K, beta, dx)) return;
    widened_backward(M, N, K, rounded(dy, M * N).get(), w, beta, dx);
}
// The same for a dy given as bf16 bits (the loss writes its gradient so, in one pass)
static void bf16_backward_bits(int64_t M, int64_t N, int64_t K, const uint16_t *dy, const uint16_t *w, float beta,
                               float *dx) {
    if (UNITS && dnnl_gemm_bf16bf16f32('N', 'N', M, K, N, 1.f, dy, N, w, K, beta, dx, K) == 0) return;
    auto dyr = scratch<float>(M * N);
    #pragma omp parallel for
    for (int64_t i = 0; i < M * N; i++) dyr[i] = widen(dy[i]);
    widened_backward(M, N, K, dyr.get(), w, beta, dx);
}
#endif
