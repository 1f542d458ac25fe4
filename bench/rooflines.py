"""The rooflines bench/eval_scale.py measures decoding against, in the same run, on a CPU or (use_cuda=1) a GPU.

- stream_bandwidth(matrices): bytes/s of a streaming read of the base's matrices where they are (a decode step
  reads each once, whatever the batch);
- product_gflops(rows, weight, scale, reps, decode): the best rate of a product under the bf16 rule at a shape,
  the better of the model's own decode product on the base's storage (on a CPU the GEMV pass or the rows kernel,
  cpp/base_matrix.h; on a GPU the decode layer's pass, cuda/products.cuh) and the vendor's bf16 gemm
  (oneDNN's gemm_bf16bf16f32; on a GPU Jittor's bf16 matmul, cuBLAS);
- units_issue_gflops(): the CPU's bf16 units' issue rate from registers (NaN on a GPU or without the units).
"""
import time

import numpy as np

import Utils.jittor_env  # noqa: F401  (the importer, eval_scale.py or a test, puts the repository on the path)
import jittor as jt
from jittor import nn

from Models.kernels import cpp
from Models.kernels.bf16 import cpu_has_bf16_units
from Models.kernels.precision import STORAGES, matrix_code, matrix_shape

BASE_MATRIX_HEADER = cpp.source("base_matrix.h")
GPU_HEADER = cpp.source("products.cuh")

STREAM = """// the XOR of a matrix's 64-byte lines, four lines a step, prefetched 1 KB ahead: a streaming read of it
// (summing its 16-bit words, or leaving the stream to the hardware prefetcher, reads markedly slower here)
const int64_t lines = in0->size / 64;  // whole groups of four are read: all of an 8B model's matrices
const char *w = (const char *)in0_p;
uint64_t folded = 0;
#pragma omp parallel reduction(^ : folded)
{
#if defined(__AVX512F__)
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < lines / 4; i++) {
        const char *p = w + i * 256;
        for (int j = 0; j < 256; j += 64) __builtin_prefetch(p + 1024 + j);
        a = _mm512_xor_si512(a, _mm512_loadu_si512(p));
        b = _mm512_xor_si512(b, _mm512_loadu_si512(p + 64));
        c = _mm512_xor_si512(c, _mm512_loadu_si512(p + 128));
        d = _mm512_xor_si512(d, _mm512_loadu_si512(p + 192));
    }
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512((__m512i *)lanes, _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
    for (int j = 0; j < 8; j++) folded ^= lanes[j];
#else
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < lines / 4 * 32; i++) folded ^= ((const uint64_t *)w)[i];
#endif
}
out0_p[0] = folded;
"""
PRODUCT_TIMES = """// best seconds of REPS products y [M,N] = x [M,K] W^T under the bf16 rule: out [0] the model's decode
// product on W's storage (cpp/base_matrix.h: the GEMV pass or the rows kernel), [1] oneDNN's
// gemm_bf16bf16f32 on W's values as bf16 (int8 and nf4 widened first)
std::vector<uint16_t> w(N * K);
if (W.storage == INT8) widen_panel((const int8_t *)W.values, N * K, w.data());
else if (W.storage == NF4) nf4_widen_rows((const uint8_t *)W.values, (const uint16_t *)W.scale, K, 0, N, w.data());
else std::memcpy(w.data(), W.values, N * K * 2);
std::vector<float> y(M * N);
const auto xb = narrowed(x, M * K);
auto best = [&](int which) {
    double fastest = 1e30;
    for (int r = 0; r < REPS; r++) {
        const auto t0 = std::chrono::steady_clock::now();
        if (which == 0) base_product(M, N, K, x, W, 0.f, y.data(), nullptr, DECODE);
        else dnnl_gemm_bf16bf16f32('N', 'T', M, N, K, 1.f, xb.get(), K, w.data(), K, 0.f, y.data(), N);
        fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return fastest;
};
out0_p[0] = DECODE ? best(0) : 1e30;
out0_p[1] = best(1);
"""
UNITS_STEPS = 20000000  # steps of UNITS_ISSUE on each thread
UNITS_ISSUE = """// seconds of STEPS steps of 16 independent bf16 dot products (_mm512_dpbf16_ps) on every thread, from
// registers only: the most bf16 FLOP/s this CPU's units issue, out [0] = seconds, [1] = threads
int threads = 1;
const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
{
    #pragma omp single
    threads = omp_get_num_threads();
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
    for (int64_t i = 0; i < STEPS; i++) {
        for (int j = 0; j < 16; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
        asm volatile("" : "+v"(a));  // a new operand each step: the loop cannot be folded away
    }
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += _mm512_reduce_add_ps(acc[j]);
    if (s == 0.5f) threads = -1;  // never true; keeps the sums
}
out0_p[0] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
out0_p[1] = threads;
"""


