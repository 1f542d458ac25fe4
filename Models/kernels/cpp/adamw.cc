// S parameters updated in one op: params, grads, ms, vs, params_out, ms_out, vs_out and sizes are arrays of
// S entries, and in0_p the per-parameter numbers [S,HYPER], all declared per call.
#pragma omp parallel
for (int64_t s = 0; s < S; s++) {
    const float *h = in0_p + s * HYPER;
    #pragma omp for simd schedule(static)
    for (int64_t i = 0; i < sizes[s]; i++)
        adamw_element(h, params[s][i], grads[s][i], ms[s][i], vs[s][i], params_out[s] + i, ms_out[s] + i, vs_out[s] + i);
}
