// The SwiGLU type router: w1 and w3 as one [2H,D] matrix, so x is read once (built from Linears and
// Jittor's elementwise ops it was about ten ops and three passes over x and its gradient per layer).
// Inputs x [M,D], W1 [H,D], b1, W3, b3, W2 [NT,H], b2; outputs logits [M,NT], gu [M,2H] (kept).
// gu [M,2H] = x [W1;W3]^T + [b1;b3], logits [M,NT] = swiglu(g, u) W2^T + b2
std::vector<float> w13(2 * H * D), hidden(M * H);
std::copy(in1_p, in1_p + H * D, w13.data());
std::copy(in3_p, in3_p + H * D, w13.data() + H * D);
float *gu = out1_p;
dnnl_sgemm('N', 'T', M, 2 * H, D, 1.f, in0_p, D, w13.data(), D, 0.f, gu, 2 * H);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < H; j++) { gu[m * 2 * H + j] += in2_p[j]; gu[m * 2 * H + H + j] += in4_p[j]; }
    for (int64_t j = 0; j < H; j++) hidden[m * H + j] = swiglu(gu[m * 2 * H + j], gu[m * 2 * H + H + j]);
    for (int64_t n = 0; n < NT; n++) out0_p[m * NT + n] = in6_p[n];
}
dnnl_sgemm('N', 'T', M, NT, H, 1.f, hidden.data(), H, in5_p, H, 1.f, out0_p, NT);
