// softmax(q k^T * scale + mask) v per (batch, head), a block of ROWS queries at a time; the block's
// probabilities live in a per-thread scratch, and each row's log-sum-exp is kept [B,H,T] for the
// backward instead (at 300 tokens and 32 heads a [B,H,T,S] tensor is 11.5 MB per layer).
// Inputs q [B,T,H,hd], k, v [B,S,Hkv,hd], mask [T,S]; outputs out [B,T,H,hd], lse [B,H,T]. Rounded
// operands are written to q_kept, k_kept, v_kept where the backward reads them (outputs 2-4), else to
// scratch; fp32 ones are q, k, v themselves. A bf16 KV cache (KV_BITS: k, v given as bf16 bits, a decode
// step) is widened once over the positions the call reads (the widest key span), never whole.
// Declared per call: q_kept, k_kept, v_kept (E *, or nullptr), KV_BITS.
#include "attention_key_spans.cc"
const auto q_buf = operand_buffer<E>(ROUND && !q_kept, B * T * H * hd),
           k_buf = operand_buffer<E>((ROUND && !k_kept) || KV_BITS, B * S * Hkv * hd),
           v_buf = operand_buffer<E>((ROUND && !v_kept) || KV_BITS, B * S * Hkv * hd);
const int64_t widest = *std::max_element(width.begin(), width.end());
const E *qe = operands(in0_p, B * T * H, hd, hd, ROUND, q_kept ? q_kept : q_buf.get()),
        *ke = KV_BITS ? widened((const uint16_t *)in1_p, B, S, widest, Hkv * hd, k_buf.get())
                      : operands((const float *)in1_p, B * S * Hkv, hd, hd, ROUND, k_kept ? k_kept : k_buf.get()),
        *ve = KV_BITS ? widened((const uint16_t *)in2_p, B, S, widest, Hkv * hd, v_buf.get())
                      : operands((const float *)in2_p, B * S * Hkv, hd, hd, ROUND, v_kept ? v_kept : v_buf.get());
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t h = 0; h < H; h++) {
    const auto scores = scratch<float>(ROWS * S);
    const auto p_buf = operand_buffer<E>(ROUND, ROWS * S);
    float *p = scores.get();
    const E *k = ke + (b * S * Hkv + h / n_rep) * hd, *v = ve + (b * S * Hkv + h / n_rep) * hd;
    for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
        const int64_t rows = std::min(ROWS, T - t0), w = width[t0 / ROWS];
        const E *q = qe + ((b * T + t0) * H + h) * hd;
        float *o = out0_p + ((b * T + t0) * H + h) * hd, *lse = out1_p + (b * H + h) * T + t0;
        if (w > 0) gemm('N', 'T', rows, w, hd, scale, q, H * hd, k, Hkv * hd, 0.f, p, S);
        for (int64_t t = 0; t < rows; t++) {
            float *row = p + t * S, top = -INFINITY, total = 0.f;
            const float *m = mask + (t0 + t) * S;
            const int64_t n = span[t0 + t];
            for (int64_t s = 0; s < n; s++) { row[s] += m[s]; top = std::max(top, row[s]); }
            for (int64_t s = 0; s < n; s++) { row[s] = std::exp(row[s] - top); total += row[s]; }
            for (int64_t s = 0; s < n; s++) row[s] /= total;
            for (int64_t s = n; s < w; s++) row[s] = 0.f;
            lse[t] = top + std::log(total);
        }
        if (w > 0) gemm('N', 'N', rows, hd, w, 1.f, operands(p, rows, w, S, ROUND, p_buf.get()), S, v, Hkv * hd, 0.f, o, H * hd);
        else for (int64_t t = 0; t < rows; t++) std::fill(o + t * H * hd, o + t * H * hd + hd, 0.f);
    }
}
