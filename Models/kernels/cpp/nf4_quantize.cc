// q [N,K/2] (uint8) and s [N, ceil(K/64)] (bf16 bits) of w [N,K] (fp32), row by row (nf4_quantize_row); a
// non-finite weight fails the op
int64_t bad = -1;
#pragma omp parallel for reduction(max : bad)
for (int64_t n = 0; n < N; n++)
    if (!nf4_quantize_row(in0_p + n * K, K, (uint8_t *)out0_p + n * (K / 2), (uint16_t *)out1_p + n * nf4_groups(K)))
        bad = std::max(bad, n);
if (bad >= 0) LOGf << "row" << bad << "of a" << N << "x" << K << "matrix holds a non-finite value";
