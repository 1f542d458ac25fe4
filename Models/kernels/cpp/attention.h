// Causal attention's products through oneDNN (Models/kernels/attention.py), in the base's precision.
// fp32: the fp32 operands through sgemm. bf16 (training and prefill of a bf16 base, as autocast does):
// q, k, v, the probabilities and, backwards, the incoming gradient and the scores' gradient rounded to
// bf16, products summed in fp32: bf16 bits on the bf16 units (E = uint16_t), else their fp32 values
// through sgemm (E = float, ROUND). Softmax, the log-sum-exp and every output stay fp32.
#ifndef MOA_ATTENTION_H
#define MOA_ATTENTION_H
#include "bf16.h"
#include <cmath>
#include <type_traits>
static inline void gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
static inline void gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A, int64_t lda,
                        const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    dnnl_gemm_bf16bf16f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
// rows x cols of x (row stride ld) as operands: x itself in fp32, else a rounded copy in buf (rows * ld)
template <typename E>
static const E *operands(const float *x, int64_t rows, int64_t cols, int64_t ld, bool round, E *buf) {
    if (std::is_same<E, float>::value && !round) return reinterpret_cast<const E *>(x);
    #pragma omp parallel for if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) for (int64_t c = 0; c < cols; c++) round_to(x[r * ld + c], buf + r * ld + c);
    return buf;
}
// positions [0, n) of each sequence of a bf16 KV cache [B,S,row] (bits) as operands in buf [B,S,row]
// (the positions past n are left unwritten)
template <typename E>
static const E *widened(const uint16_t *bits, int64_t B, int64_t S, int64_t n, int64_t row, E *buf) {
    #pragma omp parallel for collapse(2)
    for (int64_t b = 0; b < B; b++) for (int64_t s = 0; s < n; s++)
        for (int64_t i = 0; i < row; i++) round_to(widen(bits[(b * S + s) * row + i]), buf + (b * S + s) * row + i);
    return buf;
}
// a buffer for operands(): n elements where they are rounded copies, none where fp32 operands are read in place
template <typename E>
static std::unique_ptr<E[]> operand_buffer(bool round, int64_t n) { return scratch<E>(round ? n : 0); }
#endif
