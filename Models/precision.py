"""The frozen base's precision: its projections as BaseLinear, bf16 storage, the bf16 matmul.

`--precision bf16` stores the frozen base's matrices (projections, embedding,
output) in bf16; adapters, routers, Gamma, norms, softmax, loss and the optimizer
stay fp32. A bf16 projection runs `base_linear`, fp32 in and out:
- a CPU with bf16 units (avx512_bf16 or amx_bf16 in /proc/cpuinfo): oneDNN's
  gemm_bf16bf16f32, the input rounded to bf16 and the products summed in fp32
  (what torch's CPU autocast does);
- any other CPU with oneDNN: the weights widened to fp32 (exact: bf16 is the top
  half of an fp32) a panel at a time and multiplied by oneDNN's sgemm, so the
  result is the fp32 product of the stored weights; decoding reads half the bytes;
- plain Jittor (a GPU, or no oneDNN): on a GPU Jittor's own half-precision matmul,
  on a CPU the weights widened to fp32.
"""
import functools

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .kernels import SGEMM_DECLARATION, Kernel, fused_kernels_on, linear
from .ModelArgs import PRECISIONS

BF16_HEADER = SGEMM_DECLARATION + """
#include <cstring>
static const int64_t PANEL = 1024;  // weight rows widened at once: 16 MB at K = 4096
#include <vector>
#include <algorithm>
extern "C" int dnnl_gemm_bf16bf16f32(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc);
static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline uint16_t narrow(float f) {  // round to nearest, ties to even (inputs are finite activations)
    uint32_t u; std::memcpy(&u, &f, 4); return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// C [M,N] = A [M,K] (fp32, rounded to bf16 here, row stride lda) times op(B) (bf16) with fp32 sums, on
// the CPU's bf16 units; false where this oneDNN cannot (it answers "unimplemented" without them).
static bool gemm_bf16_units(char transb, int64_t M, int64_t N, int64_t K, const float *a, int64_t lda,
                            const uint16_t *b, int64_t ldb, float *c, int64_t ldc) {
    std::vector<uint16_t> ab(M * lda);
    #pragma omp parallel for
    for (int64_t i = 0; i < M * lda; i++) ab[i] = narrow(a[i]);
    return dnnl_gemm_bf16bf16f32('N', transb, M, N, K, 1.f, ab.data(), lda, b, ldb, 0.f, c, ldc) == 0;
}
"""

# y [M,N] = x [M,K] w[N,K]^T. Few rows (decoding): each thread widens 64 weight rows into an
# L2-sized panel and multiplies it, so the weights cross memory once, in bf16. Many rows
# (training, prefill): widening is cheap next to the product; PANEL weight rows at a time, each
# one threaded sgemm, so the fp32 copy stays small (the 8B output matrix widened whole is 2.1 GB).
BF16_FORWARD = """
const uint16_t *w = (const uint16_t *)in1_p; const float *x = in0_p; float *y = out0_p;
const bool done = units && gemm_bf16_units('T', M, N, K, x, K, w, K, y, N);
if (!done && M >= 64) {
    std::vector<float> wf(std::min(N, PANEL) * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        #pragma omp parallel for
        for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
        dnnl_sgemm('N', 'T', M, nb, K, 1.f, x, K, wf.data(), K, 0.f, y + n0, N);
    }
} else if (!done) {
    const int64_t NB = 64;
    #pragma omp parallel
    {
        std::vector<float> panel(NB * K);
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NB) {
            const int64_t nb = std::min(NB, N - n0);
            for (int64_t i = 0; i < nb * K; i++) panel[i] = widen(w[n0 * K + i]);
            dnnl_sgemm('N', 'T', M, nb, K, 1.f, x, K, panel.data(), K, 0.f, y + n0, N);
        }
    }
}
"""

