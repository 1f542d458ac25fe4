// The layer's input side on a GPU, cpp/layer_input.cc's steps as kernels (cuda/decode_layer.cuh): x [M,D] ->
// q [M,H*hd], the keys and values [2,M,Hkv*hd] (normed per head for Qwen3, rotated; bf16 bits where KV_BITS), the
// type weights PROBS [M,NT], Gamma GAMMAS [M,1] (Sparse) and a prompt mixture's shares PROMPT_MIX [M,PROMPT_E]; the
// experts weighted by WEIGHTS [M,NW] (PROBS, or GATES given per sequence). Names and sizes:
// decode_layer.layer_input's declarations.
float *xn = scratch_floats(M * D);
norm_rows<<<M, BLOCK>>>(x, nullptr, nullptr, ATTENTION_NORM, D, eps, xn);
if (NT > 0)
    route(M, x, Router{W1, B1, W3, B3, W2, B2, GW, GB, D, NT, HIDDEN, SPARSE, LEARNED, MAX_THRESHOLD}, PROBS, GAMMAS);
if (PROMPT_E > 1)  // a mixture of prompt experts: each row's shares of them, for layer_output
    router_shares(M, PROMPT_E, D, xn, PROMPT_ROUTER_W, PROMPT_ROUTER_B, PROMPT_MIX);
experts_project<WQ_STORAGE>(M, H * hd, D, xn, WQ, LORA_Q, COL_Q < 0 ? nullptr : WEIGHTS + COL_Q, NW, out0_p);
const int64_t KV = M * Hkv * hd;
float *k = KV_BITS ? scratch_floats(2 * KV) : (float *)out1_p, *v = k + KV;
experts_project<WK_STORAGE>(M, Hkv * hd, D, xn, WK, LORA_K, COL_K < 0 ? nullptr : WEIGHTS + COL_K, NW, k);
experts_project<WV_STORAGE>(M, Hkv * hd, D, xn, WV, LORA_V, COL_V < 0 ? nullptr : WEIGHTS + COL_V, NW, v);
norm_rotate_heads<<<M * H, BLOCK>>>(out0_p, H, hd, T, Q_NORM, head_eps, COS, SIN);
norm_rotate_heads<<<M * Hkv, BLOCK>>>(k, Hkv, hd, T, K_NORM, head_eps, COS, SIN);
if (KV_BITS) {
    kv_bits<<<blocks_for(2 * KV), BLOCK>>>(k, 2 * KV, (uint16_t *)out1_p);  // k, then v
    cudaFreeAsync(k, 0);
}
cudaFreeAsync(xn, 0);
