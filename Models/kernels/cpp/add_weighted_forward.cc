// out [N,F] = base + delta * w[r] * scale: an expert's output added under its router weight w [N].
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *base = in0_p + r * F, *delta = in1_p + r * F, w = in2_p[r] * scale;
    float *out = out0_p + r * F;
    for (int64_t i = 0; i < F; i++) out[i] = base[i] + delta[i] * w;
}
