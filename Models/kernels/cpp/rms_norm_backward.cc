// dx [N,D] from x, w, 1 / rms and d (the norm weights are frozen: no dw). BRANCH_GRADS, declared per
// call, adds the gradients of x's other readers (inputs 4..), so they need no pass of their own.
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *x = in0_p + r * D, *w = in1_p, *d = in3_p + r * D, inv = in2_p[r];
    float *dx = out0_p + r * D, dot = 0.f;
    for (int64_t i = 0; i < D; i++) dot += d[i] * w[i] * x[i];
    const float k = inv * inv * inv * dot / D;
    for (int64_t i = 0; i < D; i++) dx[i] = d[i] * w[i] * inv - x[i] * k BRANCH_GRADS;
}
