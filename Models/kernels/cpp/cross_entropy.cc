// nll [N] = logsumexp(logits [N,V]) - logits[target]; with GRAD an output (else nullptr), also each
// row's gradient before its loss weight, softmax - onehot [N,V], as GRAD_T: fp32, or bf16 bits for a
// bf16 output matrix (the product that reads it rounds it to bf16 anyway: written so, it is half the
// bytes and the product has no rounding pass). Declared per call: N, V, GRAD, GRAD_T.
GRAD_T *grad = (GRAD_T *)GRAD;
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *x = in0_p + r * V;
    float top = -INFINITY, total = 0.f;
    for (int64_t v = 0; v < V; v++) top = std::max(top, x[v]);
    for (int64_t v = 0; v < V; v++) total += std::exp(x[v] - top);
    const float lse = top + std::log(total);
    const int64_t target = in1_p[r];
    out0_p[r] = lse - x[target];
    if (grad) {
        GRAD_T *g = grad + r * V;
        for (int64_t v = 0; v < V; v++) store(g + v, std::exp(x[v] - lse) - (v == target ? 1.f : 0.f));
    }
}
