// The frozen base's nf4 matrices (QLoRA's 4-bit NormalFloat): a code c in 0..15 per weight, two a byte, and a
// bf16 scale s (the absmax) per group of 64 weights along a row, a row's last group holding what is left. Weight
// k of row n stands for bf16(NF4_CODES[c] * s) (nf4_value): an nf4 matrix is a bf16 matrix in 4.25 bits a weight,
// and its products are that bf16 matrix's under the bf16 rule of Models/kernels/bf16.py (x rounded to bf16,
// products summed in fp32). A row of K weights (K even) takes K/2 bytes in blocks of 32 weights (the last block
// holds L = what is left): byte i of a block holds its weight i in the low nibble and weight L/2 + i in the high
// one, so 16 bytes widen to two runs of 16 weights with a mask and a shift. A decode step's GEMV pass widens each
// weight as read through a 16-entry table per group (on the bf16 units an AVX-512 permute per 32 weights, dotted
// as bf16 pairs), so the matrix crosses memory once at about half a byte a weight; training and prefill widen
// PANEL rows at a time to bf16 for oneDNN's gemm on the bf16 units (to fp32 for sgemm without them), as int8.h does.
#ifndef MOA_NF4_H
#define MOA_NF4_H
#include "int8.h"

static const int64_t NF4_GROUP = 64;  // weights a scale serves
static const int64_t NF4_BLOCK = 32;  // weights a 16-byte run of codes holds
// bitsandbytes' NF4 codebook (QLoRA, Dettmers et al. 2023), as fp32
static const float NF4_CODES[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                              -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                              0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
                              0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
static inline int64_t nf4_groups(int64_t K) { return (K + NF4_GROUP - 1) / NF4_GROUP; }
// a scale's bf16 bits: the absmax rounded to nearest even, kept finite (a max |w| past bf16's largest rounds down)
static inline uint16_t nf4_scale(float top) { const uint16_t b = narrow(top); return b == 0x7f80 ? 0x7f7f : b; }
static inline float nf4_value(int c, uint16_t s) { return widen(narrow(NF4_CODES[c] * widen(s))); }
// the code nearest to v: the midpoints between codes below v (a midpoint itself takes the lower code)
static inline uint8_t nf4_code(float v) {
    uint8_t c = 0;
    for (int i = 0; i < 15; i++) c += (NF4_CODES[i] + NF4_CODES[i + 1]) * 0.5f < v;
    return c;
}

// q [K/2] and s [nf4_groups(K)] of w [K] (K even); false where w holds a non-finite value. A group whose max |w|
// is below QUANTIZED_MIN (int8.h) holds zeros (scale 0). Every nf4 quantization of the project (a checkpoint
// read, a model converted in memory) goes through here.
static bool nf4_quantize_row(const float *w, int64_t K, uint8_t *q, uint16_t *s) {
    if (non_finite_count(w, K)) return false;
    uint8_t codes[NF4_GROUP];
    for (int64_t g = 0; g < nf4_groups(K); g++) {
        const int64_t k0 = g * NF4_GROUP, n = std::min(NF4_GROUP, K - k0);
        float top = 0.f;
        for (int64_t k = 0; k < n; k++) top = std::max(top, std::fabs(w[k0 + k]));
        s[g] = widen(nf4_scale(top)) >= QUANTIZED_MIN ? nf4_scale(top) : 0;
        const float inv = s[g] ? 1.f / widen(s[g]) : 0.f;
        for (int64_t k = 0; k < n; k++) codes[k] = nf4_code(w[k0 + k] * inv);
        for (int64_t b0 = 0; b0 < n; b0 += NF4_BLOCK) {  // the group's blocks, packed
            const int64_t half = std::min(NF4_BLOCK, n - b0) / 2;
            for (int64_t i = 0; i < half; i++) q[(k0 + b0) / 2 + i] = codes[b0 + i] | codes[b0 + half + i] << 4;
        }
    }
    return true;
}

// An nf4 matrix as the GEMV pass (gemv.h) takes it: gemv_of's calls of gemv_rows find the overload below
struct Nf4Matrix { const uint8_t *q; const uint16_t *s; };
// a group's 16 weights bf16(NF4_CODES[c] * s), and 16 bytes of a block widened through them to its two runs of 16
#if defined(__AVX512F__)
typedef __m512 Nf4Table;
static inline Nf4Table nf4_table(uint16_t s) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(NF4_CODES), _mm512_set1_ps(widen(s))));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));  // as narrow(): no NaN here
}
static inline void nf4_runs(const uint8_t *q, Nf4Table t, vf16 &lo, vf16 &hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    lo = (vf16)_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), t);
    hi = (vf16)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
}
#else
struct Nf4Table { float v[16]; };
static inline Nf4Table nf4_table(uint16_t s) {
    Nf4Table t;
    for (int c = 0; c < 16; c++) t.v[c] = nf4_value(c, s);
    return t;
}
static inline void nf4_runs(const uint8_t *q, const Nf4Table &t, vf16 &lo, vf16 &hi) {
    for (int i = 0; i < 16; i++) { lo[i] = t.v[q[i] & 15]; hi[i] = t.v[q[i] >> 4]; }
}
#endif
// a run of 16 widened weights (bf16 values as fp32) stored as E: fp32, or bf16 bits (their top halves, exactly)
static inline void nf4_store(vf16 v, float *dst) { std::memcpy(dst, &v, 64); }
static inline void nf4_store(vf16 v, uint16_t *dst) {
    vu16 u;
    std::memcpy(&u, &v, 64);
    const vh16 h = __builtin_convertvector(u >> 16, vh16);
    std::memcpy(dst, &h, 32);
}
// the K weights of row q [K/2] (scales s) as E (bf16 bits or fp32 values): whole blocks through the group's table,
// a short last block one weight at a time
template <typename E>
static void nf4_widen_row(const uint8_t *q, const uint16_t *s, int64_t K, E *dst) {
    const int64_t whole = K / NF4_BLOCK * NF4_BLOCK;
    Nf4Table t;
    for (int64_t k = 0; k < whole; k += NF4_BLOCK) {
        if (k % NF4_GROUP == 0) t = nf4_table(s[k / NF4_GROUP]);
        vf16 lo, hi;
        nf4_runs(q + k / 2, t, lo, hi);
        nf4_store(lo, dst + k);
        nf4_store(hi, dst + k + 16);
    }
    const int64_t half = (K - whole) / 2;
    for (int64_t i = 0; i < half; i++) {
        const uint8_t byte = q[whole / 2 + i];
        round_to(nf4_value(byte & 15, s[whole / NF4_GROUP]), dst + whole + i);
        round_to(nf4_value(byte >> 4, s[whole / NF4_GROUP]), dst + whole + half + i);
    }
}
// rows [n0, n0 + nb) of an nf4 matrix widened into dst [nb,K]
template <typename E>
static void nf4_widen_rows(const uint8_t *q, const uint16_t *s, int64_t K, int64_t n0, int64_t nb, E *dst) {
    #pragma omp parallel for
    for (int64_t n = 0; n < nb; n++)
        nf4_widen_row(q + (n0 + n) * (K / 2), s + (n0 + n) * nf4_groups(K), K, dst + n * K);
}
#if MOA_BF16_UNITS
// on the bf16 units: a group's 16 weights as bf16 bits (the low half), and a block's 32 codes widened through them
// in order, for _mm512_dpbf16_ps (_mm512_cvtneps_pbh rounds to nearest even, as narrow())
static inline __m512i nf4_unit_table(uint16_t s) {
    const __m256bh bits = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(NF4_CODES), _mm512_set1_ps(widen(s))));
    return _mm512_castsi256_si512((__m256i)bits);
}
// a group's two blocks (32 bytes) widened at once: (blocks' weights 0-15, then 16-31) as (lo, hi), each the first
// block's 16 then the second's
static inline void nf4_unit_group(const uint8_t *q, __m512i t, __m512bh &lo, __m512bh &hi) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), t);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), t);
}
static inline __m512bh nf4_unit_block(const uint8_t *q, __m512i t) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(b, 4);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), t);
}
#endif
// Y[m, n0..n0+NB) = X[m] . W[n0..n0+NB) for every m < M, as gemv.h's gemv_rows for an nf4 W: whole blocks through
// the group's tables (built once a group), on the bf16 units 32 weights a dot-product step of bf16 pairs (X holds
// bf16 values: exact as bits), else 16 fp32 products a step; a short last block one weight at a time
template <int64_t M, int NB>
static inline void gemv_rows(int64_t rows, int64_t N, int64_t K, int64_t lx, const float *X, const Nf4Matrix *W,
                             float *Y, int64_t n0) {
    vf16 acc[M][NB] = {};
    const int64_t G = nf4_groups(K), whole = K / NF4_BLOCK * NF4_BLOCK;
#if MOA_BF16_UNITS
    __m512i t[NB];
    const int64_t groups = K / NF4_GROUP * NF4_GROUP;
    for (int64_t k = 0; k < groups; k += NF4_GROUP) {  // whole groups: a group's 64 weights a row in two steps
        __m512bh lo[NB], hi[NB];
        for (int j = 0; j < NB; j++) {
            const uint8_t *q = W->q + (n0 + j) * (K / 2) + k / 2;
            nf4_unit_group(q, nf4_unit_table(W->s[(n0 + j) * G + k / NF4_GROUP]), lo[j], hi[j]);
            __builtin_prefetch(q + 2 * NB * (K / 2));  // two blocks of rows ahead, as gemv.h
        }
        for (int64_t m = 0; m < M; m++) {
            const float *x = X + m * lx + k;
            const __m512bh a = _mm512_cvtne2ps_pbh((__m512)load16(x + 32), (__m512)load16(x));
            const __m512bh b = _mm512_cvtne2ps_pbh((__m512)load16(x + 48), (__m512)load16(x + 16));
            for (int j = 0; j < NB; j++)
                acc[m][j] = (vf16)_mm512_dpbf16_ps(_mm512_dpbf16_ps((__m512)acc[m][j], a, lo[j]), b, hi[j]);
        }
    }
    for (int64_t k = groups; k < whole; k += NF4_BLOCK) {  // a short last group's whole block
        __m512bh w[NB];
        for (int j = 0; j < NB; j++) {
            const uint8_t *q = W->q + (n0 + j) * (K / 2) + k / 2;
            if (k % NF4_GROUP == 0) t[j] = nf4_unit_table(W->s[(n0 + j) * G + k / NF4_GROUP]);
            w[j] = nf4_unit_block(q, t[j]);
            __builtin_prefetch(q + 2 * NB * (K / 2));  // two blocks of rows ahead, as gemv.h
        }
        for (int64_t m = 0; m < M; m++) {
            const __m512bh x = _mm512_cvtne2ps_pbh((__m512)load16(X + m * lx + k + 16), (__m512)load16(X + m * lx + k));
            for (int j = 0; j < NB; j++) acc[m][j] = (vf16)_mm512_dpbf16_ps((__m512)acc[m][j], x, w[j]);
        }
    }
#else
    Nf4Table t[NB];
    for (int64_t k = 0; k < whole; k += NF4_BLOCK) {
        vf16 lo[NB], hi[NB];
        for (int j = 0; j < NB; j++) {
            const uint8_t *q = W->q + (n0 + j) * (K / 2) + k / 2;
            if (k % NF4_GROUP == 0) t[j] = nf4_table(W->s[(n0 + j) * G + k / NF4_GROUP]);
            nf4_runs(q, t[j], lo[j], hi[j]);
            __builtin_prefetch(q + 2 * NB * (K / 2));  // two blocks of rows ahead, as gemv.h
        }
        for (int64_t m = 0; m < M; m++) {
            const vf16 a = load16(X + m * lx + k), b = load16(X + m * lx + k + 16);
            for (int j = 0; j < NB; j++) acc[m][j] += a * lo[j] + b * hi[j];
        }
    }
#endif
    for (int64_t m = 0; m < rows; m++)
        for (int j = 0; j < NB; j++) {
            float sum = 0.f;
            for (int i = 0; i < 16; i++) sum += acc[m][j][i];
            if (whole < K) {
                float tail[NF4_BLOCK];
                nf4_widen_row(W->q + (n0 + j) * (K / 2) + whole / 2, W->s + (n0 + j) * G + whole / NF4_GROUP,
                              K - whole, tail);
                for (int64_t k = whole; k < K; k++) sum += X[m * lx + k] * tail[k - whole];
            }
            Y[m * N + n0 + j] = sum;
        }
}

