// A decode step's MoA layer on a GPU: the kernels that cuda/layer_input.cu and cuda/layer_output.cu launch
// (Models/kernels/decode_layer.py), the CUDA form of cpp/decode_layer.h's pieces with the same numbers. A
// decode step has few rows, so its time is the base's weights read from memory: each projection is one
// pass over its matrix for all the rows, its LoRA experts added in that pass (cuda/products.cuh); the bf16
// KV cache is read in place. Every kernel runs blocks of BLOCK threads on the default stream.
#ifndef MOA_CUDA_DECODE_LAYER_CUH
#define MOA_CUDA_DECODE_LAYER_CUH
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <cuda_runtime.h>
#include "products.cuh"

// exp's argument capped at 80 as on the CPU (cpp/swiglu.h)
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(fminf(-v, 80.f))); }
__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }
__device__ __forceinline__ float column(const float *probs, int64_t NT, int64_t m, int64_t col) {
    return col < 0 ? 1.f : probs[m * NT + col];
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}
// the sum (max) of v over the block, returned to every thread; scratch: WARPS floats of shared memory
__device__ float block_sum(float v, float *scratch) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < WARPS; w++) total += scratch[w];
    __syncthreads();
    return total;
}
__device__ float block_max(float v, float *scratch) {
    v = warp_max(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float top = -INFINITY;
    for (int w = 0; w < WARPS; w++) top = fmaxf(top, scratch[w]);
    __syncthreads();
    return top;
}

// y [M,D] = RMSNorm(x + add) with the weights w, one block per row; add (the residual) and sum (where
// x + add is kept; it may be x) may be null
__global__ void norm_rows(const float *x, const float *add, float *sum, const float *w, int64_t D, float eps,
                          float *y) {
    __shared__ float scratch[WARPS];
    const int64_t row = blockIdx.x * D;
    float squares = 0.f;
    for (int64_t i = threadIdx.x; i < D; i += BLOCK) {
        const float v = x[row + i] + (add ? add[row + i] : 0.f);
        if (sum) sum[row + i] = v;
        squares += v * v;
    }
    const float inv = 1.f / sqrtf(block_sum(squares, scratch) / D + eps);
    for (int64_t i = threadIdx.x; i < D; i += BLOCK)
        y[row + i] = (sum ? sum[row + i] : x[row + i] + (add ? add[row + i] : 0.f)) * inv * w[i];
}


// The type router of a layer (routing.declare_router's names): SwiGLU (HIDDEN > 0) or Linear, then the
// sigmoid, and under Sparse Gamma (learned, or its maximum) and the selection
struct Router {
    const float *W1, *B1, *W3, *B3, *W2, *B2, *GW, *GB;
    int64_t D, NT, HIDDEN;
    bool SPARSE, LEARNED;
    float MAX_THRESHOLD;
};
// g [n] = swiglu(g + b1, u + b3), the router's hidden (HIDDEN per row)
__global__ void router_hidden(float *g, const float *b1, const float *u, const float *b3, int64_t n,
                              int64_t HIDDEN) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
        g[i] = swiglu(g[i] + b1[i % HIDDEN], u[i] + b3[i % HIDDEN]);
}
// probs [M,NT] = sigmoid(logits + B2), under Sparse 0 below Gamma; gammas [M] (Sparse) = Gamma, from the gate's
// logit gate [M] when learned
__global__ void router_tail(const float *logits, const float *gate, Router r, int64_t M, float *probs,
                            float *gammas) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < M * r.NT; i += (int64_t)gridDim.x * BLOCK) {
        const int64_t m = i / r.NT, type = i % r.NT;
        const float gamma = !r.SPARSE ? 0.f
                          : r.LEARNED ? r.MAX_THRESHOLD * sigmoid(gate[m] + r.GB[0]) : r.MAX_THRESHOLD;
        float p = sigmoid(logits[i] + r.B2[type]);
        if (r.SPARSE && p - gamma < 0.f) p = 0.f;
        probs[i] = p;
        if (r.SPARSE && type == 0) gammas[m] = gamma;
    }
}
// x [M,D] -> probs [M,NT], gammas [M] (Sparse): cpp/route_row.cc's steps, its products by product_columns
static void route(int64_t M, const float *x, const Router &r, float *probs, float *gammas) {
    float *logits = scratch_floats(M * r.NT), *gate = scratch_floats(M), *g = nullptr, *u = nullptr;
    if (r.HIDDEN > 0) {
        g = scratch_floats(M * r.HIDDEN), u = scratch_floats(M * r.HIDDEN);
        product_by_columns(M, r.HIDDEN, r.D, x, r.W1, g);
        product_by_columns(M, r.HIDDEN, r.D, x, r.W3, u);
        router_hidden<<<blocks_for(M * r.HIDDEN), BLOCK>>>(g, r.B1, u, r.B3, M * r.HIDDEN, r.HIDDEN);
        product_by_columns(M, r.NT, r.HIDDEN, g, r.W2, logits);
    } else {
        product_by_columns(M, r.NT, r.D, x, r.W2, logits);
    }
    if (r.SPARSE && r.LEARNED) product_by_columns(M, 1, r.D, x, r.GW, gate);
    router_tail<<<blocks_for(M * r.NT), BLOCK>>>(logits, gate, r, M, probs, gammas);
    for (float *buffer : {logits, gate, g, u}) if (buffer) cudaFreeAsync(buffer, 0);
}