# dx [M,K] = dy [M,N] w [N,K]; the weights are frozen, so no weight gradient. Without bf16 units,
# the sum over N runs PANEL widened weight rows at a time, accumulating into dx.
BF16_BACKWARD = """
const uint16_t *w = (const uint16_t *)in1_p; const float *dy = in0_p; float *dx = out0_p;
const bool done = units && gemm_bf16_units('N', M, K, N, dy, N, w, K, dx, K);
if (!done) {
    std::vector<float> wf(std::min(N, PANEL) * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        #pragma omp parallel for
        for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
        dnnl_sgemm('N', 'N', M, K, nb, 1.f, dy + n0, N, wf.data(), K, n0 ? 1.f : 0.f, dx, K);
    }
}
"""


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_units() -> bool:
    """avx512_bf16 or amx_bf16 in this CPU's flags (Linux); False where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class BF16Linear(jt.Function):
    """x [M,K] fp32 @ w [N,K]^T bf16 -> [M,N] fp32, gradient to x only. units=None asks the CPU."""

    def __init__(self, units=None):
        self.units = cpu_has_bf16_units() if units is None else units

    def execute(self, x, weight):
        (M, K), N = x.shape, weight.shape[0]
        self.sizes = f"const int64_t M = {M}, N = {N}, K = {K}; const bool units = {str(self.units).lower()};\n"
        self.weight = weight
        return jt.code((M, N), "float32", [x, weight], cpu_header=BF16_HEADER, cpu_src=self.sizes + BF16_FORWARD)

    def grad(self, grad_out):
        M, K = grad_out.shape[0], self.weight.shape[1]
        dx = jt.code((M, K), "float32", [grad_out, self.weight], cpu_header=BF16_HEADER,
                     cpu_src=self.sizes + BF16_BACKWARD)
        return dx, None


def base_linear_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    """grad_out [M,N] @ weight [N,K] -> [M,K] fp32: the gradient a base projection passes to its input."""
    if weight.dtype == "float32" or not fused_kernels_on():
        return nn.matmul(grad_out, weight.float32())
    M, (N, K) = grad_out.shape[0], weight.shape
    sizes = f"const int64_t M = {M}, N = {N}, K = {K}; const bool units = {str(cpu_has_bf16_units()).lower()};\n"
    return jt.code((M, K), "float32", [grad_out, weight], cpu_header=BF16_HEADER, cpu_src=sizes + BF16_BACKWARD)


def fused_base_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    rows = x.shape[:-1]
    out = BF16Linear.apply(x.float32().reshape(-1, x.shape[-1]), weight)
    return out.reshape(*rows, weight.shape[0])


def plain_base_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    if weight.dtype == "float32":
        return linear(x, weight)  # the fp32 kernel pair
    if jt.flags.use_cuda:  # the GPU's half-precision matmul
        return nn.matmul_transpose(x.cast(weight.dtype), weight).float32()
    return nn.matmul_transpose(x.float32(), weight.float32())  # Jittor's CPU bf16 matmul is slow: widen


# x [..., K] fp32 @ weight [N,K]^T -> [..., N] fp32; the fused kernel serves bf16 weights
base_linear = Kernel(fused_base_linear, plain_base_linear, when=lambda x, weight: weight.dtype == "bfloat16")


class BaseLinear(nn.Module):
    """A frozen base projection without bias (Meta's wq, w1, output, ...): `weight` [out,in], fp32 or bf16."""

    def __init__(self, in_features: int, out_features: int):
        self.weight = nn.Linear(in_features, out_features, bias=False).weight

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out] fp32
        return base_linear(x, self.weight)


def set_base_precision(model, precision: str):
    """Store the frozen base's matrices in bf16 (or back in fp32); 1-D norm weights stay fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    dtype = "bfloat16" if precision == "bf16" else "float32"
    for param in model.base_parameters().values():
        if len(param.shape) == 2 and param.dtype != dtype:
            param.assign(param.cast(dtype).stop_grad())
    model.freeze_base()
