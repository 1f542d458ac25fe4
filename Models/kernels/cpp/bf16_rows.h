// A decode step's product with bf16 weights for more rows than a GEMV pass holds in registers:
// y [M,N] = beta y + x [M,K] w [N,K]^T for the M that rows_kernel_serves (at most DECODE_ROWS), under
// the bf16 rule of Models/kernels/bf16.py (x rounded to bf16, products of bf16 values summed in fp32).
// The weights cross memory once, in bf16 (oneDNN's bf16 gemm packs them anew at every call, which
// costs as much as the product at these shapes). Threads take blocks of NB weight rows; a block is
// read a chunk of KC columns at a time: the first tile of MT rows of x reads the chunk from memory,
// the other tiles from the cache, while the next chunk is prefetched into L2 a line per step (at
// 32 rows that is 1.25x faster than leaving the stream to the hardware prefetcher). Each tile keeps
// MT x NB accumulators in registers. On the bf16 units (avx512_bf16) a step is 32 columns of bf16
// pairs (_mm512_dpbf16_ps); without them x is kept as its rounded fp32 values and each weight is
// widened as read (gemv.h), 16 columns a step.
#ifndef MOA_BF16_ROWS_H
#define MOA_BF16_ROWS_H
#include "bf16_bits.h"
#include "sgemm.h"
#include <algorithm>
#include <stdlib.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
// UNITS: the op's bf16 and int8 products run on the CPU's bf16 units (avx512_bf16, which Jittor's -march=native
// announces as __AVX512BF16__), else they widen bf16 values to fp32; an op defines MOA_UNITS 0 to take the
// widening forms on a CPU with the units (the tests of what a CPU without them runs). A constant of the op's text:
// each form of the rows kernels is about a fifth of a bf16 op's compile time, and an op compiles one.
#if defined(__AVX512BF16__) && (!defined(MOA_UNITS) || MOA_UNITS)
#define MOA_BF16_UNITS 1
#else
#define MOA_BF16_UNITS 0
#endif
static constexpr bool UNITS = MOA_BF16_UNITS;
// Products of at most this many rows run as a decode step's pass over the weights (switch.py reads it)
static const int64_t DECODE_ROWS = 64;
// 5 x 5 accumulators, the x and weight steps in the other 6 registers (with 4 x 6 the compiler reloaded
// weight steps for each row of x); chunks of 4096 columns: over the 8B layer's products at 8-64 rows,
// 1.5-1.6x the rate of 4 x 6 in chunks of 2048 on a Zen 4 EPYC (docs/performance.md)
static const int ROWS_MT = 5, ROWS_NB = 5;
static const int64_t ROWS_KC = 4096;

// the widening steps: x as rounded fp32 values, 16 columns
struct WidenedSteps {
    typedef float X;
    typedef uint16_t W;
    typedef vf16 Acc;
    static const int64_t STEP = 16;
    static inline Acc zero() { return Acc{}; }
    static inline Acc step(Acc acc, const float *x, const uint16_t *w) { return acc + load16(x) * load16(w); }
    static inline float sum(Acc acc) { float s = 0.f; for (int i = 0; i < 16; i++) s += acc[i]; return s; }
    static inline float value(float x) { return x; }
};
#if defined(__AVX512BF16__)
// the bf16 units' steps: x as bf16 bits, 32 columns, dot products of bf16 pairs
struct UnitSteps {
    typedef uint16_t X;
    typedef uint16_t W;
    typedef __m512 Acc;
    static const int64_t STEP = 32;
    static inline Acc zero() { return _mm512_setzero_ps(); }
    static inline Acc step(Acc acc, const uint16_t *x, const uint16_t *w) {
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
    }
    static inline float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
    static inline float value(uint16_t x) { return widen(x); }
};
#endif

// n accumulators, aligned for vector moves (new[] of a 64-byte vector type does not align it before C++17)
template <typename Acc>
static std::unique_ptr<Acc, void (*)(void *)> accumulators(int64_t n) {
    return std::unique_ptr<Acc, void (*)(void *)>((Acc *)aligned_alloc(64, n * sizeof(Acc)), free);
}

// The lines of the next chunk, `per` of them at every step, its rows in turn, into L2
struct ChunkPrefetch {
    const char *base = nullptr;
    int64_t row_bytes = 0, lines = 0, done = 0, rows = 1;
    int per = 0;
    inline void step() {
        for (int i = 0; i < per && done < lines; i++, done++)
            __builtin_prefetch(base + (done % rows) * row_bytes + (done / rows) * 64, 0, 2);
    }
};

// acc [MT][NB] (kept in `accs` between chunks) += x [MT rows, stride lx] . w [NB rows, stride K] over [k0, k1)
template <class P, int MT, int NB>
static inline void rows_tile(int64_t lx, int64_t K, int64_t k0, int64_t k1, const typename P::X *x,
                             const typename P::W *w, typename P::Acc *accs, ChunkPrefetch &prefetch) {
    typename P::Acc acc[MT][NB];
    for (int m = 0; m < MT; m++) for (int j = 0; j < NB; j++) acc[m][j] = accs[m * NB + j];
    for (int64_t k = k0; k < k1; k += P::STEP) {
        prefetch.step();
        for (int m = 0; m < MT; m++)
            for (int j = 0; j < NB; j++) acc[m][j] = P::step(acc[m][j], x + m * lx + k, w + j * K + k);
    }
    for (int m = 0; m < MT; m++) for (int j = 0; j < NB; j++) accs[m * NB + j] = acc[m][j];
}

