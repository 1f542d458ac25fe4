// dx [M,K] = bf16(dy [M,N] * s [N]) q [N,K] (int8)
int8_backward(M, N, K, in0_p, (const int8_t *)in1_p, in2_p, 0.f, out0_p);
