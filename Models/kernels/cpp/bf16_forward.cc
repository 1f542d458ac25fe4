// y [M,N] = x [M,K] (fp32) w [N,K]^T (bf16) under the bf16 rule; `decode`: a decode step's product
bf16_forward(M, N, K, in0_p, (const uint16_t *)in1_p, 0.f, out0_p, nullptr, decode);
