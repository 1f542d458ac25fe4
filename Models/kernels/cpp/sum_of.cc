// out [N] = TERMS: the elementwise sum of the inputs, TERMS declared per call (in0_p[i] + in1_p[i] + ...).
#pragma omp parallel for simd
for (int64_t i = 0; i < N; i++) out0_p[i] = TERMS;
