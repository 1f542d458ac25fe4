// The backward, per (batch, kv head): each block's probabilities recomputed from the log-sum-exp, the
// kv head's gradients accumulated over its query group.
// Inputs q, k, v as the forward's operands (E: the rounded copies it kept, or q, k, v in fp32), lse,
// dout, mask; outputs dq, dk, dv.
#include "attention_key_spans.cc"
const E *qe = (const E *)in0_p, *ke = (const E *)in1_p, *ve = (const E *)in2_p;
const auto dout_buf = operand_buffer<E>(ROUND, B * T * H * hd);
const E *dout_e = operands(in4_p, B * T * H, hd, hd, ROUND, dout_buf.get());
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t g = 0; g < Hkv; g++) {
    const auto scores = scratch<float>(ROWS * S), ds = scratch<float>(ROWS * S);
    const auto p_buf = operand_buffer<E>(ROUND, ROWS * S), ds_buf = operand_buffer<E>(ROUND, ROWS * S);
    float *p = scores.get();
    const E *k = ke + (b * S * Hkv + g) * hd, *v = ve + (b * S * Hkv + g) * hd;
    float *dk = out1_p + (b * S * Hkv + g) * hd, *dv = out2_p + (b * S * Hkv + g) * hd;
    for (int64_t s = 0; s < S; s++) {
        std::fill(dk + s * Hkv * hd, dk + s * Hkv * hd + hd, 0.f);
        std::fill(dv + s * Hkv * hd, dv + s * Hkv * hd + hd, 0.f);
    }
    for (int64_t r = 0; r < n_rep; r++)
    for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
        const int64_t h = g * n_rep + r, rows = std::min(ROWS, T - t0), w = width[t0 / ROWS];
        const E *q = qe + ((b * T + t0) * H + h) * hd, *dout = dout_e + ((b * T + t0) * H + h) * hd;
        const float *lse = in3_p + (b * H + h) * T + t0;
        float *dq = out0_p + ((b * T + t0) * H + h) * hd;
        if (w == 0) {
            for (int64_t t = 0; t < rows; t++) std::fill(dq + t * H * hd, dq + t * H * hd + hd, 0.f);
            continue;
        }
        gemm('N', 'T', rows, w, hd, scale, q, H * hd, k, Hkv * hd, 0.f, p, S);
        for (int64_t t = 0; t < rows; t++) {
            float *row = p + t * S;
            const float *m = mask + (t0 + t) * S;
            const int64_t n = span[t0 + t];
            for (int64_t s = 0; s < n; s++) row[s] = std::exp(row[s] + m[s] - lse[t]);
            for (int64_t s = n; s < w; s++) row[s] = 0.f;
        }
        gemm('T', 'N', w, hd, rows, 1.f, operands(p, rows, w, S, ROUND, p_buf.get()), S, dout, H * hd, 1.f, dv, Hkv * hd);
        gemm('N', 'T', rows, w, hd, 1.f, dout, H * hd, v, Hkv * hd, 0.f, ds.get(), w);
        for (int64_t t = 0; t < rows; t++) {
            const float *pr = p + t * S; float *dr = ds.get() + t * w, dot = 0.f;
            for (int64_t s = 0; s < w; s++) dot += dr[s] * pr[s];
            for (int64_t s = 0; s < w; s++) dr[s] = pr[s] * (dr[s] - dot) * scale;
        }
        const E *dse = operands(ds.get(), rows, w, w, ROUND, ds_buf.get());
        gemm('N', 'N', rows, hd, w, 1.f, dse, w, k, Hkv * hd, 0.f, dq, H * hd);
        gemm('T', 'N', w, hd, rows, 1.f, dse, w, q, H * hd, 1.f, dk, Hkv * hd);
    }
}
