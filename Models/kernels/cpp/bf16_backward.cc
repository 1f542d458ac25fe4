// dx [M,K] = dy [M,N] (fp32, rounded to bf16) w [N,K] (bf16)
bf16_backward(M, N, K, in0_p, (const uint16_t *)in1_p, 0.f, out0_p);
