// dx [M,K] = dy [M,N] (bf16 bits, already rounded) w [N,K] (bf16)
bf16_backward_bits(M, N, K, (const uint16_t *)in0_p, (const uint16_t *)in1_p, 0.f, out0_p);
