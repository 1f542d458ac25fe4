// g = grad_out, c = gate[h] tw[bt] per row. The prompt's raw output is probs v, so g . raw is
// sum_s p_s (g . v_s): the softmax backward's own expectation, and dgate[h] = sum_bt tw[bt] (g . raw),
// dtw[bt] = sum_h gate[h] (g . raw) come without rebuilding raw; the scores' gradient and dv carry c.
// Inputs q, k, v, probs, g, gate, tw; outputs dq, dk, dv, dgate, dtw (dbase is g itself).
const float *gate = in5_p, *tw = in6_p, *g = in4_p;
std::vector<float> dots(BT * H), ds(BT * H * L), scaled(BT * H * L);
for (int64_t h = 0; h < H; h++)
    dnnl_sgemm('N', 'T', BT, L, hd, 1.f, g + h * hd, H * hd, in2_p + h / n_rep * hd, Hkv * hd,
               0.f, ds.data() + h * L, H * L);
#pragma omp parallel for
for (int64_t row = 0; row < BT * H; row++) {
    const float *p = in3_p + row * L, c = gate[row % H] * tw[row / H];
    float *dr = ds.data() + row * L, expected = 0.f;
    for (int64_t s = 0; s < L; s++) expected += p[s] * dr[s];
    for (int64_t s = 0; s < L; s++) {
        dr[s] = c * p[s] * (dr[s] - expected) * scale;
        scaled[row * L + s] = c * p[s];
    }
    dots[row] = expected;
}
for (int64_t h = 0; h < H; h++) out3_p[h] = 0.f;
for (int64_t bt = 0; bt < BT; bt++) {
    float sum = 0.f;
    for (int64_t h = 0; h < H; h++) { sum += gate[h] * dots[bt * H + h]; out3_p[h] += tw[bt] * dots[bt * H + h]; }
    out4_p[bt] = sum;
}
std::fill(out1_p, out1_p + L * Hkv * hd, 0.f);
std::fill(out2_p, out2_p + L * Hkv * hd, 0.f);
for (int64_t h = 0; h < H; h++) {
    const int64_t kv = h / n_rep;
    dnnl_sgemm('N', 'N', BT, hd, L, 1.f, ds.data() + h * L, H * L, in1_p + kv * hd, Hkv * hd, 0.f, out0_p + h * hd, H * hd);
    dnnl_sgemm('T', 'N', L, hd, BT, 1.f, ds.data() + h * L, H * L, in0_p + h * hd, H * hd, 1.f, out1_p + kv * hd, Hkv * hd);
    dnnl_sgemm('T', 'N', L, hd, BT, 1.f, scaled.data() + h * L, H * L, g + h * hd, H * hd, 1.f, out2_p + kv * hd, Hkv * hd);
}
