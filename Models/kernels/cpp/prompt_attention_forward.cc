// out = base + gate[h] * type_weight[bt] * softmax(q k^T * scale) v, and the probabilities [BT,H,L]
// kept for the backward. Inputs q [BT,H*hd], k, v [L,Hkv*hd], gate [H], type_weight [BT], base
// [BT,H*hd]; outputs out, probs. Built from Jittor ops, the weighting and the add (and their gradients'
// reductions) were a dozen more passes.
const bool few_rows = BT <= GEMV_ROWS;  // a decode step: plain loops, no sgemm set-up per head
const float *gate = in3_p, *tw = in4_p, *base = in5_p;
for (int64_t h = 0; h < H; h++) {
    const float *q = in0_p + h * hd, *k = in1_p + h / n_rep * hd;
    if (!few_rows) dnnl_sgemm('N', 'T', BT, L, hd, scale, q, H * hd, k, Hkv * hd, 0.f, out1_p + h * L, H * L);
    else for (int64_t r = 0; r < BT; r++) for (int64_t s = 0; s < L; s++) {
        float dot = 0.f;
        for (int64_t i = 0; i < hd; i++) dot += q[r * H * hd + i] * k[s * Hkv * hd + i];
        out1_p[(r * H + h) * L + s] = dot * scale;
    }
}
#pragma omp parallel for if (!few_rows)
for (int64_t row = 0; row < BT * H; row++) {
    float *p = out1_p + row * L, top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < L; s++) top = std::max(top, p[s]);
    for (int64_t s = 0; s < L; s++) { p[s] = std::exp(p[s] - top); total += p[s]; }
    for (int64_t s = 0; s < L; s++) p[s] /= total;
}
attend_prompt(out1_p, in2_p, BT, H, hd, L, Hkv, n_rep, out0_p);
#pragma omp parallel for if (!few_rows)
for (int64_t row = 0; row < BT * H; row++) {
    const float c = gate[row % H] * tw[row / H];
    for (int64_t i = 0; i < hd; i++) out0_p[row * hd + i] = base[row * hd + i] + c * out0_p[row * hd + i];
}
