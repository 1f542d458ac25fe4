// out [M,N] = base + w[m] * scale * (u [M,R] up [N,R]^T + bias [N]): the weight is applied on the R-wide
// side, so neither pass holds the [M,N] expert output (the backward needs u, not the product).
// Declared per call: M, N, R, scale, base, u, up, w, bias (nullptr without).
std::vector<float> uw(M * R);
for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) uw[m * R + r] = u[m * R + r] * w[m] * scale;
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) out0_p[m * N + n] = base[m * N + n] + (bias ? w[m] * scale * bias[n] : 0.f);
dnnl_sgemm('N', 'T', M, N, R, 1.f, uw.data(), R, up, R, 1.f, out0_p, N);
