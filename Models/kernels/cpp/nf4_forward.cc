// y [M,N] = x [M,K] (fp32) W^T for the nf4 W: codes q [N,K/2] (uint8), bf16 group scales s [N, ceil(K/64)]
nf4_forward(M, N, K, in0_p, (const uint8_t *)in1_p, (const uint16_t *)in2_p, 0.f, out0_p);
