"""Linears through oneDNN's sgemm and, for the few rows of a decode step, one GEMV pass."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .switch import GEMV_ROWS, Kernel

SGEMM_DECLARATION = """
#include <cstdint>
#include <memory>
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
// Scratch that every element of is written before it is read: no zero fill (a vector's would be a
// single-threaded pass as long as the threaded one that fills it).
template <typename T>
static std::unique_ptr<T[]> scratch(int64_t n) { return std::unique_ptr<T[]>(new T[n]); }
// C [N,R] = G [M,N]^T U [M,R] for a narrow R (a LoRA up-projection's gradient): oneDNN's sgemm runs
// C^T = U^T G, R rows, 1.3-1.6x faster than G^T U; the same sums, so the same numbers.
static void narrow_weight_grad(int64_t M, int64_t N, int64_t R, const float *g, const float *u, float *c) {
    const auto ct = scratch<float>(R * N);
    dnnl_sgemm('T', 'N', R, N, M, 1.f, u, R, g, N, 0.f, ct.get(), N);
    for (int64_t n = 0; n < N; n++) for (int64_t r = 0; r < R; r++) c[n * R + r] = ct[r * N + n];
}
"""


# y [M,N] = x [M,K] w [N,K]^T (+ b [N]); the backward gives dx, and dw, db when the weight trains.
LINEAR_FORWARD = """
dnnl_sgemm('N', 'T', M, N, K, 1.f, in0_p, K, in1_p, K, 0.f, out0_p, N);
"""

# The same product for a few rows (decoding): one pass over the weights, a block of weight rows
# dotted with every row of x in vector registers, threads over the weight rows. sgemm's fixed cost
# per call was most of a decode step's small products; this runs at memory speed. The weights may
# be fp32 or bf16 bits (widened as read); vf16 is 16 floats, split by the compiler without AVX-512.
GEMV_HEADER = """
#include <cstdint>
#include <cstring>
static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
static inline vf16 load16(const float *p) { vf16 v; std::memcpy(&v, p, 64); return v; }
static inline vf16 load16(const uint16_t *p) {
    vh16 h; std::memcpy(&h, p, 32);
    const vu16 u = __builtin_convertvector(h, vu16) << 16;
    vf16 v; std::memcpy(&v, &u, 64); return v;
}
static inline float load1(float w) { return w; }
static inline float load1(uint16_t w) { return widen(w); }
// Y[m, n0..n0+NB) = X[m] . W[n0..n0+NB) for every m < M
template <int64_t M, int NB, typename T>
static inline void gemv_rows(int64_t N, int64_t K, const float *X, const T *W, float *Y, int64_t n0) {
    vf16 acc[M][NB] = {};
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        vf16 w[NB];
        for (int j = 0; j < NB; j++) {
            w[j] = load16(W + (n0 + j) * K + k);
            __builtin_prefetch(W + (n0 + j + 2 * NB) * K + k);  // two blocks ahead: 1.5x the bandwidth from DRAM
        }
        for (int64_t m = 0; m < M; m++) {
            const vf16 x = load16(X + m * K + k);
            for (int j = 0; j < NB; j++) acc[m][j] += x * w[j];
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < NB; j++) {
            float sum = 0.f;
            for (int i = 0; i < 16; i++) sum += acc[m][j][i];
            for (int64_t k = K16; k < K; k++) sum += X[m * K + k] * load1(W[(n0 + j) * K + k]);
            Y[m * N + n0 + j] = sum;
        }
}
// Y [M,N] = X [M,K] W [N,K]^T
template <int64_t M, typename T>
static void gemv(int64_t N, int64_t K, const float *X, const T *W, float *Y) {
    constexpr int NB = M <= 4 ? 4 : M <= 8 ? 2 : 1;  // accumulators M * NB stay in registers
    const int64_t blocks = N / NB;
    #pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t b = 0; b < blocks; b++) gemv_rows<M, NB>(N, K, X, W, Y, NB * b);
    for (int64_t n = NB * blocks; n < N; n++) gemv_rows<M, 1>(N, K, X, W, Y, n);
}
"""
ADD_BIAS = """
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) out0_p[m * N + n] += in2_p[n];
"""

LINEAR_INPUT_GRAD = """
dnnl_sgemm('N', 'N', M, K, N, 1.f, in0_p, N, W, K, 0.f, out0_p, K);
"""
LINEAR_WEIGHT_GRAD = """
dnnl_sgemm('T', 'N', N, K, M, 1.f, in0_p, N, in1_p, K, 0.f, out1_p, K);
for (int64_t n = 0; n < N; n++) out2_p[n] = 0.f;
for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) out2_p[n] += in0_p[m * N + n];
"""


class FusedLinear(jt.Function):
    """x [M,K] @ w [N,K]^T + b [N] as one oneDNN sgemm op: Jittor's own nn.Linear builds a
    broadcast-multiply-sum in Python (reshapes, broadcasts, a flag scope) at every call,
    which dominated a decode step."""

    def execute(self, x, weight, bias=None):
        (M, K), N = x.shape, weight.shape[0]
        self.trains = weight.requires_grad or (bias is not None and bias.requires_grad)  # frozen: dx only
        self.sizes = f"const int64_t M = {M}, N = {N}, K = {K};\n"
        self.saved = (x if self.trains else None, weight, bias)  # a frozen weight's dx needs no x
        self.x_shape = (M, K)
        product = "gemv<M>(N, K, in0_p, in1_p, out0_p);\n" if M <= GEMV_ROWS else LINEAR_FORWARD
        header = SGEMM_DECLARATION + (GEMV_HEADER if M <= GEMV_ROWS else "")
        if bias is None:
            return jt.code((M, N), "float32", [x, weight], cpu_header=header, cpu_src=self.sizes + product)
        return jt.code((M, N), "float32", [x, weight, bias], cpu_header=header, cpu_src=self.sizes + product + ADD_BIAS)

    def grad(self, grad_out):
        x, weight, bias = self.saved
        (M, K), N = self.x_shape, weight.shape[0]
        if not self.trains:  # a frozen weight: no [N,K] gradient buffer at all
            dx = fused_linear_input_grad(grad_out, weight)
            return (dx, None, None) if bias is not None else (dx, None)
        dx, dw, db = jt.code([(M, K), (N, K), (N,)], ["float32"] * 3, [grad_out, x, weight],
                             cpu_header=SGEMM_DECLARATION,
                             cpu_src=self.sizes + "const float *W = in2_p;\n" + LINEAR_INPUT_GRAD + LINEAR_WEIGHT_GRAD)
        return (dx, dw, db) if bias is not None else (dx, dw)


def fused_linear_input_grad(grad_out: jt.Var, weight: jt.Var) -> jt.Var:
    (M, N), K = grad_out.shape, weight.shape[1]
    return jt.code((M, K), "float32", [grad_out, weight], cpu_header=SGEMM_DECLARATION,
                   cpu_src=f"const int64_t M = {M}, N = {N}, K = {K}; const float *W = in1_p;\n" + LINEAR_INPUT_GRAD)


# grad_out [M,N] @ weight [N,K] -> [M,K], fp32: the gradient a linear passes to its input
linear_input_grad = Kernel(fused_linear_input_grad, lambda grad_out, weight: nn.matmul(grad_out, weight))


def fused_linear(x: jt.Var, weight: jt.Var, bias=None) -> jt.Var:
    rows = x.shape[:-1]
    flat = x.float32().reshape(-1, x.shape[-1])
    out = FusedLinear.apply(flat, weight) if bias is None else FusedLinear.apply(flat, weight, bias)
    return out.reshape(*rows, weight.shape[0])


def plain_linear(x: jt.Var, weight: jt.Var, bias=None) -> jt.Var:
    out = nn.matmul_transpose(x, weight)
    return out if bias is None else out + bias


# x [..., K] @ weight [N,K]^T (+ bias [N]) -> [..., N], all fp32
linear = Kernel(fused_linear, plain_linear, when=lambda x, weight, bias=None: weight.dtype == "float32")


class Linear(nn.Linear):
    """nn.Linear (same init, same `weight`/`bias` names) through the `linear` kernel."""

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out]
        return linear(x, self.weight, self.bias)


class CodeInputs:
    """A jt.code op's inputs, each declared by name in its C++ (absent ones as nullptr)."""

    def __init__(self):
        self.vars, self.code = [], ""

    def add(self, name: str, var, ctype: str = "const float *"):
        if var is None:
            self.code += f"{ctype}{name} = nullptr;\n"
        else:
            self.code += f"{ctype}{name} = (const {ctype.split()[1]} *)in{len(self.vars)}_p;\n"
            self.vars.append(var)

    def lora_expert(self, target: str, lora):
        """A_<target> and B_<target>: a single LoRA expert's matrices, or nullptr without one."""
        self.add(f"A_{target}", None if lora is None else lora.lora_A.weight)
        self.add(f"B_{target}", None if lora is None else lora.lora_B.weight)
