"""A frozen base projection and its single LoRA expert as one op: y = base(x) + w * scale * (x A^T) B^T.

Decoding (no gradient, a few rows): one GEMV pass over the base's weights and the expert's, per
projection (lora_project). Training: the projections that read one input (Q, K and V; the FFN's
gate and up) are one op forward and one backward (lora_projections): each expert's output is
written first and the base's product adds onto it (beta 1), and backward every projection's share
of dx, the experts' and the bases', accumulates into one dx. No expert output, no per-projection
dx and no gradient addition exists as a tensor, and a projection without an expert is just its
base product. Both keep the bf16 rule of Models/kernels/precision.py for bf16 base weights.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt

from .experts import add_projected
from .linear import linear
from .precision import BF16_HEADER, base_linear, cpu_has_bf16_units
from .switch import GEMV_ROWS, Kernel

# y [M,N] = base(x) + w[m] * scale * (x A^T) B^T: the base's weights fp32 or bf16 (x rounded for them
# as base_linear does), the expert's fp32 (none when A is null); inference only. u = x A^T [M,R] is
# tiny. w is read with a stride (a column of the type weights), or null (weight 1).
LORA_PROJECT_HEADER = BF16_HEADER + """
template <int64_t M>
static void lora_project(int64_t N, int64_t K, int64_t R, const float *x, const void *base, bool base_bf16,
                         const float *A, const float *Bw, const float *w, int64_t w_stride, float scale, float *y) {
    if (base_bf16) gemv<M>(N, K, rounded(x, M * K).get(), (const uint16_t *)base, y);
    else gemv<M>(N, K, x, (const float *)base, y);
    if (!A) return;
    std::vector<float> u(M * R);
    gemv<M>(R, K, x, A, u.data());
    for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) u[m * R + r] *= scale * (w ? w[m * w_stride] : 1.f);
    #pragma omp parallel for if (N * R >= 32768)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.f;
            for (int64_t r = 0; r < R; r++) sum += u[m * R + r] * Bw[n * R + r];
            y[m * N + n] += sum;
        }
}
"""
LORA_PROJECTION = "lora_project<M>(N, K, R, in0_p, in1_p, BASE_BF16, in2_p, in3_p, WEIGHT, 1, scale, out0_p);\n"

# The training op's two halves, per projection. Forward: y = base(x) (+ the expert), u = x A^T kept.
# Backward: dx = beta dx + g W (+ du A) with du = (g B) w scale, dA = du^T x, dB = g^T (u w scale),
# dw = scale (g B . u).
PROJECTIONS_HEADER = LORA_PROJECT_HEADER + """
// xb: x narrowed to bf16 once for all the op's base products (bf16 units), or null
template <int64_t M>
static void base_forward(int64_t N, int64_t K, const float *x, const uint16_t *xb, const void *W, bool bf16, bool units,
                         float beta, float *y) {
    if (bf16) bf16_forward<M>(N, K, x, (const uint16_t *)W, units, beta, y, xb);
    else dnnl_sgemm('N', 'T', M, N, K, 1.f, x, K, (const float *)W, K, beta, y, N);
}
template <int64_t M>
static void project_forward(int64_t N, int64_t K, int64_t R, const float *x, const uint16_t *xb, const void *W, bool bf16,
                            bool units, const float *A, const float *Bw, const float *w, float scale, float *y, float *u) {
    if (!A) { base_forward<M>(N, K, x, xb, W, bf16, units, 0.f, y); return; }
    std::vector<float> uw(M * R);
    dnnl_sgemm('N', 'T', M, R, K, 1.f, x, K, A, K, 0.f, u, R);
    for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) uw[m * R + r] = u[m * R + r] * scale * (w ? w[m] : 1.f);
    dnnl_sgemm('N', 'T', M, N, R, 1.f, uw.data(), R, Bw, R, 0.f, y, N);
    base_forward<M>(N, K, x, xb, W, bf16, units, 1.f, y);
}
static void project_backward(int64_t M, int64_t N, int64_t K, int64_t R, const float *x, const void *W, bool bf16,
                             bool units, const float *A, const float *Bw, const float *w, float scale, const float *u,
                             const float *g, float beta, float *dx, float *dA, float *dB, float *dw) {
    if (A) {
        std::vector<float> gu(M * R), du(M * R), uw(M * R);
        dnnl_sgemm('N', 'N', M, R, N, 1.f, g, N, Bw, R, 0.f, gu.data(), R);
        for (int64_t m = 0; m < M; m++) {
            const float ws = scale * (w ? w[m] : 1.f);
            float dot = 0.f;
            for (int64_t r = 0; r < R; r++) {
                dot += gu[m * R + r] * u[m * R + r];
                du[m * R + r] = gu[m * R + r] * ws;
                uw[m * R + r] = u[m * R + r] * ws;
            }
            if (dw) dw[m] = dot * scale;
        }
        narrow_weight_grad(M, N, R, g, uw.data(), dB);
        dnnl_sgemm('T', 'N', R, K, M, 1.f, du.data(), R, x, K, 0.f, dA, K);
        dnnl_sgemm('N', 'N', M, K, R, 1.f, du.data(), R, A, K, beta, dx, K);
        beta = 1.f;
    }
    if (bf16) bf16_backward(M, N, K, g, (const uint16_t *)W, units, beta, dx);
    else dnnl_sgemm('N', 'N', M, K, N, 1.f, g, N, (const float *)W, K, beta, dx, K);
}
"""


NARROW_ONCE = """
std::unique_ptr<uint16_t[]> x_bits;
if (BF16 && units && M > GEMV_ROWS) x_bits = narrowed(in0_p, M * K);
const uint16_t *xb = x_bits.get();
"""


class LoRAProjections(jt.Function):
    """Projections of one x [M,K]: y_i = base_i(x) + w_i * scale_i * (x A_i^T) B_i^T for those with an
    expert, base_i(x) for the others; one op forward (keeping x and each u_i = x A_i^T) and one
    backward (dx whole; dA_i, dB_i, dw_i). `layout`: per projection (has_expert, weighted, scale)."""

    def execute(self, layout, x, *flat):
        n = len(layout)
        bases, rest = flat[:n], list(flat[n:])
        experts = []  # per projection: (A, B, w) or None
        for has_expert, weighted, _ in layout:
            experts.append((rest.pop(0), rest.pop(0), rest.pop(0) if weighted else None) if has_expert else None)
        M, K = x.shape
        self.saved = (x, bases, experts, layout)
        inputs = [x] + list(bases) + [t for e in experts if e for t in e if t is not None]
        shapes = [(M, b.shape[0]) for b in bases] + [(M, e[0].shape[0]) for e in experts if e]
        self.sizes = (f"const int64_t M = {M}, K = {K}; const bool BF16 = {str(bases[0].dtype == 'bfloat16').lower()}, "
                      f"units = {str(cpu_has_bf16_units()).lower()};\n")
        code, index, u_out = NARROW_ONCE, 1 + n, n
        for i, (base, expert, (_, weighted, scale)) in enumerate(zip(bases, experts, layout)):
            if expert is None:
                code += f"project_forward<M>({base.shape[0]}, K, 0, in0_p, xb, in{1 + i}_p, BF16, units, nullptr, nullptr, nullptr, 0.f, out{i}_p, nullptr);\n"
                continue
            w = f"in{index + 2}_p" if weighted else "nullptr"
            code += (f"project_forward<M>({base.shape[0]}, K, {expert[0].shape[0]}, in0_p, xb, in{1 + i}_p, BF16, units, "
                     f"in{index}_p, in{index + 1}_p, {w}, {float(scale)!r}f, out{i}_p, out{u_out}_p);\n")
            index += 3 if weighted else 2
            u_out += 1
        outputs = jt.code(shapes, ["float32"] * len(shapes), inputs, cpu_header=PROJECTIONS_HEADER, cpu_src=self.sizes + code)
        self.us = [u.detach() for u in outputs[n:]]
        return tuple(outputs[:n]) if n > 1 else outputs[0]

    def grad(self, *grads):
        x, bases, experts, layout = self.saved
        M, K = x.shape
        grads = [g if g is not None else jt.zeros((M, b.shape[0]), "float32") for g, b in zip(grads, bases)]
        expert_inputs = [t for e in experts if e for t in e if t is not None]
        inputs = [x] + list(bases) + expert_inputs + self.us + grads
        shapes, code = [x.shape], ""
        index, u_in, g_in = 1 + len(bases), 1 + len(bases) + len(expert_inputs), 1 + len(bases) + len(expert_inputs) + len(self.us)
        for i, (base, expert, (_, weighted, scale)) in enumerate(zip(bases, experts, layout)):
            beta = "0.f" if i == 0 else "1.f"
            if expert is None:
                code += (f"project_backward(M, {base.shape[0]}, K, 0, in0_p, in{1 + i}_p, BF16, units, nullptr, nullptr, nullptr, "
                         f"0.f, nullptr, in{g_in + i}_p, {beta}, out0_p, nullptr, nullptr, nullptr);\n")
                continue
            A, B, w = expert
            first = len(shapes)
            shapes += [A.shape, B.shape] + ([w.shape] if weighted else [])
            code += (f"project_backward(M, {base.shape[0]}, K, {A.shape[0]}, in0_p, in{1 + i}_p, BF16, units, in{index}_p, "
                     f"in{index + 1}_p, {f'in{index + 2}_p' if weighted else 'nullptr'}, {float(scale)!r}f, in{u_in}_p, "
                     f"in{g_in + i}_p, {beta}, out0_p, out{first}_p, out{first + 1}_p, "
                     f"{f'out{first + 2}_p' if weighted else 'nullptr'});\n")
            index += 3 if weighted else 2
            u_in += 1
        outputs = list(jt.code(shapes, ["float32"] * len(shapes), inputs, cpu_header=PROJECTIONS_HEADER,
                               cpu_src=self.sizes + code))
        result = [None, outputs.pop(0)] + [None] * len(bases)
        for expert, (_, weighted, _) in zip(experts, layout):
            if expert is not None:
                result += [outputs.pop(0), outputs.pop(0)] + ([outputs.pop(0)] if weighted else [])
        return tuple(result)


def decode_lora_projection(x, base_weight, A, B, weight, scale):
    (N, K), R = base_weight.shape, A.shape[0]
    sizes = (f"const int64_t M = {x.shape[0]}, N = {N}, K = {K}, R = {R}; const float scale = {float(scale)!r}f;\n"
             f"const bool BASE_BF16 = {str(base_weight.dtype == 'bfloat16').lower()};\n"
             f"#define WEIGHT {'in4_p' if weight is not None else 'nullptr'}\n")
    inputs = [x, base_weight, A, B] + ([weight] if weight is not None else [])
    return jt.code((x.shape[0], N), "float32", inputs, cpu_header=LORA_PROJECT_HEADER, cpu_src=sizes + LORA_PROJECTION)


def fused_lora_projections(x, projections):
    rows, K = x.shape[:-1], x.shape[-1]
    flat = x.float32().reshape(-1, K)
    if jt.flags.no_grad and flat.shape[0] <= GEMV_ROWS:  # a decode step: GEMV passes
        outputs = [base_linear(flat, W) if A is None else decode_lora_projection(
                       flat, W, A, B, None if w is None else w.float32().reshape(-1), scale)
                   for W, A, B, w, scale in projections]
    else:
        tensors, layout = [], []
        for W, A, B, w, scale in projections:
            layout.append((A is not None, w is not None, scale))
            if A is not None:
                tensors += [A, B] + ([w.float32().reshape(-1)] if w is not None else [])
        outputs = LoRAProjections.apply(tuple(layout), flat, *[p[0] for p in projections], *tensors)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [y.reshape(*rows, y.shape[-1]) for y in outputs]


def plain_lora_projections(x, projections):
    outputs = []
    for W, A, B, w, scale in projections:
        if A is None:
            outputs.append(base_linear(x, W))
        elif w is None:
            outputs.append(base_linear(x, W) + linear(linear(x, A), B) * scale)
        else:
            outputs.append(add_projected.plain(base_linear(x, W), linear(x, A), B, None, w, scale))
    return outputs


# x [..., K] through frozen base weights W [N,K] (fp32 or bf16), each with a single LoRA expert
# A [R,K], B [N,R] under its route weight w [...] (or None), times scale, or with none (A None):
# projections = [(W, A, B, w, scale), ...] -> [[..., N], ...]
lora_projections = Kernel(fused_lora_projections, plain_lora_projections)

