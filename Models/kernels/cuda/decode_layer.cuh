// A decode step's MoA layer on a GPU: the kernels that cuda/layer_input.cu and cuda/layer_output.cu launch
// (Models/kernels/decode_layer.py), the CUDA form of cpp/decode_layer.h's pieces with the same numbers. A
// decode step has few rows, so its time is the base's weights read from memory: each projection is one
// pass over its matrix for all the rows (product_rows), its LoRA expert added in that pass; the bf16 KV
// cache is read in place. Every kernel runs blocks of BLOCK threads on the default stream.
#ifndef MOA_CUDA_DECODE_LAYER_CUH
#define MOA_CUDA_DECODE_LAYER_CUH
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <cuda_runtime.h>
#include "storage.h"

static const int BLOCK = 256, WARPS = BLOCK / 32;
static const int PASS_ROWS = 32;  // the most rows one product_rows pass holds; more take several passes
static const int STAGED = 8192;   // floats of x staged in shared memory per pass (32 KB): rows x chunk of K

__device__ __forceinline__ float widen(uint16_t bits) { return __uint_as_float((uint32_t)bits << 16); }
__device__ __forceinline__ float load1(float v) { return v; }
__device__ __forceinline__ float load1(uint16_t v) { return widen(v); }
// v rounded to the nearest bf16 value (ties to even), kept in fp32: the bf16 rule's input (precision.py)
__device__ __forceinline__ float round_bf16(float v) {
    const uint32_t bits = __float_as_uint(v);
    return __uint_as_float((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
}
// exp's argument capped at 80 as on the CPU (cpp/swiglu.h)
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(fminf(-v, 80.f))); }
__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }
__device__ __forceinline__ float column(const float *probs, int64_t NT, int64_t m, int64_t col) {
    return col < 0 ? 1.f : probs[m * NT + col];
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
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

// A LoRA expert's share of a projection, added where the pass writes: y[m,n] += scale w[m] (U[m] . B[n]),
// U [M,R] = x A^T computed before; w read with a stride (a column of the type weights), null: weight 1
struct Expert {
    const float *U, *B;
    int64_t R;
    const float *w;
    int64_t w_stride;
    float scale;
};
// 8 consecutive weights of a row, widened to fp32; the index is a multiple of 8 and the row 16-byte aligned
template <Storage S>
__device__ __forceinline__ void load8(const void *values, int64_t at, float *w) {
    if (S == FP32) {
        const float4 *row = (const float4 *)((const float *)values + at);
        const float4 a = row[0], b = row[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else if (S == BF16) {
        const uint4 bits = *(const uint4 *)((const uint16_t *)values + at);
        const uint32_t pairs[4] = {bits.x, bits.y, bits.z, bits.w};
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __uint_as_float(pairs[i] << 16);  // the lower address is the lower half
            w[2 * i + 1] = __uint_as_float(pairs[i] & 0xffff0000u);
        }
    } else {
        const uint2 bytes = *(const uint2 *)((const int8_t *)values + at);
        const uint32_t quads[2] = {bytes.x, bytes.y};
        for (int i = 0; i < 8; i++) w[i] = (float)(int8_t)(quads[i / 4] >> (8 * (i % 4)));
    }
}
template <Storage S>
__device__ __forceinline__ float load_one(const void *values, int64_t at) {
    if (S == FP32) return ((const float *)values)[at];
    if (S == BF16) return widen(((const uint16_t *)values)[at]);
    return (float)((const int8_t *)values)[at];
}
// y [M,N] = x [M,K] W^T + the expert's share, M <= MR (a template, so that each warp's MR sums stay in
// registers): one warp per column n, reading W's row once for every row of x. x is staged in shared memory a
// chunk of K at a time (STAGED / MR floats per row), rounded to bf16 for a bf16 or int8 W (the bf16 rule);
// an int8 row's sums are scaled by its scale.
template <int MR, Storage S>
__global__ void product_rows(int64_t M, int64_t N, int64_t K, const float *x, BaseMatrix W, Expert e, float *y) {
    __shared__ __align__(16) float xs[STAGED];
    const int64_t chunk = STAGED / MR, n = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float sums[MR];
    #pragma unroll
    for (int m = 0; m < MR; m++) sums[m] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t width = min(chunk, K - k0);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < MR * chunk; i += BLOCK) {
            const int64_t m = i / chunk, k = i % chunk;
            const float v = m < M && k < width ? x[m * K + k0 + k] : 0.f;
            xs[i] = S == FP32 ? v : round_bf16(v);
        }
        __syncthreads();
        if (n >= N) continue;
        const int64_t row = n * K + k0;
        if (K % 8 == 0) {
            for (int64_t k = 8 * lane; k < width; k += 8 * 32) {
                float w[8];
                load8<S>(W.values, row + k, w);
                #pragma unroll
                for (int m = 0; m < MR; m++) {
                    const float4 *staged = (const float4 *)(xs + m * chunk + k);
                    const float4 a = staged[0], b = staged[1];
                    sums[m] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z
                             + w[7] * b.w;
                }
            }
        } else {
            for (int64_t k = lane; k < width; k += 32) {
                const float w = load_one<S>(W.values, row + k);
                #pragma unroll
                for (int m = 0; m < MR; m++) sums[m] += w * xs[m * chunk + k];
            }
        }
    }
    if (n >= N) return;
    #pragma unroll
    for (int m = 0; m < MR; m++) {
        if (m >= M) break;
        float share = 0.f;
        if (e.U) for (int64_t r = lane; r < e.R; r += 32) share += e.U[m * e.R + r] * e.B[n * e.R + r];
        const float sum = warp_sum(sums[m]), expert = warp_sum(share);
        if (lane == 0)
            y[m * N + n] = (S == INT8 ? sum * W.scale[n] : sum)
                         + (e.U ? e.scale * (e.w ? e.w[m * e.w_stride] : 1.f) * expert : 0.f);
    }
}
template <Storage S>
static void product_pass(int64_t M, int64_t N, int64_t K, const float *x, const BaseMatrix &W, const Expert &e,
                         float *y) {
    const dim3 grid((unsigned)((N + WARPS - 1) / WARPS));
    if (M <= 1) product_rows<1, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
    else if (M <= 2) product_rows<2, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
    else if (M <= 4) product_rows<4, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
    else if (M <= 8) product_rows<8, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
    else if (M <= 16) product_rows<16, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
    else product_rows<PASS_ROWS, S><<<grid, BLOCK>>>(M, N, K, x, W, e, y);
}
// y [M,N] = x [M,K] W^T + e's share, in passes of at most PASS_ROWS rows; W's storage S is the op's constant
// (decode_layer.declare_matrix), so that an op compiles the product's kernels for one storage only
template <Storage S>
static void product(int64_t M, int64_t N, int64_t K, const float *x, const BaseMatrix &W, const Expert &e, float *y) {
    for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        const int64_t rows = M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS;
        Expert pass = e;
        if (pass.U) pass.U += m0 * e.R;
        if (pass.w) pass.w += m0 * e.w_stride;
        product_pass<S>(rows, N, K, x + m0 * K, W, pass, y + m0 * N);
    }
}
static const Expert NO_EXPERT = {nullptr, nullptr, 0, nullptr, 0, 0.f};
static unsigned blocks_for(int64_t n) { return (unsigned)std::min<int64_t>((n + BLOCK - 1) / BLOCK, 4096); }
// scratch memory for one op's launches, in stream order
static float *scratch_floats(int64_t n) {
    void *p = nullptr;
    cudaMallocAsync(&p, (size_t)std::max<int64_t>(n, 1) * sizeof(float), 0);
    return (float *)p;
}

