// inputs gate, up, d [N] -> dgate, dup
#pragma omp parallel for simd
for (int64_t i = 0; i < N; i++) swiglu_grads(in0_p[i], in1_p[i], in2_p[i], out0_p + i, out1_p + i);
