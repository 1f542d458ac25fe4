// A checkpoint matrix [N,K] read and quantized to int8 or nf4 a block of rows at a time (int8.h's quantize_row,
// nf4.h's nf4_quantize_row), so a quantized base never holds a whole matrix in the checkpoint's type
// (Models/formats/reading.read_quantized).
// The matrix may be stored in parts (Meta's model-parallel shards): each part a rectangle of it, rows
// [row0, row0 + rows) x columns [col0, col0 + cols), contiguous in its file from `offset`.
#ifndef MOA_READ_QUANTIZED_H
#define MOA_READ_QUANTIZED_H
#include "read_file.h"
#include "nf4.h"
#include <vector>
// the checkpoint's element types, told apart for the conversion to fp32
struct BF16Bits { uint16_t bits; };
struct HalfBits { uint16_t bits; };
static inline float stored_value(float v) { return v; }
static inline float stored_value(BF16Bits v) { return widen(v.bits); }
static inline float stored_value(HalfBits v) {  // IEEE binary16, subnormals, inf and NaN included
    const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16, exponent = (v.bits >> 10) & 0x1fu, mantissa = v.bits & 0x3ffu;
    if (exponent == 0) return (sign ? -1.f : 1.f) * std::ldexp(float(mantissa), -24);
    const uint32_t u = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    float f; std::memcpy(&f, &u, 4); return f;
}
struct MatrixPart { int fd; int64_t offset, row0, rows, col0, cols; };
// Rows [r0, r0 + n) of the matrix as fp32 into f [n,K], read from every part that holds some of them;
// false where a read failed
template <typename STORED>
static bool read_rows(const std::vector<MatrixPart> &parts, int64_t K, int64_t r0, int64_t n, std::vector<char> &raw,
                      float *f) {
    for (const MatrixPart &p : parts) {
        const int64_t first = std::max(r0, p.row0), end = std::min(r0 + n, p.row0 + p.rows);
        if (first >= end) continue;
        const int64_t row_bytes = p.cols * int64_t(sizeof(STORED)), bytes = (end - first) * row_bytes;
        raw.resize(bytes);
        if (!read_fully(p.fd, raw.data(), bytes, p.offset + (first - p.row0) * row_bytes)) return false;
        const STORED *values = (const STORED *)raw.data();
        for (int64_t r = first; r < end; r++)
            for (int64_t c = 0; c < p.cols; c++) f[(r - r0) * K + p.col0 + c] = stored_value(values[(r - first) * p.cols + c]);
    }
    return true;
}
// row r of w [K] quantized into the op's outputs: int8 values [N,K] and fp32 row scales [N], or nf4 codes [N,K/2]
// and bf16 group scales [N, ceil(K/64)]; false where w holds a non-finite value
static bool quantize_into(const float *w, int64_t K, int64_t r, int8_t *q, float *s) {
    return (s[r] = quantize_row(w, K, q + r * K)) >= 0.f;
}
static bool quantize_into(const float *w, int64_t K, int64_t r, uint8_t *q, uint16_t *s) {
    return nf4_quantize_row(w, K, q + r * (K / 2), s + r * nf4_groups(K));
}
#endif
