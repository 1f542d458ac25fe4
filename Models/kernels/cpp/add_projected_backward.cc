// du = (g up) w scale; dup = g^T (u w scale); dw = scale (g up . u + g . bias). Declared per call: M, N,
// R, scale, u, up, w, g, bias.
std::vector<float> gu(M * R), uw(M * R);
dnnl_sgemm('N', 'N', M, R, N, 1.f, g, N, up, R, 0.f, gu.data(), R);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) {
    const float ws = w[m] * scale;
    float dot = 0.f;
    for (int64_t r = 0; r < R; r++) {
        dot += gu[m * R + r] * u[m * R + r];
        uw[m * R + r] = u[m * R + r] * ws;
        out0_p[m * R + r] = gu[m * R + r] * ws;
    }
    if (bias) for (int64_t n = 0; n < N; n++) dot += g[m * N + n] * bias[n];
    out2_p[m] = dot * scale;
}
narrow_weight_grad(M, N, R, g, uw.data(), out1_p);
