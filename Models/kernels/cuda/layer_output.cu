// The layer's output side on a GPU, cpp/layer_output.cc's steps as kernels (cuda/decode_layer.cuh): x [M,D]
// (the layer's input), q [M,H*hd] and the cache [B,S,Hkv,hd] (this step written) -> [M,D]: attention over the
// cache and the prompt, O, the FFN, the parallel adapter, the clamp. Names and sizes:
// decode_layer.layer_output's declarations.
float *att = scratch_floats(M * H * hd), *h = scratch_floats(M * D), *hn = scratch_floats(M * D),
      *gate = scratch_floats(M * F), *up = scratch_floats(M * F);
using CacheType = std::remove_const_t<std::remove_pointer_t<decltype(cache_k)>>;  // float, or bf16 bits
const size_t attention_shared = attention_shared_bytes(hd, S, L);
if (attention_shared > 48 * 1024)
    cudaFuncSetAttribute(attention_rows<CacheType>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)attention_shared);
attention_rows<CacheType><<<dim3((unsigned)M, (unsigned)H), BLOCK, attention_shared>>>(
    q, cache_k, cache_v, mask, T, S, H, Hkv, hd, scale, PROMPT_K, PROMPT_V, PROMPT_GATE, L, probs, NT, COL_PROMPT, att);
experts_project<WO_STORAGE>(M, D, H * hd, att, WO, LORA_O, COL_O < 0 ? nullptr : probs + COL_O, NT, h);
norm_rows<<<M, BLOCK>>>(h, x, h, FFN_NORM, D, eps, hn);  // h = O(att) + x, hn = its norm
experts_project<W1_STORAGE>(M, F, D, hn, W1, LORA_GATE, COL_GATE < 0 ? nullptr : probs + COL_GATE, NT, gate);
experts_project<W3_STORAGE>(M, F, D, hn, W3, LORA_UP, COL_UP < 0 ? nullptr : probs + COL_UP, NT, up);
swiglu_into<<<blocks_for(M * F), BLOCK>>>(gate, up, M * F);
experts_project<W2_STORAGE>(M, D, F, gate, W2, LORA_DOWN, COL_DOWN < 0 ? nullptr : probs + COL_DOWN, NT, out0_p);
float *adapter = nullptr, *z = nullptr;
if (P > 0) {  // the parallel adapter on the FFN's input: up(silu(down(hn) + b) + b), weighted
    adapter = scratch_floats(M * P);
    z = scratch_floats(M * D);
    product_by_columns(M, P, D, hn, PA_DOWN_W, adapter);
    adapter_hidden<<<blocks_for(M * P), BLOCK>>>(adapter, PA_DOWN_B, M * P, P);
    product_by_columns(M, D, P, adapter, PA_UP_W, z);
}
layer_tail<<<blocks_for(M * D), BLOCK>>>(out0_p, h, z, PA_UP_B, probs, NT, COL_PADAPTER, M * D, D, CLAMP, CLAMP_LIMIT);
for (float *buffer : {att, h, hn, gate, up, adapter, z}) if (buffer) cudaFreeAsync(buffer, 0);
