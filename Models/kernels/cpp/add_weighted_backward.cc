// inputs delta, w, g -> ddelta = g w scale, dw = scale (g . delta); dbase is g itself.
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *delta = in0_p + r * F, *g = in2_p + r * F, w = in1_p[r] * scale;
    float *ddelta = out0_p + r * F, dot = 0.f;
    for (int64_t i = 0; i < F; i++) { ddelta[i] = g[i] * w; dot += g[i] * delta[i]; }
    out1_p[r] = dot * scale;
}