template <class P, int NB>
static inline void rows_tile_of(int rows, int64_t lx, int64_t K, int64_t k0, int64_t k1, const typename P::X *x,
                                const typename P::W *w, typename P::Acc *accs, ChunkPrefetch &prefetch) {
    switch (rows) {
        case 5: rows_tile<P, 5, NB>(lx, K, k0, k1, x, w, accs, prefetch); break;
        case 4: rows_tile<P, 4, NB>(lx, K, k0, k1, x, w, accs, prefetch); break;
        case 3: rows_tile<P, 3, NB>(lx, K, k0, k1, x, w, accs, prefetch); break;
        case 2: rows_tile<P, 2, NB>(lx, K, k0, k1, x, w, accs, prefetch); break;
        default: rows_tile<P, 1, NB>(lx, K, k0, k1, x, w, accs, prefetch); break;
    }
}

// y [M, n0..n0+NB) = beta y + scale . (x . w), w the NB weight rows [NB,K], scale the rows' (int8) or null (1);
// `next`: the weight rows read after these (prefetched), or null
template <class P, int NB>
static void rows_block(int64_t M, int64_t N, int64_t K, int64_t lx, const typename P::X *x, const typename P::W *w,
                       const float *scale, int64_t n0, const typename P::W *next, int64_t next_rows, float beta,
                       float *y, typename P::Acc *accs) {
    const int64_t w_bytes = sizeof(typename P::W);
    const int64_t K_steps = K / P::STEP * P::STEP, tiles = (M + ROWS_MT - 1) / ROWS_MT;
    for (int64_t i = 0; i < M * NB; i++) accs[i] = P::zero();
    for (int64_t k0 = 0; k0 < K_steps; k0 += ROWS_KC) {
        const int64_t k1 = std::min(K_steps, k0 + ROWS_KC);
        ChunkPrefetch prefetch;  // this block's next chunk, else the first chunk of the rows after it
        const bool last = k1 == K_steps;
        if (!last || next) {
            prefetch.base = (const char *)(last ? next : w + k1);
            prefetch.row_bytes = K * w_bytes;
            prefetch.rows = last ? next_rows : NB;
            prefetch.lines = prefetch.rows * ((std::min(ROWS_KC, last ? K_steps : K_steps - k1) * w_bytes + 63) / 64);
            const int64_t steps = tiles * ((k1 - k0) / P::STEP);
            prefetch.per = int((prefetch.lines + steps - 1) / steps);
        }
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_MT)
            rows_tile_of<P, NB>(int(std::min<int64_t>(ROWS_MT, M - m0)), lx, K, k0, k1, x + m0 * lx, w,
                                accs + m0 * NB, prefetch);
    }
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < NB; j++) {
            float s = P::sum(accs[m * NB + j]);
            const typename P::W *row = w + j * K;
            for (int64_t k = K_steps; k < K; k++) s += P::value(x[m * lx + k]) * load1(row[k]);
            if (scale) s *= scale[n0 + j];
            float *out = y + m * N + n0 + j;
            *out = beta == 0.f ? s : *out + s;
        }
}

// y [M,N] = beta y + x [M,K] (fp32, rounded here) w [N,K]^T (P::W: bf16, or int8 with a scale per row), P's steps
template <class P>
static void bf16_rows_with(int64_t M, int64_t N, int64_t K, const float *x, const typename P::W *w, const float *scale,
                           float beta, float *y) {
    const int64_t lx = K + 32;  // a padded stride: rows 2^k bytes apart would share cache sets with the weights'
    auto xr = scratch<typename P::X>(M * lx);
    #pragma omp parallel for
    for (int64_t m = 0; m < M; m++) for (int64_t k = 0; k < K; k++) round_to(x[m * K + k], xr.get() + m * lx + k);
    const int64_t blocks = N / ROWS_NB, units = blocks + N % ROWS_NB;  // blocks of NB rows, then single rows
    #pragma omp parallel
    {
        const auto accs = accumulators<typename P::Acc>((M + ROWS_MT) * ROWS_NB);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (u < blocks) {
                const int64_t n0 = u * ROWS_NB, n_next = n0 + ROWS_NB;
                rows_block<P, ROWS_NB>(M, N, K, lx, xr.get(), w + n0 * K, scale, n0, n_next < N ? w + n_next * K : nullptr,
                                       std::min<int64_t>(ROWS_NB, N - n_next), beta, y, accs.get());
            } else {
                const int64_t n0 = blocks * ROWS_NB + (u - blocks);
                rows_block<P, 1>(M, N, K, lx, xr.get(), w + n0 * K, scale, n0, nullptr, 0, beta, y, accs.get());
            }
        }
    }
}

// y [M,N] = beta y + x [M,K] w [N,K]^T for a decode step's rows (rows_kernel_serves), on the bf16 units (UNITS)
// or widening
static void bf16_rows(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, float beta, float *y) {
#if MOA_BF16_UNITS
    bf16_rows_with<UnitSteps>(M, N, K, x, w, nullptr, beta, y);
#else
    bf16_rows_with<WidenedSteps>(M, N, K, x, w, nullptr, beta, y);
#endif
}

// With the bf16 units this kernel serves a decode step from this many rows on, not only above GEMV_ROWS:
// past 8 rows the GEMV pass keeps one weight row per block and reloads x for each (8 bf16 matrices of
// 14336 x 4096 from memory, fp32 x: 8 rows 33 vs 23 ms, 12 rows 114 vs 29, 16 rows 185 vs 35; 1-4 alike).
static const int64_t UNIT_ROWS_FROM = 5;

// whether a decode step of M rows takes this kernel
static inline bool rows_kernel_serves(int64_t M) {
    return M <= DECODE_ROWS && (M > GEMV_ROWS || (UNITS && M >= UNIT_ROWS_FROM));
}
#endif
