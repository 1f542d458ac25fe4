// The layer's output side on a GPU, cpp/layer_output.cc's steps as kernels (cuda/decode_layer.cuh): x [M,D]
// (the layer's input), q [M,H*hd] and the cache's keys cache_k and values cache_v [B,S,Hkv,hd] (this step written)
// -> [M,D]: attention over the cache and the prompt (a mixture's rows by PROMPT_MIX), O, the FFN, the parallel
// adapter's experts, the clamp.
// Names and sizes: decode_layer.layer_output's declarations.
float *att = scratch_floats(M * H * hd), *h = scratch_floats(M * D), *hn = scratch_floats(M * D),
      *gate = scratch_floats(M * F), *up = scratch_floats(M * F);
using CacheType = std::remove_const_t<std::remove_pointer_t<decltype(cache_k)>>;  // float, or bf16 bits
const size_t attention_shared = attention_shared_bytes(hd, S, L);
if (attention_shared > 48 * 1024)
    cudaFuncSetAttribute(attention_rows<CacheType>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)attention_shared);
attention_rows<CacheType><<<dim3((unsigned)M, (unsigned)H), BLOCK, attention_shared>>>(
    q, cache_k, cache_v, mask, T, S, H, Hkv, hd, scale, PROMPT_K, PROMPT_V, PROMPT_GATE, L, PROMPT_MIX, PROMPT_E, probs,
    NT, COL_PROMPT, att);
experts_project<WO_STORAGE>(M, D, H * hd, att, WO, LORA_O, COL_O < 0 ? nullptr : probs + COL_O, NT, h);
norm_rows<<<M, BLOCK>>>(h, x, h, FFN_NORM, D, eps, hn);  // h = O(att) + x, hn = its norm
experts_project<W1_STORAGE>(M, F, D, hn, W1, LORA_GATE, COL_GATE < 0 ? nullptr : probs + COL_GATE, NT, gate);
experts_project<W3_STORAGE>(M, F, D, hn, W3, LORA_UP, COL_UP < 0 ? nullptr : probs + COL_UP, NT, up);
swiglu_into<<<blocks_for(M * F), BLOCK>>>(gate, up, M * F);
experts_project<W2_STORAGE>(M, D, F, gate, W2, LORA_DOWN, COL_DOWN < 0 ? nullptr : probs + COL_DOWN, NT, out0_p);
float *adapter = nullptr, *z = nullptr, *shares = nullptr, *mixed = nullptr;
if (P > 0) {  // the parallel adapter's experts on the FFN's input: up(silu(down(hn) + b) + b), weighted by the type
              // weight and, in a mixture, by each row's shares softmax(router(hn))
    adapter = scratch_floats(M * P);
    z = scratch_floats(M * D);
    if (PA_E > 1) {
        shares = scratch_floats(M * PA_E);
        mixed = scratch_floats(M * D);
        router_shares(M, PA_E, D, hn, PA_ROUTER_W, PA_ROUTER_B, shares);
    }
    for (int64_t e = 0; e < PA_E; e++) {
        if (e < PA_ND) {  // one down projection (PA_ND 1) feeds every up
            product_by_columns(M, P, D, hn, PA_DOWN_W[e], adapter);
            adapter_hidden<<<blocks_for(M * P), BLOCK>>>(adapter, PA_DOWN_B[e], M * P, P);
        }
        product_by_columns(M, D, P, adapter, PA_UP_W[e], z);
        if (shares) add_adapter_share<<<blocks_for(M * D), BLOCK>>>(mixed, z, PA_UP_B[e], shares, PA_E, e, M * D, D);
    }
}
layer_tail<<<blocks_for(M * D), BLOCK>>>(out0_p, h, shares ? mixed : z, shares ? nullptr : PA_UP_B[0], probs, NT,
                                         COL_PADAPTER, M * D, D, CLAMP, CLAMP_LIMIT);
for (float *buffer : {att, h, hn, gate, up, adapter, z, shares, mixed}) if (buffer) cudaFreeAsync(buffer, 0);
