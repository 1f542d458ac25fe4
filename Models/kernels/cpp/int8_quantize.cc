// q [N,K] (int8) and s [N] of w [N,K] (fp32), row by row (quantize_row); a non-finite weight fails the op
int64_t bad = -1;
#pragma omp parallel for reduction(max : bad)
for (int64_t n = 0; n < N; n++) {
    out1_p[n] = quantize_row(in0_p + n * K, K, (int8_t *)out0_p + n * K);
    if (out1_p[n] < 0.f) bad = std::max(bad, n);
}
if (bad >= 0) LOGf << "row" << bad << "of a" << N << "x" << K << "matrix holds a non-finite value";
