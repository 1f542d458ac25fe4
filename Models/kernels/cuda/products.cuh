// The decode step's matrix products on a GPU (cuda/decode_layer.cuh's projections, bench/rooflines.py's GPU
// product): a pass over a base matrix for all of a step's rows with its LoRA experts' share added in it
// (product_rows), products of few-row fp32 matrices (product_columns), and a projection with its experts
// (experts_project: one LoRA, or a mixture gated per row as cpp/lora_project.h's). Every kernel runs blocks of
// BLOCK threads on the default stream.
#ifndef MOA_CUDA_PRODUCTS_CUH
#define MOA_CUDA_PRODUCTS_CUH
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>
#include "storage.h"
#include "lora_experts.h"

static const int BLOCK = 256, WARPS = BLOCK / 32;
static const int PASS_ROWS = 32;  // the most rows one product_rows pass holds; more take several passes
static const int STAGED = 8192;   // floats of x staged in shared memory per pass (32 KB): rows x chunk of K

__device__ __forceinline__ float widen(uint16_t bits) { return __uint_as_float((uint32_t)bits << 16); }
// f rounded to bf16 bits, to nearest with ties to even, NaN kept NaN (cpp/bf16_bits.h's narrow)
__device__ __forceinline__ uint16_t bf16_bits(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float load1(float v) { return v; }
__device__ __forceinline__ float load1(uint16_t v) { return widen(v); }
// v rounded to the nearest bf16 value (ties to even), kept in fp32: the bf16 rule's input (precision.py)
__device__ __forceinline__ float round_bf16(float v) {
    const uint32_t bits = __float_as_uint(v);
    return __uint_as_float((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// A projection's LoRA experts' share, added where the pass writes: y[m,n] += scale w[m] (U[m] . B[n]) over the
// E experts' rank blocks, U [M,E*R] computed before (x A^T, gated for a mixture), B_e [N,R]; w read with a stride
// (a column of the type weights), null: weight 1. U null: no expert.
struct Expert {
    const float *U;
    const float *B[MAX_EXPERTS];
    int64_t E, R;
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
        if (e.U)
            for (int64_t i = lane; i < e.E * e.R; i += 32) share += e.U[m * e.E * e.R + i] * e.B[i / e.R][n * e.R + i % e.R];
        const float sum = warp_sum(sums[m]), expert = warp_sum(share);
        if (lane == 0)
            y[m * N + n] = (S == INT8 ? sum * ((const float *)W.scale)[n] : sum)
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
        if (pass.U) pass.U += m0 * e.E * e.R;
        if (pass.w) pass.w += m0 * e.w_stride;
        product_pass<S>(rows, N, K, x + m0 * K, W, pass, y + m0 * N);
    }
}
static const Expert NO_EXPERT = {};
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
// U [M,E*R] = gate[m,e] (x A_e^T) of a mixture: low [NA,M,R] = x A_a^T, its router's logits [M,E] and AdaMoLE's
// threshold logits [M] (null otherwise) to the gated rows (lora_experts.h's mixture_row), a thread per row
__global__ void gate_low_rank(LoraExperts ex, const float *low, float *logits, const float *threshold, int64_t M,
                              float *U) {
    for (int64_t m = (int64_t)blockIdx.x * BLOCK + threadIdx.x; m < M; m += (int64_t)gridDim.x * BLOCK)
        mixture_row(ex, logits + m * ex.E, threshold ? threshold[m] : 0.f, low, M, m, 1.f, U);
}
// cpp/lora_project.h's experts_project: y [M,N] = x W^T + scale w[m] sum_e gate[m,e] (x A_e^T) B_e^T (one expert:
// gate 1; none: x W^T), W stored as S
template <Storage S>
static void experts_project(int64_t M, int64_t N, int64_t K, const float *x, const BaseMatrix &W,
                            const LoraExperts &ex, const float *w, int64_t w_stride, float *y) {
    if (ex.E == 0) {
        product<S>(M, N, K, x, W, NO_EXPERT, y);
        return;
    }
    float *U = scratch_floats(M * ex.E * ex.R), *low = nullptr, *logits = nullptr, *threshold = nullptr;
    if (ex.mixing == SINGLE) {
        product_by_columns(M, ex.R, K, x, ex.A[0], U);
    } else {
        low = scratch_floats(ex.NA * M * ex.R), logits = scratch_floats(M * ex.E);
        for (int64_t a = 0; a < ex.NA; a++) product_by_columns(M, ex.R, K, x, ex.A[a], low + a * M * ex.R);
        product_by_columns(M, ex.E, K, x, ex.router_w, logits);
        if (ex.mixing == THRESHOLD) {
            threshold = scratch_floats(M);
            product_by_columns(M, 1, K, x, ex.threshold_w, threshold);
        }
        gate_low_rank<<<blocks_for(M), BLOCK>>>(ex, low, logits, threshold, M, U);
    }
    Expert e = {U, {}, ex.E, ex.R, w, w_stride, ex.scale};
    for (int64_t i = 0; i < ex.E; i++) e.B[i] = ex.B[i];
    product<S>(M, N, K, x, W, e, y);
    for (float *buffer : {U, low, logits, threshold}) if (buffer) cudaFreeAsync(buffer, 0);
}
#endif
