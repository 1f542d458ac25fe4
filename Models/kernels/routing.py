"""The type router's fused kernels: the SwiGLU router as one op each way (training), and a decode
step's whole routing (router, sigmoid, Gamma, selection) in one op. Their plain references are
the model's own modules (Models/Routing.py)."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .elementwise import SWIGLU_HEADER
from .linear import SGEMM_DECLARATION, plain_linear
from .switch import Kernel


# The SwiGLU router with its gradients, one op each way: w1 and w3 as one [2H,D] matrix, so x is read
# once forward and once backward and dx comes out whole (built from Linears and Jittor's elementwise
# ops it was about ten ops and three passes over x and its gradient per layer).
SWIGLU_ROUTER_HEADER = SGEMM_DECLARATION + SWIGLU_HEADER + "#include <vector>\n#include <algorithm>\n"
SWIGLU_ROUTER_FORWARD = """
// gu [M,2H] = x [W1;W3]^T + [b1;b3], logits [M,NT] = swiglu(g, u) W2^T + b2
std::vector<float> w13(2 * H * D), hidden(M * H);
std::copy(in1_p, in1_p + H * D, w13.data());
std::copy(in3_p, in3_p + H * D, w13.data() + H * D);
float *gu = out1_p;
dnnl_sgemm('N', 'T', M, 2 * H, D, 1.f, in0_p, D, w13.data(), D, 0.f, gu, 2 * H);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < H; j++) { gu[m * 2 * H + j] += in2_p[j]; gu[m * 2 * H + H + j] += in4_p[j]; }
    for (int64_t j = 0; j < H; j++) hidden[m * H + j] = swiglu(gu[m * 2 * H + j], gu[m * 2 * H + H + j]);
    for (int64_t n = 0; n < NT; n++) out0_p[m * NT + n] = in6_p[n];
}
dnnl_sgemm('N', 'T', M, NT, H, 1.f, hidden.data(), H, in5_p, H, 1.f, out0_p, NT);
"""
SWIGLU_ROUTER_BACKWARD = """
// inputs x, W1, W3, W2, gu, dlogits -> dx, dW1, db1, dW3, db3, dW2, db2
const float *x = in0_p, *gu = in4_p, *dl = in5_p;
std::vector<float> w13(2 * H * D), hidden(M * H), dh(M * H), dgu(M * 2 * H), dw13(2 * H * D);
std::copy(in1_p, in1_p + H * D, w13.data());
std::copy(in2_p, in2_p + H * D, w13.data() + H * D);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < H; j++) hidden[m * H + j] = swiglu(gu[m * 2 * H + j], gu[m * 2 * H + H + j]);
dnnl_sgemm('T', 'N', NT, H, M, 1.f, dl, NT, hidden.data(), H, 0.f, out5_p, H);
dnnl_sgemm('N', 'N', M, H, NT, 1.f, dl, NT, in3_p, H, 0.f, dh.data(), H);
#pragma omp parallel for
for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < H; j++)
        swiglu_grads(gu[m * 2 * H + j], gu[m * 2 * H + H + j], dh[m * H + j], &dgu[m * 2 * H + j], &dgu[m * 2 * H + H + j]);
