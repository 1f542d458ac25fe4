// out [N] = silu(gate) * up
#pragma omp parallel for simd
for (int64_t i = 0; i < N; i++) out0_p[i] = swiglu(in0_p[i], in1_p[i]);
