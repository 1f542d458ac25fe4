// The rows a block at a time in cache: the block's hidden rebuilt for dA (each thread sums its own part),
// and both outputs' gradients, dhidden + du A, added before they become the gate's and up's (SwiGLU's
// rule), so each [M,F] tensor crosses memory once instead of a dozen times.
// Inputs gate, up (GATE_T: fp32, or bf16 bits), A, dhidden, du; outputs dgate, dup, dA.
const GATE_T *gate = (const GATE_T *)in0_p, *up = (const GATE_T *)in1_p;
const float *A = in2_p, *grad_hidden = in3_p, *grad_u = in4_p;
const int64_t ROWS = 32, n_blocks = (M + ROWS - 1) / ROWS;
std::fill(out2_p, out2_p + R * F, 0.f);
#pragma omp parallel
{
    std::vector<float> hidden(ROWS * F), dA(R * F, 0.f);
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t m0 = b * ROWS, rows = std::min(ROWS, M - m0);
        for (int64_t i = 0; i < rows * F; i++)
            hidden[i] = swiglu(kept_value(gate[m0 * F + i]), kept_value(up[m0 * F + i]));
        dnnl_sgemm('T', 'N', R, F, rows, 1.f, grad_u + m0 * R, R, hidden.data(), F, 1.f, dA.data(), F);
        for (int64_t m = m0; m < m0 + rows; m++) {  // hidden's rows now hold dhidden + du A
            float *d = hidden.data() + (m - m0) * F;
            std::copy(grad_hidden + m * F, grad_hidden + (m + 1) * F, d);
            for (int64_t k = 0; k < R; k++) {
                const float c = grad_u[m * R + k];
                for (int64_t i = 0; i < F; i++) d[i] += c * A[k * F + i];
            }
            #pragma omp simd
            for (int64_t i = 0; i < F; i++)
                swiglu_grads(kept_value(gate[m * F + i]), kept_value(up[m * F + i]), d[i], out0_p + m * F + i,
                             out1_p + m * F + i);
        }
    }
    #pragma omp critical
    for (int64_t i = 0; i < R * F; i++) out2_p[i] += dA[i];
}
