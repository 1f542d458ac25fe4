// oneDNN's fp32 GEMM and the scratch buffers of the ops built on it.
#ifndef MOA_SGEMM_H
#define MOA_SGEMM_H
#include <cstdint>
#include <memory>
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
// Scratch that every element of is written before it is read: no zero fill (a vector's would be a
// single-threaded pass as long as the threaded one that fills it).
template <typename T>
static std::unique_ptr<T[]> scratch(int64_t n) { return std::unique_ptr<T[]>(new T[n]); }
// C [N,R] = G [M,N]^T U [M,R] for a narrow R (a LoRA up-projection's gradient): oneDNN's sgemm runs
// C^T = U^T G, R rows, 1.3-1.6x faster than G^T U; the same sums, so the same numbers.
static void narrow_weight_grad(int64_t M, int64_t N, int64_t R, const float *g, const float *u, float *c) {
    const auto ct = scratch<float>(R * N);
    dnnl_sgemm('T', 'N', R, N, M, 1.f, u, R, g, N, 0.f, ct.get(), N);
    for (int64_t n = 0; n < N; n++) for (int64_t r = 0; r < R; r++) c[n * R + r] = ct[r * N + n];
}
#endif
