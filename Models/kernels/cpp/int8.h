// The frozen base's int8 matrices: values q [N,K] (|q| <= 127) and a scale per row s [N], row n standing
// for q[n] * s[n] (quantize_row). Their products keep the bf16 rule of Models/kernels/bf16.py on the
// values, which bf16 holds exactly (at most 7 significant bits): y = s * (bf16(x) . q) and, backwards,
// dx = bf16(dy * s) . q, products summed in fp32. The values are widened inside the kernels: a decode
// step's GEMV pass and rows kernel widen each one as read, so the matrix crosses memory once at a byte a
// weight; training and prefill widen PANEL rows at a time to bf16 for oneDNN's gemm on the bf16 units
// (to fp32 for sgemm without them), next to which the widening is cheap.
#ifndef MOA_INT8_H
#define MOA_INT8_H
#include "bf16.h"
#include <cmath>

// the elements of w [K] that are NaN or inf, told by their exponent bits: Jittor compiles with -Ofast,
// under which std::isfinite is always true
static inline int64_t non_finite_count(const float *w, int64_t K) {
    int64_t bad = 0;
    #pragma omp simd reduction(+ : bad)
    for (int64_t k = 0; k < K; k++) {
        uint32_t u; std::memcpy(&u, w + k, 4);
        bad += (u & 0x7f800000u) == 0x7f800000u;
    }
    return bad;
}

// q [K] = w / s rounded half up, s = max |w| / 127 (symmetric absmax); returns s, or -1 where w holds a
// non-finite value. A row whose max |w| is below QUANTIZED_MIN holds zeros (127 / max |w| would overflow
// past 3.7e-37, and such weights add nothing an fp32 sum keeps). Every quantization of the project (a
// checkpoint read, a model converted in memory) goes through here.
static const float QUANTIZED_MIN = 1e-30f;
static float quantize_row(const float *w, int64_t K, int8_t *q) {
    if (non_finite_count(w, K)) return -1.f;
    float top = 0.f;
    #pragma omp simd reduction(max : top)
    for (int64_t k = 0; k < K; k++) top = std::max(top, std::fabs(w[k]));
    const float inv = top >= QUANTIZED_MIN ? 127.f / top : 0.f;
    #pragma omp simd
    for (int64_t k = 0; k < K; k++) q[k] = int8_t(std::floor(std::min(127.f, std::max(-127.f, w[k] * inv)) + 0.5f));
    return top / 127.f;
}

// an int8 value widened exactly: bf16 bits (for the bf16 units) or fp32
static inline void widen_to(int8_t v, uint16_t *d) { const float f = v; uint32_t u; std::memcpy(&u, &f, 4); *d = uint16_t(u >> 16); }
static inline void widen_to(int8_t v, float *d) { *d = v; }
template <typename E>
static void widen_panel(const int8_t *q, int64_t n, E *dst) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) widen_to(q[i], dst + i);
}

// y [M, n0..n0+nb) = beta y + s[n] c [M,nb]: a panel's product under its rows' scales
static void add_scaled(int64_t M, int64_t N, int64_t n0, int64_t nb, const float *c, const float *s, float beta, float *y) {
    #pragma omp parallel for if (M * nb >= 32768)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < nb; j++) {
            float *out = y + m * N + n0 + j;
            const float v = s[n0 + j] * c[m * nb + j];
            *out = beta == 0.f ? v : *out + v;
        }
}

// the rows kernel's steps (bf16_rows.h) over int8 weights, each widened as read: to fp32 values, 16 columns; on
// the bf16 units to bf16 pairs, 32 columns. From 8 rows on the widening bounds the kernel (its conversions cost
// as much as the dot products: 16-64 rows take 1.3x the bf16 weights' time); widening each block of weight
// rows once into a buffer for all the tiles of x was slower below 32 rows and gained 8-13% above.
struct Int8WidenedSteps : WidenedSteps {
    typedef int8_t W;
    static inline Acc step(Acc acc, const float *x, const int8_t *w) { return acc + load16(x) * load16(w); }
};
#if defined(__AVX512BF16__)
struct Int8UnitSteps : UnitSteps {
    typedef int8_t W;
    static inline Acc step(Acc acc, const uint16_t *x, const int8_t *w) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)w);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), _mm512_cvtne2ps_pbh(hi, lo));
    }
};
#endif
static void int8_rows(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *q, const float *s, float beta,
                      float *y) {
#if MOA_BF16_UNITS
    bf16_rows_with<Int8UnitSteps>(M, N, K, x, q, s, beta, y);
#else
    bf16_rows_with<Int8WidenedSteps>(M, N, K, x, q, s, beta, y);
#endif
}

// C = A B^T ('T') or A B ('N') with fp32 sums, beta 0 or 1, of operands as bf16 bits (the bf16 units: false where
// this oneDNN cannot, answering "unimplemented" without them) or as fp32 values
static bool gemm_of(char transb, int64_t M, int64_t N, int64_t K, const uint16_t *a, int64_t lda, const uint16_t *b,
                    int64_t ldb, float beta, float *c, int64_t ldc) {
    return dnnl_gemm_bf16bf16f32('N', transb, M, N, K, 1.f, a, lda, b, ldb, beta, c, ldc) == 0;
}
static bool gemm_of(char transb, int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *b,
                    int64_t ldb, float beta, float *c, int64_t ldc) {
    return dnnl_sgemm('N', transb, M, N, K, 1.f, a, lda, b, ldb, beta, c, ldc) == 0;
}

