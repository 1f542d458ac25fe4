// y [N,D] = x * rsqrt(mean(x^2) + eps) * w, and each row's 1 / rms [N] kept for the backward.
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *x = in0_p + r * D, *w = in1_p, inv = rms_inverse(x, D, eps);
    float *y = out0_p + r * D;
    out1_p[r] = inv;
    for (int64_t i = 0; i < D; i++) y[i] = x[i] * inv * w[i];
}