GPU_STREAM_HEADER = """// the XOR of a matrix's 16-byte words, grid-strided: a streaming read of it on the GPU
__global__ void fold_words(const uint4 *w, int64_t n, unsigned long long *out) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = w[i];
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    const unsigned long long folded = ((unsigned long long)(acc.x ^ acc.z) << 32) | (acc.y ^ acc.w);
    if (folded) atomicXor(out, folded);
}
"""
GPU_STREAM = """cudaMemsetAsync(out0_p, 0, sizeof(unsigned long long), 0);
fold_words<<<1024, 512>>>((const uint4 *)in0_p, in0->size / 16, (unsigned long long *)out0_p);
"""
GPU_PRODUCT_TIMES = """// best seconds of REPS products y [M,N] = x [M,K] W^T by the decode layer's pass
// (cuda/products.cuh), each timed by CUDA events: out [0]; out [1] is left to Jittor's bf16 matmul, timed in
// Python
float *y = scratch_floats(M * N);
cudaEvent_t start, stop;
cudaEventCreate(&start);
cudaEventCreate(&stop);
double times[2] = {1e30, 1e30};
for (int r = 0; DECODE && r < REPS; r++) {
    cudaEventRecord(start, 0);
    product<W_STORAGE>(M, N, K, x, W, NO_EXPERT, y);
    cudaEventRecord(stop, 0);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    times[0] = std::min(times[0], ms / 1e3);
}
cudaMemcpy(out0_p, times, sizeof times, cudaMemcpyHostToDevice);
cudaEventDestroy(start);
cudaEventDestroy(stop);
cudaFreeAsync(y, 0);
"""


def units_issue_gflops(runs: int = 3) -> float:
    """The bf16 units' issue rate (GFLOP/s) on every core, best of `runs`: no product of any shape can run
    faster on this CPU. NaN without the units (avx512_bf16), and on a GPU."""
    if jt.flags.use_cuda or not cpu_has_bf16_units():
        return float("nan")
    best = 0.0
    for _ in range(runs):
        seconds, threads = jt.code((2,), "float64", [], cpu_header="#include <immintrin.h>\n#include <chrono>\n"
                                   "#include <omp.h>\n",
                                   cpu_src=f"const int64_t STEPS = {UNITS_STEPS};\n" + UNITS_ISSUE).numpy()
        best = max(best, threads * UNITS_STEPS * 16 * 64 / seconds / 1e9)  # 64 FLOP a step: 16 lanes x 2 pairs x 2
    return best


def stream_bandwidth(matrices: list, runs: int = 3) -> float:
    """Bytes per second of a streaming read of these matrices (in memory, or the GPU's), best of `runs`."""
    total = sum(m.nbytes for m in matrices)
    best = float("inf")
    for _ in range(runs):
        jt.sync_all(True)
        start = time.perf_counter()
        jt.sync([jt.code((1,), "uint64", [m], cpu_header="#include <immintrin.h>\n", cpu_src=STREAM,
                         cuda_header=GPU_STREAM_HEADER, cuda_src=GPU_STREAM) for m in matrices])
        jt.sync_all(True)  # True: the GPU's work too
        best = min(best, time.perf_counter() - start)
    return total / best


def product_gflops(rows: int, weight: jt.Var, scale, reps: int, decode: bool) -> float:
    """The best rate (GFLOP/s) of a product of `rows` fp32 rows with the base matrix `weight` [N,K] (bf16, or
    int8 or nf4 with its scales `scale`) under the bf16 rule: the better of the model's decode product (when
    `decode`) and the vendor's bf16 gemm."""
    N, K = matrix_shape(weight)
    inputs = cpp.CodeInputs()
    x = jt.array(np.random.default_rng(0).standard_normal((rows, K)).astype(np.float32))
    inputs.add("x", x)
    inputs.code += f"const BaseMatrix W = {matrix_code(inputs, weight, scale)};\n"
    sizes = (f"const int64_t M = {rows}, N = {N}, K = {K}; const int REPS = {reps};\n"
             f"const bool DECODE = {str(decode).lower()};\n")
    seconds = jt.code((2,), "float64", inputs.vars,
                      cpu_header=inputs.header(BASE_MATRIX_HEADER) + "#include <chrono>\n",
                      cpu_src=inputs.code + sizes + PRODUCT_TIMES, cuda_header=GPU_HEADER,
                      cuda_src=inputs.code + sizes + f"constexpr Storage W_STORAGE = {STORAGES[str(weight.dtype)]};\n"
                      + GPU_PRODUCT_TIMES).numpy()
    if jt.flags.use_cuda:
        seconds[1] = gpu_gemm_seconds(x, weight, reps)
    return 2 * rows * N * K / float(seconds.min()) / 1e9


def gpu_gemm_seconds(x: jt.Var, weight: jt.Var, reps: int) -> float:
    """Seconds of one of Jittor's bf16 matmuls (cuBLAS) x [M,K] W^T on the GPU, the best of three graphs of `reps`
    (an int8 W's values are exact in bf16; its scale, one multiply per output, is left out)."""
    xb, wb = x.cast("bfloat16"), weight.cast("bfloat16")
    best = float("inf")
    for _ in range(3):
        jt.sync_all(True)
        start = time.perf_counter()
        jt.sync([nn.matmul_transpose(xb, wb) for _ in range(reps)])
        jt.sync_all(True)
        best = min(best, (time.perf_counter() - start) / reps)
    return best
