// The SwiGLU router's backward, dx whole: inputs x, W1, W3, W2, gu, dlogits -> dx, dW1, db1, dW3, db3, dW2, db2
const float *x = in0_p, *gu = in4_p, *dl = in5_p;
std::vector<float> w13(2 * H * D), hidden(M * H), dh(M * H), dgu(M * 2 * H), dw13(2 * H * D);
std::copy(in1_p, in1_p + H * D, w13.data());
std::copy(in2_p, in2_p + H * D, w13.data() + H * D);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < H; j++) hidden[m * H + j] = swiglu(gu[m * 2 * H + j], gu[m * 2 * H + H + j]);
dnnl_sgemm('T', 'N', NT, H, M, 1.f, dl, NT, hidden.data(), H, 0.f, out5_p, H);
dnnl_sgemm('N', 'N', M, H, NT, 1.f, dl, NT, in3_p, H, 0.f, dh.data(), H);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < H; j++)
        swiglu_grads(gu[m * 2 * H + j], gu[m * 2 * H + H + j], dh[m * H + j], &dgu[m * 2 * H + j], &dgu[m * 2 * H + H + j]);
dnnl_sgemm('T', 'N', 2 * H, D, M, 1.f, dgu.data(), 2 * H, x, D, 0.f, dw13.data(), D);
dnnl_sgemm('N', 'N', M, D, 2 * H, 1.f, dgu.data(), 2 * H, w13.data(), D, 0.f, out0_p, D);
std::copy(dw13.data(), dw13.data() + H * D, out1_p);
std::copy(dw13.data() + H * D, dw13.data() + 2 * H * D, out3_p);
std::fill(out2_p, out2_p + H, 0.f); std::fill(out4_p, out4_p + H, 0.f); std::fill(out6_p, out6_p + NT, 0.f);
for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < H; j++) { out2_p[j] += dgu[m * 2 * H + j]; out4_p[j] += dgu[m * 2 * H + H + j]; }
    for (int64_t n = 0; n < NT; n++) out6_p[n] += dl[m * NT + n];
}