dnnl_sgemm('T', 'N', 2 * H, D, M, 1.f, dgu.data(), 2 * H, x, D, 0.f, dw13.data(), D);
dnnl_sgemm('N', 'N', M, D, 2 * H, 1.f, dgu.data(), 2 * H, w13.data(), D, 0.f, out0_p, D);
std::copy(dw13.data(), dw13.data() + H * D, out1_p);
std::copy(dw13.data() + H * D, dw13.data() + 2 * H * D, out3_p);
std::fill(out2_p, out2_p + H, 0.f); std::fill(out4_p, out4_p + H, 0.f); std::fill(out6_p, out6_p + NT, 0.f);
for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < H; j++) { out2_p[j] += dgu[m * 2 * H + j]; out4_p[j] += dgu[m * 2 * H + H + j]; }
    for (int64_t n = 0; n < NT; n++) out6_p[n] += dl[m * NT + n];
}
"""


class SwiGLURouterOp(jt.Function):
    """w2(silu(w1 x + b1) * (w3 x + b3)) + b2 for x [M,D]; keeps x and the [M,2H] pre-activations."""

    def execute(self, x, w1, b1, w3, b3, w2, b2):
        (M, D), H, NT = x.shape, w1.shape[0], w2.shape[0]
        self.sizes = f"const int64_t M = {M}, D = {D}, H = {H}, NT = {NT};\n"
        logits, gu = jt.code([(M, NT), (M, 2 * H)], ["float32"] * 2, [x, w1, b1, w3, b3, w2, b2],
                             cpu_header=SWIGLU_ROUTER_HEADER, cpu_src=self.sizes + SWIGLU_ROUTER_FORWARD)
        self.saved = (x, w1, w3, w2, b1, b3, b2, gu.detach())
        return logits

    def grad(self, grad_logits):
        x, w1, w3, w2, b1, b3, b2, gu = self.saved
        shapes = [x.shape, w1.shape, b1.shape, w3.shape, b3.shape, w2.shape, b2.shape]
        return tuple(jt.code(shapes, ["float32"] * 7, [x, w1, w3, w2, gu, grad_logits],
                             cpu_header=SWIGLU_ROUTER_HEADER, cpu_src=self.sizes + SWIGLU_ROUTER_BACKWARD))


def fused_swiglu_router(x, w1, b1, w3, b3, w2, b2):
    rows = x.shape[:-1]
    logits = SwiGLURouterOp.apply(x.float32().reshape(-1, x.shape[-1]), w1, b1, w3, b3, w2, b2)
    return logits.reshape(*rows, w2.shape[0])


def plain_swiglu_router(x, w1, b1, w3, b3, w2, b2):
    return plain_linear(nn.silu(plain_linear(x, w1, b1)) * plain_linear(x, w3, b3), w2, b2)


# x [..., D] -> logits [..., NT]: w2 [NT,H], b2; w1, w3 [H,D], b1, b3; all fp32
swiglu_router = Kernel(fused_swiglu_router, plain_swiglu_router)


# The same for a few rows and no gradient (a decode step): every output in one op, per row the
# router (SwiGLU or Linear), the sigmoid, Gamma and the selection, instead of about thirty ops.
TYPE_WEIGHTS_HEADER = SWIGLU_HEADER + """
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
"""
# One row xm [D] -> probs_row [NT] and gamma (Sparse): the router (SwiGLU when HIDDEN > 0, else
# Linear), the sigmoid, Gamma and the selection; the weights' names are router_declarations'.
ROUTE_ROW = """
float hidden[HIDDEN > 0 ? HIDDEN : 1];
for (int64_t j = 0; j < HIDDEN; j++) {
    const float g = dot(xm, W1 + j * D, D) + B1[j], u = dot(xm, W3 + j * D, D) + B3[j];
    hidden[j] = swiglu(g, u);
}
if (SPARSE) gamma = LEARNED ? MAX_THRESHOLD * sigmoid(dot(xm, GW, D) + GB[0]) : MAX_THRESHOLD;
for (int64_t i = 0; i < NT; i++) {
    float p = sigmoid(HIDDEN > 0 ? dot(hidden, W2 + i * HIDDEN, HIDDEN) + B2[i] : dot(xm, W2 + i * D, D) + B2[i]);
    if (SPARSE && p - gamma < 0.f) p = 0.f;
    probs_row[i] = p;
}
"""
TYPE_WEIGHTS = """
for (int64_t m = 0; m < M; m++) {
    const float *xm = in0_p + m * D;
    float *probs_row = out0_p + m * NT, gamma = 0.f;
""" + ROUTE_ROW + """
    for (int64_t i = 0; i < NT; i++) columns[i][m] = probs_row[i];
    if (SPARSE) out1_p[m] = gamma;
}
"""


def router_declarations(router, threshold_fn, first: int, dim: int):
    """The router's (and learned Gamma's) weights as ROUTE_ROW reads them: the inputs, from jt.code
    input number `first`, the C++ declaring them with the router's sizes, and the number of types.
    router None (a layer without experts): no inputs and zero types."""
    swiglu = hasattr(router, "w1")  # a SwiGLU router, else a Linear
    layers = [router.w1, router.w3, router.w2] if swiglu else [router] if router is not None else []
    inputs = [t for layer in layers for t in (layer.weight, layer.bias)]
    names = (["W1", "B1", "W3", "B3"] if swiglu else []) + (["W2", "B2"] if layers else [])
    sparse = threshold_fn is not None
    learned = sparse and not threshold_fn.const
    if learned:
        inputs += [threshold_fn.weight, threshold_fn.bias]
        names += ["GW", "GB"]
    n_types = layers[-1].weight.shape[0] if layers else 0
    code = (f"const int64_t D = {dim}, NT = {n_types}, HIDDEN = {router.w1.weight.shape[0] if swiglu else 0};\n"
            f"const bool SPARSE = {str(sparse).lower()}, LEARNED = {str(learned).lower()};\n"
            f"const float MAX_THRESHOLD = {float(threshold_fn.max_threshold) if sparse else 0.0!r}f;\n"
            + "".join(f"const float *{name} = in{first + i}_p;\n" for i, name in enumerate(names))
            + "".join(f"const float *{name} = nullptr;\n" for name in ("W1", "B1", "W3", "B3", "W2", "B2", "GW", "GB")
                      if name not in names))
    return inputs, code, n_types


def fused_type_weights(x: jt.Var, router: nn.Module, threshold_fn, gamma_grad: str):
    B, T, D = x.shape
    weights, declarations, n_types = router_declarations(router, threshold_fn, 1, D)
    sparse = threshold_fn is not None
    first_column = 2 if sparse else 1
    sizes = (f"const int64_t M = {B * T};\n" + declarations
             + "float *columns[] = {" + ", ".join(f"out{first_column + i}_p" for i in range(n_types)) + "};\n")
    shapes = [(B * T, n_types)] + ([(B * T, 1)] if sparse else []) + [(B * T,)] * n_types
    outputs = jt.code(shapes, ["float32"] * len(shapes), [x.float32().reshape(B * T, D)] + weights,
                      cpu_header=TYPE_WEIGHTS_HEADER, cpu_src=sizes + TYPE_WEIGHTS)
    probs, gamma = outputs[0].reshape(B, T, n_types), (outputs[1].reshape(B, T, 1) if sparse else None)
    return probs, gamma, [column.reshape(B, T) for column in outputs[first_column:]]