// y [M,N] = beta y + x [M,K] W^T for the nf4 W (q, s): up to GEMV_ROWS rows the GEMV pass, else widened panels
static void nf4_forward(int64_t M, int64_t N, int64_t K, const float *x, const uint8_t *q, const uint16_t *s,
                        float beta, float *y, const uint16_t *xb = nullptr) {
    if (M <= GEMV_ROWS) {
        const Nf4Matrix W{q, s};
        const auto xr = rounded(x, M * K);
        std::vector<float> product(beta == 0.f ? 0 : M * N);
        gemv(M, N, K, xr.get(), &W, beta == 0.f ? y : product.data());
        if (beta != 0.f) for (int64_t i = 0; i < M * N; i++) y[i] += product[i];
        return;
    }
    const auto widen = [&](int64_t n0, int64_t nb, auto *dst) { nf4_widen_rows(q, s, K, n0, nb, dst); };
    panel_gemm(M, N, K, x, widen, nullptr, beta, y, xb);
}
// dx [M,K] = beta dx + bf16(dy [M,N]) W [N,K] for the nf4 W; the weights are frozen, so no weight gradient
static void nf4_backward(int64_t M, int64_t N, int64_t K, const float *dy, const uint8_t *q, const uint16_t *s,
                         float beta, float *dx) {
    const auto widen = [&](int64_t n0, int64_t nb, auto *dst) { nf4_widen_rows(q, s, K, n0, nb, dst); };
    panel_backward(M, N, K, dy, widen, nullptr, beta, dx);
}
#endif
