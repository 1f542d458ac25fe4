// base_product and base_input_grad: the products of a frozen base matrix (storage.h) on the CPU, each in the
// form its storage takes.
#ifndef MOA_BASE_MATRIX_H
#define MOA_BASE_MATRIX_H
#include "nf4.h"
#include "storage.h"
// MOA_STORAGES: the storages of the op's matrices, a bit each (cpp.CodeInputs.header). The products below compile
// those storages' paths only: the bf16, int8 and nf4 kernels are most of an op's compile time, and an op of fp32
// matrices never runs them.
#ifndef MOA_STORAGES
#error "MOA_STORAGES: the op defines the storages of its base matrices (Models/kernels/cpp.py, CodeInputs.header)"
#endif
static constexpr bool compiled(Storage s) { return (MOA_STORAGES >> s) & 1; }
// y [M,N] = beta y + x [M,K] W^T. xb: x narrowed to bf16 once for several products (bf16 units), or null;
// decode: a decode step's product (no gradient; at most DECODE_ROWS rows, GEMV_ROWS for fp32)
static void base_product(int64_t M, int64_t N, int64_t K, const float *x, const BaseMatrix &W, float beta, float *y,
                         const uint16_t *xb = nullptr, bool decode = false) {
    if (compiled(BF16) && W.storage == BF16)
        bf16_forward(M, N, K, x, (const uint16_t *)W.values, beta, y, xb, decode);
    else if (compiled(INT8) && W.storage == INT8)
        int8_forward(M, N, K, x, (const int8_t *)W.values, (const float *)W.scale, beta, y, xb, decode);
    else if (compiled(NF4) && W.storage == NF4)
        nf4_forward(M, N, K, x, (const uint8_t *)W.values, (const uint16_t *)W.scale, beta, y, xb);
    else if (decode && beta == 0.f && M <= GEMV_ROWS) gemv(M, N, K, x, (const float *)W.values, y);
    else dnnl_sgemm('N', 'T', M, N, K, 1.f, x, K, (const float *)W.values, K, beta, y, N);
}
// dx [M,K] = beta dx + dy [M,N] W (under the storage's rule); the base is frozen: no weight gradient
static void base_input_grad(int64_t M, int64_t N, int64_t K, const float *dy, const BaseMatrix &W, float beta,
                            float *dx) {
    if (compiled(BF16) && W.storage == BF16)
        bf16_backward(M, N, K, dy, (const uint16_t *)W.values, beta, dx);
    else if (compiled(INT8) && W.storage == INT8)
        int8_backward(M, N, K, dy, (const int8_t *)W.values, (const float *)W.scale, beta, dx);
    else if (compiled(NF4) && W.storage == NF4)
        nf4_backward(M, N, K, dy, (const uint8_t *)W.values, (const uint16_t *)W.scale, beta, dx);
    else dnnl_sgemm('N', 'N', M, K, N, 1.f, dy, N, (const float *)W.values, K, beta, dx, K);
}
#endif
