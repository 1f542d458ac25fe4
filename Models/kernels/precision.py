"""The frozen base's precision: its projections as BaseLinear, bf16 storage, the bf16 matmul.

`--precision bf16` stores the frozen base's matrices (projections, embedding,
output) in bf16; adapters, routers, Gamma, norms, softmax, loss and the optimizer
stay fp32. A bf16 projection runs `base_linear`, fp32 in and out, with one rule
on every machine: the input is rounded to bf16 (to nearest, ties to even) and
the products of the two bf16 operands are summed in fp32, which is what torch's
autocast and a GPU's half matmul do (the authors' bf16 mode); the backward rounds
the incoming gradient the same way. Attention's products follow the same rule in
training and prefill (Models/kernels/attention.py; a decode step's stay fp32). Only the route differs:
- a CPU with bf16 units (avx512_bf16 or amx_bf16 in /proc/cpuinfo): oneDNN's
  gemm_bf16bf16f32;
- any other CPU with oneDNN: the rounded input and the weights widened to fp32
  (exact: bf16 is the top half of an fp32) a panel at a time, through oneDNN's
  sgemm; decoding reads half the weight bytes;
- plain Jittor (a GPU, or no oneDNN): on a GPU Jittor's own half-precision matmul,
  on a CPU the same rounding and widening in Jittor ops.
Jittor's own CPU cast to bf16 truncates; `to_bf16` rounds to nearest even, and every
fp32 -> bf16 conversion of the project (set_base_precision, checkpoint loads) goes
through it.
"""
import functools

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .linear import GEMV_HEADER, SGEMM_DECLARATION, linear, linear_input_grad
from .switch import GEMV_ROWS, Kernel, fused_kernels_on

# --precision: the frozen base matrices' storage type
STORAGE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}

BF16_BITS = GEMV_HEADER + """
static inline uint16_t narrow(float f) {  // round to nearest, ties to even; NaN stays NaN
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// x rounded to bf16 as a product's operand: its bits (for the bf16 units) or their fp32 value
static inline void round_to(float x, uint16_t *dst) { *dst = narrow(x); }
static inline void round_to(float x, float *dst) { *dst = widen(narrow(x)); }
// x [n] rounded into dst [n], threaded: every whole-tensor fp32 -> bf16 pass of the project
template <typename E>
static void round_into(const float *x, int64_t n, E *dst) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) round_to(x[i], dst + i);
}
"""


def rounding_op(x: jt.Var, dtype: str) -> jt.Var:
    """x (fp32) rounded to bf16: its bits (dtype bfloat16) or their fp32 values (float32)."""
    out_type = "uint16_t" if dtype == "bfloat16" else "float"
    return jt.code(x.shape, dtype, [x.float32()], cpu_header=BF16_BITS,
                   cpu_src=f"round_into((const float *)in0_p, {x.numel()}, ({out_type} *)out0_p);\n")


def to_bf16(x: jt.Var) -> jt.Var:
    """x (fp32) as bf16, rounded to nearest even; Jittor's CPU cast truncates. A GPU's cast rounds."""
    if x.dtype == "bfloat16" or jt.flags.use_cuda:
        return x.cast("bfloat16")
    return rounding_op(x, "bfloat16")


def rounded_to_bf16(x: jt.Var) -> jt.Var:
    """x (fp32) rounded to the nearest bf16 value, kept in fp32."""
    return rounding_op(x, "float32")


def cast_to(x: jt.Var, dtype: str) -> jt.Var:
    """x as `dtype`; fp32 -> bf16 rounds to nearest even (to_bf16)."""
    if x.dtype == dtype:
        return x
    return to_bf16(x) if dtype == "bfloat16" else x.cast(dtype)


class PlainBF16Linear(jt.Function):
    """The plain reference of the bf16 matmul: x [M,K] rounded to bf16 values @ weight [N,K]^T widened,
    and backwards the gradient rounded the same way @ weight; Jittor's own (fp32) matmuls."""

    def execute(self, x, weight):
        self.weight = weight
        return nn.matmul_transpose(rounded_to_bf16(x), weight.float32())

    def grad(self, grad_out):
        return plain_bf16_input_grad(grad_out, self.weight), None


def plain_bf16_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    return nn.matmul(rounded_to_bf16(grad_out), weight.float32())


