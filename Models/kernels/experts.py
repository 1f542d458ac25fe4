"""The experts' fused CPU kernels: adding an expert's output under its router weight.

An expert's output is added to the projection it sits beside, times its type weight
[B,T]. A mixture adds a ready [B,T,N] delta (add_weighted); a single expert adds its
last projection fused with the weight (add_projected), so only its narrow input is
kept for the backward; the FFN's down-projection LoRA reads the SwiGLU hidden
through gated_projection, which recomputes that [B,T,F] hidden in the backward
instead of keeping it. A base projection and its LoRA expert as one op is Models/kernels/projections.py.
Each is a switch.Kernel beside its plain-Jittor reference.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .elementwise import SWIGLU_FORWARD, SWIGLU_HEADER, silu_gate
from .linear import SGEMM_DECLARATION, linear
from .switch import Kernel

ADD_WEIGHTED_FORWARD = """
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *base = in0_p + r * F, *delta = in1_p + r * F, w = in2_p[r] * scale;
    float *out = out0_p + r * F;
    for (int64_t i = 0; i < F; i++) out[i] = base[i] + delta[i] * w;
}
"""

ADD_WEIGHTED_BACKWARD = """
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *delta = in0_p + r * F, *g = in2_p + r * F, w = in1_p[r] * scale;
    float *ddelta = out0_p + r * F, dot = 0.f;
    for (int64_t i = 0; i < F; i++) { ddelta[i] = g[i] * w; dot += g[i] * delta[i]; }
    out1_p[r] = dot * scale;
}
"""


class AddWeighted(jt.Function):
    """base + delta * weight[..., None] * scale: an expert's output added under its router weight."""

    def execute(self, base, delta, weight, scale):
        F = base.shape[-1]
        self.sizes = f"const int64_t N = {base.numel() // F}, F = {F}; const float scale = {float(scale)!r}f;\n"
        self.saved = (delta, weight)
        return jt.code(base.shape, "float32", [base, delta, weight], cpu_src=self.sizes + ADD_WEIGHTED_FORWARD)

    def grad(self, grad_out):
        delta, weight = self.saved
        ddelta, dweight = jt.code([delta.shape, weight.shape], ["float32", "float32"], [delta, weight, grad_out],
                                  cpu_src=self.sizes + ADD_WEIGHTED_BACKWARD)
        return grad_out, ddelta, dweight, None


# base [..., F] + delta [..., F] * weight [...] * scale, all fp32 (a mixture of experts' output)
add_weighted = Kernel(
    lambda base, delta, weight, scale: AddWeighted.apply(base.float32(), delta.float32(), weight.float32(), scale),
    lambda base, delta, weight, scale: base + delta * scale * weight.unsqueeze(-1))


# out [M,N] = base + w[m] * scale * (u [M,R] up [N,R]^T + bias [N]): the weight is applied on the R-wide
# side, so neither pass holds the [M,N] expert output (the backward needs u, not the product).
ADD_PROJECTED_FORWARD = """
std::vector<float> uw(M * R);
for (int64_t m = 0; m < M; m++) for (int64_t r = 0; r < R; r++) uw[m * R + r] = u[m * R + r] * w[m] * scale;
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) out0_p[m * N + n] = base[m * N + n] + (bias ? w[m] * scale * bias[n] : 0.f);
dnnl_sgemm('N', 'T', M, N, R, 1.f, uw.data(), R, up, R, 1.f, out0_p, N);
"""

# du = (g up) w scale; dup = g^T (u w scale); dw = scale (g up . u + g . bias); dbias = g^T w scale
ADD_PROJECTED_BACKWARD = """
std::vector<float> gu(M * R), uw(M * R);
dnnl_sgemm('N', 'N', M, R, N, 1.f, g, N, up, R, 0.f, gu.data(), R);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) {
    const float ws = w[m] * scale;
    float dot = 0.f;
    for (int64_t r = 0; r < R; r++) {
        dot += gu[m * R + r] * u[m * R + r];
        uw[m * R + r] = u[m * R + r] * ws;
        out0_p[m * R + r] = gu[m * R + r] * ws;
    }
    if (bias) for (int64_t n = 0; n < N; n++) dot += g[m * N + n] * bias[n];
    out2_p[m] = dot * scale;
}
narrow_weight_grad(M, N, R, g, uw.data(), out1_p);
"""
ADD_PROJECTED_BIAS_GRAD = """
std::vector<float> ws(M);
for (int64_t m = 0; m < M; m++) ws[m] = w[m] * scale;
dnnl_sgemm('T', 'N', N, 1, M, 1.f, g, N, ws.data(), 1, 0.f, out3_p, 1);
"""


class AddProjected(jt.Function):
    """base + w * scale * (u up^T + bias): a single expert's last projection and its router weight,
    fused. Only u and w are kept for the backward: [M,R] instead of the [M,N] expert output."""

    def execute(self, base, u, up, weight, scale, bias=None):
        N, R = up.shape
        M = base.numel() // N
        self.sizes = (f"const int64_t M = {M}, N = {N}, R = {R}; const float scale = {float(scale)!r}f;\n"
                      f"const float *bias = {'in4_p' if bias is not None else 'nullptr'};\n")
        self.saved = (u, up, weight, bias)
        inputs = [base, u, up, weight] + ([bias] if bias is not None else [])
        return jt.code(base.shape, "float32", inputs, cpu_header=SGEMM_DECLARATION + "#include <vector>\n",
                       cpu_src=self.sizes + "const float *base = in0_p, *u = in1_p, *up = in2_p, *w = in3_p;\n"
                       + ADD_PROJECTED_FORWARD)

    def grad(self, grad_out):
        u, up, weight, bias = self.saved
        has_bias = bias is not None
        outputs = [u.shape, up.shape, weight.shape] + ([bias.shape] if has_bias else [])
        inputs = [u, up, weight, grad_out] + ([bias] if has_bias else [])
        grads = jt.code(outputs, ["float32"] * len(outputs), inputs,
                        cpu_header=SGEMM_DECLARATION + "#include <vector>\n",
                        cpu_src=self.sizes + "const float *u = in0_p, *up = in1_p, *w = in2_p, *g = in3_p;\n"
                        + ADD_PROJECTED_BACKWARD + (ADD_PROJECTED_BIAS_GRAD if has_bias else ""))
        du, dup, dw = grads[:3]
        return (grad_out, du, dup, dw, None) + ((grads[3],) if has_bias else ())


