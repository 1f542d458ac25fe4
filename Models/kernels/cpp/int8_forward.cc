// y [M,N] = x [M,K] (fp32) W^T for W = s [N] * q [N,K] (int8) under the bf16 rule; `decode`: a decode step's product
int8_forward(M, N, K, in0_p, (const int8_t *)in1_p, in2_p, 0.f, out0_p, nullptr, decode);