BF16_HEADER = SGEMM_DECLARATION + BF16_BITS + """
static const int64_t PANEL = 1024;  // weight rows widened at once: 16 MB at K = 4096
static const int64_t GEMV_ROWS = """ + str(GEMV_ROWS) + """;
#include <vector>
#include <memory>
#include <algorithm>
extern "C" int dnnl_gemm_bf16bf16f32(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc);
// a [n] narrowed to bf16 bits, for the bf16 units
static std::unique_ptr<uint16_t[]> narrowed(const float *a, int64_t n) {
    auto bits = scratch<uint16_t>(n);
    round_into(a, n, bits.get());
    return bits;
}
// C [M,N] = beta C + A [M,K] (fp32, rounded to bf16 here, or given as bits ab) times op(B) (bf16) with
// fp32 sums, on the CPU's bf16 units; false where this oneDNN cannot (it answers "unimplemented" without them).
static bool gemm_bf16_units(char transb, int64_t M, int64_t N, int64_t K, const float *a,
                            const uint16_t *b, int64_t ldb, float beta, float *c, const uint16_t *ab = nullptr) {
    std::unique_ptr<uint16_t[]> own;
    if (!ab) { own = narrowed(a, M * K); ab = own.get(); }
    return dnnl_gemm_bf16bf16f32('N', transb, M, N, K, 1.f, ab, K, b, ldb, beta, c, N) == 0;
}
// The same product without bf16 units: A rounded to bf16 values in fp32, for sgemm on widened panels.
static std::unique_ptr<float[]> rounded(const float *a, int64_t n) {
    auto r = scratch<float>(n);
    round_into(a, n, r.get());
    return r;
}

// y [M,N] = beta y + x [M,K] w [N,K]^T (beta 0 or 1). Few rows (decoding): the GEMV pass, widening
// each bf16 weight as it is read, so the weights cross memory once, in bf16 (oneDNN's bf16 gemm
// repacks them every call). Many rows (training, prefill): the bf16 units, else widening is cheap
// next to the product; PANEL weight rows at a time, each one threaded sgemm, so the fp32 copy stays
// small (the 8B output matrix widened whole is 2.1 GB).
// xb: x already narrowed (narrowed()) where several products read it, or null.
template <int64_t M>
static void bf16_forward(int64_t N, int64_t K, const float *x, const uint16_t *w, bool units, float beta, float *y,
                         const uint16_t *xb = nullptr) {
    if (M <= GEMV_ROWS) {
        const auto xr = rounded(x, M * K);
        std::vector<float> product(beta == 0.f ? 0 : M * N);
        gemv<M>(N, K, xr.get(), w, beta == 0.f ? y : product.data());
        if (beta != 0.f) for (int64_t i = 0; i < M * N; i++) y[i] += product[i];
    } else if (!(units && gemm_bf16_units('T', M, N, K, x, w, K, beta, y, xb))) {
        const auto xr = rounded(x, M * K);
        auto wf = scratch<float>(std::min(N, PANEL) * K);
        for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
            const int64_t nb = std::min(PANEL, N - n0);
            #pragma omp parallel for
            for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
            dnnl_sgemm('N', 'T', M, nb, K, 1.f, xr.get(), K, wf.get(), K, beta, y + n0, N);
        }
    }
}

// dx [M,K] = beta dx + dyr [M,N] w [N,K] for dy's bf16 values dyr in fp32, without bf16 units: the sum
// over N runs PANEL widened weight rows at a time into dx.
static void widened_backward(int64_t M, int64_t N, int64_t K, const float *dyr, const uint16_t *w, float beta, float *dx) {
    auto wf = scratch<float>(std::min(N, PANEL) * K);
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int64_t nb = std::min(PANEL, N - n0);
        #pragma omp parallel for
        for (int64_t i = 0; i < nb * K; i++) wf[i] = widen(w[n0 * K + i]);
        dnnl_sgemm('N', 'N', M, K, nb, 1.f, dyr + n0, N, wf.get(), K, n0 ? 1.f : beta, dx, K);
    }
}
// dx [M,K] = beta dx + dy [M,N] w [N,K] (dy rounded to bf16); the weights are frozen, so no weight gradient.
static void bf16_backward(int64_t M, int64_t N, int64_t K, const float *dy, const uint16_t *w, bool units, float beta,
                          float *dx) {
    if (units && gemm_bf16_units('N', M, K, N, dy, w, K, beta, dx)) return;
    widened_backward(M, N, K, rounded(dy, M * N).get(), w, beta, dx);
}
// The same for a dy given as bf16 bits (the loss writes its gradient so, in one pass)
static void bf16_backward_bits(int64_t M, int64_t N, int64_t K, const uint16_t *dy, const uint16_t *w, bool units,
                               float beta, float *dx) {
    if (units && dnnl_gemm_bf16bf16f32('N', 'N', M, K, N, 1.f, dy, N, w, K, beta, dx, K) == 0) return;
    auto dyr = scratch<float>(M * N);
    #pragma omp parallel for
    for (int64_t i = 0; i < M * N; i++) dyr[i] = widen(dy[i]);
    widened_backward(M, N, K, dyr.get(), w, beta, dx);
}
"""
BF16_FORWARD = "bf16_forward<M>(N, K, in0_p, (const uint16_t *)in1_p, units, 0.f, out0_p);\n"
BF16_BACKWARD = "bf16_backward(M, N, K, in0_p, (const uint16_t *)in1_p, units, 0.f, out0_p);\n"


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_units() -> bool:
    """avx512_bf16 or amx_bf16 in this CPU's flags (Linux); False where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_sizes(M: int, N: int, K: int, units: bool) -> str:
    return f"const int64_t M = {M}, N = {N}, K = {K}; const bool units = {str(units).lower()};\n"


def bf16_input_grad(grad_out: jt.Var, weight: jt.Var, units: bool) -> jt.Var:
    """rounded(grad_out) [M,N] @ weight [N,K] (bf16) -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_out.shape, weight.shape[1]
    return jt.code((M, K), "float32", [grad_out, weight], cpu_header=BF16_HEADER,
                   cpu_src=bf16_sizes(M, N, K, units) + BF16_BACKWARD)


