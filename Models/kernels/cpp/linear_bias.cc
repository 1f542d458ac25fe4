// y [M,N] += bias [N] (input 2), after the product
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) out0_p[m * N + n] += in2_p[n];