// y [M,N] = x [M,K] W^T for an fp32 W of few rows (an expert's A, a router's matrices, the adapter's down
// projection), M <= MR: one block per column n, its threads across K (a warp per column would read such a
// short matrix one long row at a time); W's row read once for all the rows, summed across the block.
template <int MR>
__global__ void product_columns(int64_t M, int64_t N, int64_t K, const float *x, const float *W, float *y) {
    __shared__ float partial[WARPS][MR];
    const int64_t n = blockIdx.x;
    const float *w = W + n * K;
    float sums[MR];
    #pragma unroll
    for (int m = 0; m < MR; m++) sums[m] = 0.f;
    if (K % 4 == 0) {  // rows 16-byte aligned
        for (int64_t k = 4 * threadIdx.x; k < K; k += 4 * BLOCK) {
            const float4 a = *(const float4 *)(w + k);
            #pragma unroll
            for (int m = 0; m < MR; m++) {
                if (m >= M) break;
                const float4 b = *(const float4 *)(x + m * K + k);
                sums[m] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        }
    } else {
        for (int64_t k = threadIdx.x; k < K; k += BLOCK) {
            const float a = w[k];
            #pragma unroll
            for (int m = 0; m < MR; m++) {
                if (m >= M) break;
                sums[m] += a * x[m * K + k];
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MR; m++) {
        const float sum = warp_sum(sums[m]);
        if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32][m] = sum;
    }
    __syncthreads();
    if (threadIdx.x < M) {
        float total = 0.f;
        for (int w = 0; w < WARPS; w++) total += partial[w][threadIdx.x];
        y[threadIdx.x * N + n] = total;
    }
}
// the same in passes of at most PASS_ROWS rows
static void product_by_columns(int64_t M, int64_t N, int64_t K, const float *x, const float *W, float *y) {
    for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        const int64_t rows = M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS;
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        const dim3 grid((unsigned)N);
        if (rows <= 1) product_columns<1><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
        else if (rows <= 2) product_columns<2><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
        else if (rows <= 4) product_columns<4><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
        else if (rows <= 8) product_columns<8><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
        else if (rows <= 16) product_columns<16><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
        else product_columns<PASS_ROWS><<<grid, BLOCK>>>(rows, N, K, xm, W, ym);
    }
}

// cpp/lora_project.h's projection: y [M,N] = x W^T + scale w[m] (x A^T) B^T (A [R,K], B [N,R]; A null: no
// expert), W stored as S; u: scratch for x A^T [M,R]
template <Storage S>
static void lora_project(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const BaseMatrix &W,
                         const float *A, const float *Bw, const float *w, int64_t w_stride, float scale, float *y,
                         float *u) {
    if (A) product_by_columns(M, R, K, x, A, u);
    product<S>(M, N, K, x, W, A ? Expert{u, Bw, R, w, w_stride, scale} : NO_EXPERT, y);
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
// bits); scores: n floats, partial: WARPS * VALUES_PASS floats of shared memory
static const int LANE_VALUES = 8, VALUES_PASS = 32 * LANE_VALUES;
template <typename C>
__device__ void attend(const float *q, const C *k, const C *v, int64_t n, int64_t ld, int64_t hd, float scale,
                       float gain, float *out, float *scores, float *partial, float *scratch) {
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
            const float p = scores[s];
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
// and, weighted by the prompt gate and the prompt type's weight, over the prompt expert's L keys and
// values; one block per (row, head); shared: attention_shared_bytes
template <typename C>
__global__ void attention_rows(const float *q, const C *cache_k, const C *cache_v, const float *mask, int64_t T,
                               int64_t S, int64_t H, int64_t Hkv, int64_t hd, float scale, const float *prompt_k,
                               const float *prompt_v, const float *prompt_gate, int64_t L, const float *probs,
                               int64_t NT, int64_t col_prompt, float *att) {
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
                      prompt_gate[head] * column(probs, NT, m, col_prompt), out, scores, partial, scratch);
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
// y [M,D] += h (the residual) + the parallel adapter's output z [M,D] + bias under its type weight (z null:
// none), then the clamp
__global__ void layer_tail(float *y, const float *h, const float *z, const float *bias, const float *probs, int64_t NT,
                           int64_t col, int64_t n, int64_t D, bool clamp, float limit) {
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK) {
        float v = y[i] + h[i];
        if (z) v += column(probs, NT, i / D, col) * (z[i] + bias[i % D]);
        if (clamp) v = fminf(fmaxf(v, -limit), limit);
        y[i] = v;
    }
}
#endif