def fused_add_projected(base, u, up, bias, weight, scale):
    args = (base.float32(), u.float32(), up, weight.float32(), scale)
    return AddProjected.apply(*args) if bias is None else AddProjected.apply(*args, bias)


def plain_add_projected(base, u, up, bias, weight, scale):
    projected = nn.matmul_transpose(u, up) if bias is None else nn.matmul_transpose(u, up) + bias
    return base + projected * scale * weight.unsqueeze(-1)


# base [..., N] + weight [...] * scale * (u [..., R] up [N,R]^T + bias [N]), all fp32
add_projected = Kernel(fused_add_projected, plain_add_projected)


# hidden [M,F] = silu(gate) * up and u [M,R] = hidden A [R,F]^T in one op that keeps only gate and up
# (the SwiGLU keeps them anyway). The backward goes through the rows a block at a time in cache:
# it rebuilds the block's hidden for dA (each thread sums its own part), and adds both outputs'
# gradients, dhidden + du A, before turning them into the gate's and up's (SwiGLU's rule), so each
# [M,F] tensor crosses memory once instead of a dozen times.
GATED_HEADER = SGEMM_DECLARATION + SWIGLU_HEADER + "#include <vector>\n#include <algorithm>\n"
GATED_FORWARD = """
{ const int64_t N = M * F; """ + SWIGLU_FORWARD + """ }
dnnl_sgemm('N', 'T', M, R, F, 1.f, out0_p, F, in2_p, F, 0.f, out1_p, R);
"""
GATED_BACKWARD = """
const float *gate = in0_p, *up = in1_p, *A = in2_p, *grad_hidden = in3_p, *grad_u = in4_p;
const int64_t ROWS = 32, n_blocks = (M + ROWS - 1) / ROWS;
std::fill(out2_p, out2_p + R * F, 0.f);
#pragma omp parallel
{
    std::vector<float> hidden(ROWS * F), dA(R * F, 0.f);
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t m0 = b * ROWS, rows = std::min(ROWS, M - m0);
        for (int64_t i = 0; i < rows * F; i++) hidden[i] = swiglu(gate[m0 * F + i], up[m0 * F + i]);
        dnnl_sgemm('T', 'N', R, F, rows, 1.f, grad_u + m0 * R, R, hidden.data(), F, 1.f, dA.data(), F);
        for (int64_t m = m0; m < m0 + rows; m++) {  // hidden's rows now hold dhidden + du A
            float *d = hidden.data() + (m - m0) * F;
            std::copy(grad_hidden + m * F, grad_hidden + (m + 1) * F, d);
            for (int64_t k = 0; k < R; k++) {
                const float c = grad_u[m * R + k];
                for (int64_t i = 0; i < F; i++) d[i] += c * A[k * F + i];
            }
            #pragma omp simd
            for (int64_t i = 0; i < F; i++) swiglu_grads(gate[m * F + i], up[m * F + i], d[i], out0_p + m * F + i, out1_p + m * F + i);
        }
    }
    #pragma omp critical
    for (int64_t i = 0; i < R * F; i++) out2_p[i] += dA[i];
}
"""


class GatedProjection(jt.Function):
    """(silu(gate) * up, (silu(gate) * up) A^T): the SwiGLU hidden and a LoRA's low-rank view of it.
    Only gate and up are kept; one pass gives both gradients for the two uses of the hidden."""

    def execute(self, gate, up, A):
        R, F = A.shape
        M = gate.numel() // F
        self.sizes = f"const int64_t M = {M}, F = {F}, R = {R};\n"
        self.saved = (gate, up, A)
        return tuple(jt.code([gate.shape, (M, R)], ["float32", "float32"], [gate, up, A], cpu_header=GATED_HEADER,
                             cpu_src=self.sizes + GATED_FORWARD))

    def grad(self, grad_hidden, grad_u):
        gate, up, A = self.saved
        if grad_hidden is None:
            grad_hidden = jt.zeros(gate.shape, "float32")
        if grad_u is None:
            grad_u = jt.zeros((gate.numel() // A.shape[1], A.shape[0]), "float32")
        return tuple(jt.code([gate.shape, up.shape, A.shape], ["float32"] * 3, [gate, up, A, grad_hidden, grad_u],
                             cpu_header=GATED_HEADER, cpu_src=self.sizes + GATED_BACKWARD))


def fused_gated_projection(gate, up, A):
    hidden, u = GatedProjection.apply(gate.float32(), up.float32(), A)
    return hidden, u.reshape(*gate.shape[:-1], A.shape[0])


def plain_gated_projection(gate, up, A):
    hidden = silu_gate.plain(gate, up)
    return hidden, linear(hidden, A)


# gate, up [..., F], A [R,F] -> hidden = silu(gate) * up [..., F], hidden A^T [..., R]
gated_projection = Kernel(fused_gated_projection, plain_gated_projection)