// Each head vector of x [rows*nh, hd] RMS-normed with w (Qwen3's q_norm and k_norm; null: none), then rotated by
// RoPE at its row's position (cos, sin [T, hd/2]); one block per head vector
__global__ void norm_rotate_heads(float *x, int64_t nh, int64_t hd, int64_t T, const float *w, float eps,
                                  const float *cos, const float *sin) {
    __shared__ float scratch[WARPS];
    float *v = x + (int64_t)blockIdx.x * hd;
    const int64_t half = hd / 2, t = ((int64_t)blockIdx.x / nh) % T;
    if (w) {
        float squares = 0.f;
        for (int64_t i = threadIdx.x; i < hd; i += BLOCK) squares += v[i] * v[i];
        const float inv = 1.f / sqrtf(block_sum(squares, scratch) / hd + eps);
        for (int64_t i = threadIdx.x; i < hd; i += BLOCK) v[i] = v[i] * inv * w[i];
        __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < half; i += BLOCK) {
        const float even = v[2 * i], odd = v[2 * i + 1], c = cos[t * half + i], s = sin[t * half + i];
        v[2 * i] = even * c - odd * s;
        v[2 * i + 1] = even * s + odd * c;
    }
}

// out [hd] += gain softmax_s(q . k_s scale) v_s over n keys and values (row stride ld) of one head, by one
// block (cpp/decode_layer.h's attend): a thread per key for the scores; for the values the warps split the
// positions, each lane LANE_VALUES elements of the vector, summed over the warps at the end (a thread per
// element would read the values one position after another). C: the cache's element type (float, or bf16
// bits); scores: n floats, partial: WARPS * VALUES_PASS floats of shared memory; row_gates, per_gate: a prompt
// mixture's shares, as cpp/decode_layer.h's attend takes them
static const int LANE_VALUES = 8, VALUES_PASS = 32 * LANE_VALUES;
template <typename C>
__device__ void attend(const float *q, const C *k, const C *v, int64_t n, int64_t ld, int64_t hd, float scale,
                       float gain, float *out, float *scores, float *partial, float *scratch,
                       const float *row_gates = nullptr, int64_t per_gate = 1) {
    if (n == 0) return;
    constexpr Storage storage = std::is_same<C, float>::value ? FP32 : BF16;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int64_t s = threadIdx.x; s < n; s += BLOCK) {
        float d = 0.f;
        if (hd % 8 == 0) {  // rows 16-byte aligned
            for (int64_t i = 0; i < hd; i += 8) {
                float key[8];
                load8<storage>(k, s * ld + i, key);
                #pragma unroll
                for (int j = 0; j < 8; j++) d += q[i + j] * key[j];
            }
        } else {
            for (int64_t i = 0; i < hd; i++) d += q[i] * load1(k[s * ld + i]);
        }
        scores[s] = d * scale;
    }
    float top = -INFINITY;  // each thread reads back the scores it wrote until block_max's barrier
    for (int64_t s = threadIdx.x; s < n; s += BLOCK) top = fmaxf(top, scores[s]);
    top = block_max(top, scratch);
    float total = 0.f;
    for (int64_t s = threadIdx.x; s < n; s += BLOCK) { scores[s] = expf(scores[s] - top); total += scores[s]; }
    total = block_sum(total, scratch);
    for (int64_t i0 = 0; i0 < hd; i0 += VALUES_PASS) {
        float sums[LANE_VALUES];
        #pragma unroll
        for (int j = 0; j < LANE_VALUES; j++) sums[j] = 0.f;
        for (int64_t s = warp; s < n; s += WARPS) {
            const float p = scores[s] * (row_gates ? row_gates[s / per_gate] : 1.f);
            #pragma unroll
            for (int j = 0; j < LANE_VALUES; j++)
                if (i0 + lane + 32 * j < hd) sums[j] += p * load1(v[s * ld + i0 + lane + 32 * j]);
        }
        #pragma unroll
        for (int j = 0; j < LANE_VALUES; j++) partial[warp * VALUES_PASS + lane + 32 * j] = sums[j];
        __syncthreads();
        for (int64_t i = threadIdx.x; i < VALUES_PASS && i0 + i < hd; i += BLOCK) {
            float a = 0.f;
            for (int w = 0; w < WARPS; w++) a += partial[w * VALUES_PASS + i];
            out[i0 + i] += gain * a / total;
        }
        __syncthreads();
    }
}
// attention_rows' shared memory: q [hd], the scores [max(S, L)], the values' partial sums [WARPS, VALUES_PASS]
static size_t attention_shared_bytes(int64_t hd, int64_t S, int64_t L) {
    return (size_t)(hd + std::max(S, L) + WARPS * VALUES_PASS) * sizeof(float);
}
// att [M,H,hd]: each row's heads over its span of the cache [B,S,Hkv,hd] (the keys its mask [T,S] row allows)
// and, weighted by the prompt gate and the prompt type's weight, over the prompt experts' L keys and
// values (a mixture's rows by its shares prompt_mix [M,prompt_experts]; null: one expert); one block per
// (row, head); shared: attention_shared_bytes
template <typename C>
__global__ void attention_rows(const float *q, const C *cache_k, const C *cache_v, const float *mask, int64_t T,
                               int64_t S, int64_t H, int64_t Hkv, int64_t hd, float scale, const float *prompt_k,
                               const float *prompt_v, const float *prompt_gate, int64_t L, const float *prompt_mix,
                               int64_t prompt_experts, const float *probs, int64_t NT, int64_t col_prompt, float *att) {
    extern __shared__ float shared[];
    __shared__ float scratch[WARPS];
    float *qs = shared, *scores = shared + hd, *partial = scores + (S > L ? S : L);
    const int64_t m = blockIdx.x, head = blockIdx.y, b = m / T, t = m % T, g = head / (H / Hkv);
    float *out = att + (m * H + head) * hd;
    for (int64_t i = threadIdx.x; i < hd; i += BLOCK) { qs[i] = q[(m * H + head) * hd + i]; out[i] = 0.f; }
    float last = 0.f;
    for (int64_t s = threadIdx.x; s < S; s += BLOCK) if (mask[t * S + s] > -1e30f) last = fmaxf(last, (float)(s + 1));
    const int64_t span = (int64_t)block_max(last, scratch);
    const int64_t at = b * S * Hkv * hd + g * hd;
    attend(qs, cache_k + at, cache_v + at, span, Hkv * hd, hd, scale, 1.f, out, scores, partial, scratch);
    if (L > 0) attend(qs, prompt_k + g * hd, prompt_v + g * hd, L, Hkv * hd, hd, scale,
                      prompt_gate[head] * column(probs, NT, m, col_prompt), out, scores, partial, scratch,
                      prompt_mix ? prompt_mix + m * prompt_experts : nullptr, L / prompt_experts);
}

