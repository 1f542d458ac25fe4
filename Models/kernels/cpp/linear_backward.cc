// A trained linear's backward: inputs g [M,N], x [M,K], W [N,K] -> dx = g W, dW = g^T x, db = the sum of g's rows
#include "linear_input_grad.cc"
dnnl_sgemm('T', 'N', N, K, M, 1.f, in0_p, N, in1_p, K, 0.f, out1_p, K);
for (int64_t n = 0; n < N; n++) out2_p[n] = 0.f;
for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) out2_p[n] += in0_p[m * N + n];
