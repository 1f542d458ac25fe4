// Products of a few rows (a decode step) as one pass over the weights: a block of weight rows dotted
// with every row of x in vector registers, threads over the weight rows. oneDNN's sgemm has a fixed
// cost per call that was most of a decode step's small products; this runs at memory speed. The
// weights may be fp32, bf16 bits or int8 values (widened as read, exactly); vf16 is 16 floats, split by
// the compiler without AVX-512.
#ifndef MOA_GEMV_H
#define MOA_GEMV_H
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
// Products of at most this many rows take the GEMV pass (Models/kernels/switch.py reads it from here)
static const int64_t GEMV_ROWS = 16;
static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef int8_t vb16 __attribute__((vector_size(16)));
static inline vf16 load16(const float *p) { vf16 v; std::memcpy(&v, p, 64); return v; }
static inline vf16 load16(const uint16_t *p) {
    vh16 h; std::memcpy(&h, p, 32);
    const vu16 u = __builtin_convertvector(h, vu16) << 16;
    vf16 v; std::memcpy(&v, &u, 64); return v;
}
static inline vf16 load16(const int8_t *p) {
#if defined(__AVX512F__)  // GCC's __builtin_convertvector of these took 3.7x the bf16 pass's time at 1 row
    return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    vb16 b; std::memcpy(&b, p, 16);
    return __builtin_convertvector(b, vf16);
#endif
}
static inline float load1(float w) { return w; }
static inline float load1(uint16_t w) { return widen(w); }
static inline float load1(int8_t w) { return float(w); }
// Y[m, n0..n0+NB) = X[m] . W[n0..n0+NB) for every m < M (X's rows lx apart); only the first `rows` rows of Y
// are written
template <int64_t M, int NB, typename T>
static inline void gemv_rows(int64_t rows, int64_t N, int64_t K, int64_t lx, const float *X, const T *W, float *Y,
                             int64_t n0) {
    vf16 acc[M][NB] = {};
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        vf16 w[NB];
        for (int j = 0; j < NB; j++) {
            w[j] = load16(W + (n0 + j) * K + k);
            __builtin_prefetch(W + (n0 + j + 2 * NB) * K + k);  // two blocks ahead: 1.5x the bandwidth from DRAM
        }
        for (int64_t m = 0; m < M; m++) {
            const vf16 x = load16(X + m * lx + k);
            for (int j = 0; j < NB; j++) acc[m][j] += x * w[j];
        }
    }
    for (int64_t m = 0; m < rows; m++)
        for (int j = 0; j < NB; j++) {
            float sum = 0.f;
            for (int i = 0; i < 16; i++) sum += acc[m][j][i];
            for (int64_t k = K16; k < K; k++) sum += X[m * lx + k] * load1(W[(n0 + j) * K + k]);
            Y[m * N + n0 + j] = sum;
        }
}
// Y [rows,N] = X [M,K] W [N,K]^T, X's rows lx apart and those past `rows` zeros
template <int64_t M, typename T>
static void gemv_of(int64_t rows, int64_t N, int64_t K, int64_t lx, const float *X, const T *W, float *Y) {
    constexpr int NB = M <= 4 ? 4 : M <= 8 ? 2 : 1;  // accumulators M * NB stay in registers
    const int64_t blocks = N / NB;
    #pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t b = 0; b < blocks; b++) gemv_rows<M, NB>(rows, N, K, lx, X, W, Y, NB * b);
    for (int64_t n = NB * blocks; n < N; n++) gemv_rows<M, 1>(rows, N, K, lx, X, W, Y, n);
}
// Y [M,N] = X [M,K] W [N,K]^T, GEMV_ROWS rows of X a pass. A pass is compiled for 1, 2, 4, 8 and 16 rows
// (its accumulators are arrays of fixed size) and takes the smallest that holds its rows: one compiled op
// serves every M, and a pass reads the weights once. Rows fewer than the pass's, or 8 or 16 rows a multiple of
// 4 KB apart (which share cache sets: 16 rows of 4096 took 1.5x as long), are read from a copy padded with
// rows of zeros, its rows a cache line more than K apart.
template <typename T>
static void gemv(int64_t M, int64_t N, int64_t K, const float *X, const T *W, float *Y) {
    for (int64_t m0 = 0; m0 < M; m0 += GEMV_ROWS) {
        const int64_t rows = std::min(GEMV_ROWS, M - m0);
        const int64_t pass = rows <= 2 ? rows : rows <= 4 ? 4 : rows <= 8 ? 8 : 16;
        const bool copied = pass != rows || (pass >= 8 && K % 1024 == 0);
        const int64_t lx = copied ? (K + 15) / 16 * 16 + 16 : K;  // whole cache lines, one more than K's
        std::unique_ptr<float, void (*)(void *)> copy(copied ? (float *)aligned_alloc(64, pass * lx * 4) : nullptr, free);
        for (int64_t m = 0; m < pass && copy; m++) {
            float *row = copy.get() + m * lx;
            if (m < rows) std::copy(X + (m0 + m) * K, X + (m0 + m + 1) * K, row);
            else std::fill(row, row + K, 0.f);
        }
        const float *x = copy ? copy.get() : X + m0 * K;
        float *y = Y + m0 * N;
        if (pass == 1) gemv_of<1>(rows, N, K, lx, x, W, y);
        else if (pass == 2) gemv_of<2>(rows, N, K, lx, x, W, y);
        else if (pass == 4) gemv_of<4>(rows, N, K, lx, x, W, y);
        else if (pass == 8) gemv_of<8>(rows, N, K, lx, x, W, y);
        else gemv_of<16>(rows, N, K, lx, x, W, y);
    }
}
#endif