// keys and values [n] as bf16 bits for a bf16 cache
__global__ void kv_bits(const float *kv, int64_t n, uint16_t *bits) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
        bits[i] = bf16_bits(kv[i]);
}
__global__ void swiglu_into(float *gate, const float *up, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
        gate[i] = swiglu(gate[i], up[i]);
}
// the parallel adapter's hidden a [M,P] = silu(a + bias)
__global__ void adapter_hidden(float *a, const float *bias, int64_t n, int64_t P) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK) {
        const float v = a[i] + bias[i % P];
        a[i] = v * sigmoid(v);
    }
}
// gates [M,E] = softmax(gates + bias) per row (a prompt or adapter mixture's shares), a thread per row
__global__ void softmax_rows(float *gates, const float *bias, int64_t M, int64_t E) {
    for (int64_t m = (int64_t)blockIdx.x * BLOCK + threadIdx.x; m < M; m += (int64_t)gridDim.x * BLOCK)
        softmax_gates(gates + m * E, bias, E, gates + m * E);
}
// shares [M,E] = softmax(x [M,K] W^T + b) per row: a prompt or adapter mixture's router (cpp/decode_layer.h's
// router_shares)
static void router_shares(int64_t M, int64_t E, int64_t K, const float *x, const float *W, const float *b,
                          float *shares) {
    product_by_columns(M, E, K, x, W, shares);
    softmax_rows<<<blocks_for(M), BLOCK>>>(shares, b, M, E);
}
// a mixture of parallel adapters: mixed [M,D] (= 0 before expert 0) += shares[m,e] (z + bias), expert e's output
// z [M,D] under its share of each row, shares [M,E]
__global__ void add_adapter_share(float *mixed, const float *z, const float *bias, const float *shares, int64_t E,
                                  int64_t e, int64_t n, int64_t D) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
        mixed[i] = (e == 0 ? 0.f : mixed[i]) + shares[i / D * E + e] * (z[i] + bias[i % D]);
}
// y [M,D] += h (the residual) + the parallel adapter's output z [M,D] + bias (null: none) under its type weight
// (z null: no adapter), then the clamp
__global__ void layer_tail(float *y, const float *h, const float *z, const float *bias, const float *probs, int64_t NT,
                           int64_t col, int64_t n, int64_t D, bool clamp, float limit) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK) {
        float v = y[i] + h[i];
        if (z) v += column(probs, NT, i / D, col) * (z[i] + (bias ? bias[i % D] : 0.f));
        if (clamp) v = fminf(fmaxf(v, -limit), limit);
        y[i] = v;
    }
}
#endif