class BF16Linear(jt.Function):
    """x [M,K] fp32 @ w [N,K]^T bf16 -> [M,N] fp32, gradient to x only. units=None asks the CPU."""

    def __init__(self, units=None):
        self.units = cpu_has_bf16_units() if units is None else units

    def execute(self, x, weight):
        (M, K), N = x.shape, weight.shape[0]
        self.weight = weight
        return jt.code((M, N), "float32", [x, weight], cpu_header=BF16_HEADER,
                       cpu_src=bf16_sizes(M, N, K, self.units) + BF16_FORWARD)

    def grad(self, grad_out):
        return bf16_input_grad(grad_out, self.weight, self.units), None


def bf16_bits_input_grad(grad_bits: jt.Var, weight: jt.Var) -> jt.Var:
    """grad_bits [M,N] (bf16, already rounded) @ weight [N,K] (bf16) -> [M,K] fp32, through the fused kernel."""
    (M, N), K = grad_bits.shape, weight.shape[1]
    return jt.code((M, K), "float32", [grad_bits, weight], cpu_header=BF16_HEADER,
                   cpu_src=bf16_sizes(M, N, K, cpu_has_bf16_units())
                   + "bf16_backward_bits(M, N, K, (const uint16_t *)in0_p, (const uint16_t *)in1_p, units, 0.f, out0_p);\n")


def base_linear_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    """grad_out [M,N] @ weight [N,K] -> [M,K] fp32: the gradient a base projection passes to its input
    (grad_out rounded to bf16 first when the weight is bf16, as base_linear's backward does)."""
    if weight.dtype == "float32":
        return linear_input_grad(grad_out, weight)
    if fused_kernels_on():
        return bf16_input_grad(grad_out, weight, cpu_has_bf16_units())
    if jt.flags.use_cuda:
        return nn.matmul(grad_out.cast(weight.dtype), weight).float32()
    return plain_bf16_input_grad(grad_out, weight)


def fused_base_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    rows = x.shape[:-1]
    out = BF16Linear.apply(x.float32().reshape(-1, x.shape[-1]), weight)
    return out.reshape(*rows, weight.shape[0])


def plain_base_linear(x: jt.Var, weight: jt.Var) -> jt.Var:
    if weight.dtype == "float32":
        return linear(x, weight)  # the fp32 kernel pair
    if jt.flags.use_cuda:  # the GPU's half-precision matmul
        return nn.matmul_transpose(x.cast(weight.dtype), weight).float32()
    rows = x.shape[:-1]  # Jittor's CPU bf16 matmul is slow: rounded and widened operands instead
    return PlainBF16Linear.apply(x.float32().reshape(-1, x.shape[-1]), weight).reshape(*rows, weight.shape[0])


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
    if precision not in STORAGE_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(STORAGE_DTYPES)}")
    dtype = STORAGE_DTYPES[precision]
    for param in model.base_parameters().values():
        if len(param.shape) == 2 and param.dtype != dtype:
            param.assign(cast_to(param, dtype).stop_grad())
    model.freeze_base()