// y [M,N] = beta y + xe [M,K] W^T (x's bf16 values as E: bits or fp32) for the matrix that widen(n0, nb, dst) writes
// PANEL rows at a time as E, its rows scaled by s [N] (int8) or not (null); false where the gemm cannot (at the first
// panel, before anything is written)
template <typename E, typename Widen>
static bool panel_gemm_as(int64_t M, int64_t N, int64_t K, const E *xe, const Widen &widen, const float *s,
                          float beta, float *y) {
    const int64_t panel = std::min(N, PANEL);
    auto c = scratch<float>(s ? M * panel : 0);
    auto w = scratch<E>(panel * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        widen(n0, nb, w.get());
        if (!s) {
            if (!gemm_of('T', M, nb, K, xe, K, w.get(), K, beta, y + n0, N)) return false;
            continue;
        }
        if (!gemm_of('T', M, nb, K, xe, K, w.get(), K, 0.f, c.get(), nb)) return false;
        add_scaled(M, N, n0, nb, c.get(), s, beta, y);
    }
    return true;
}
// the same for fp32 x (narrowed here, or given as bits xb), on the bf16 units where the op takes them and oneDNN can
template <typename Widen>
static void panel_gemm(int64_t M, int64_t N, int64_t K, const float *x, const Widen &widen, const float *s, float beta,
                       float *y, const uint16_t *xb) {
    if (UNITS) {
        std::unique_ptr<uint16_t[]> own;
        if (!xb) { own = narrowed(x, M * K); xb = own.get(); }
        if (panel_gemm_as(M, N, K, xb, widen, s, beta, y)) return;
    }
    panel_gemm_as(M, N, K, rounded(x, M * K).get(), widen, s, beta, y);
}

// whether a decode step of M rows takes the rows kernel with int8 weights: where it does with bf16 ones and, on the
// bf16 units, from 2 rows on (the GEMV pass took about 1.5x its time at 2 rows and 2.6-3.4x at 4, over
// [4, 4096] x [14336, 4096]^T on a Zen 4 EPYC; at 1 row the GEMV pass reads at the streaming rate)
static inline bool int8_rows_serve(int64_t M) {
    return rows_kernel_serves(M) || (UNITS && M >= 2 && M <= DECODE_ROWS);
}
// y [M,N] = beta y + x [M,K] W^T for W = s * q; `decode`: a decode step's product (the rows kernel where it
// serves, else the GEMV pass up to GEMV_ROWS rows), as bf16_forward
static void int8_forward(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *q, const float *s, float beta,
                         float *y, const uint16_t *xb = nullptr, bool decode = false) {
    if (decode && int8_rows_serve(M)) {
        int8_rows(M, N, K, x, q, s, beta, y);
    } else if (M <= GEMV_ROWS) {
        const auto xr = rounded(x, M * K);
        auto c = scratch<float>(M * N);
        gemv(M, N, K, xr.get(), q, c.get());
        add_scaled(M, N, 0, N, c.get(), s, beta, y);
    } else {
        const auto widen = [&](int64_t n0, int64_t nb, auto *dst) { widen_panel(q + n0 * K, nb * K, dst); };
        panel_gemm(M, N, K, x, widen, s, beta, y, xb);
    }
}

// dx [M,K] = beta dx + bf16(dy [M,N] s) W [N,K] with the rounded operand as E (bits or fp32), for the matrix that
// widen(n0, nb, dst) writes PANEL rows at a time, s [N] its row scales (int8) or null (1); false where the gemm
// cannot (at the first panel, before dx is written)
template <typename E, typename Widen>
static bool panel_backward_as(int64_t M, int64_t N, int64_t K, const float *dy, const Widen &widen, const float *s,
                              float beta, float *dx) {
    auto dyr = scratch<E>(M * N);
    #pragma omp parallel for
    for (int64_t i = 0; i < M * N; i++) round_to(s ? dy[i] * s[i % N] : dy[i], dyr.get() + i);
    auto w = scratch<E>(std::min(N, PANEL) * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        widen(n0, nb, w.get());
        if (!gemm_of('N', M, K, nb, dyr.get() + n0, N, w.get(), K, n0 ? 1.f : beta, dx, K)) return false;
    }
    return true;
}
// the same for fp32 operands, on the bf16 units where the op takes them and oneDNN can
template <typename Widen>
static void panel_backward(int64_t M, int64_t N, int64_t K, const float *dy, const Widen &widen, const float *s,
                           float beta, float *dx) {
    if (!(UNITS && panel_backward_as<uint16_t>(M, N, K, dy, widen, s, beta, dx)))
        panel_backward_as<float>(M, N, K, dy, widen, s, beta, dx);
}
// dx [M,K] = beta dx + bf16(dy [M,N] * s) q [N,K]; the weights are frozen, so no weight gradient
static void int8_backward(int64_t M, int64_t N, int64_t K, const float *dy, const int8_t *q, const float *s, float beta,
                          float *dx) {
    const auto widen = [&](int64_t n0, int64_t nb, auto *dst) { widen_panel(q + n0 * K, nb * K, dst); };
    panel_backward(M, N, K, dy, widen, s, beta, dx);
}
#endif
