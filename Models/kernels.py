"""Batched matmul for attention on CPU through oneDNN.

Jittor's CPU `matmul` maps 2-D products to oneDNN, but batched ones
([B,H,T,hd] @ [B,H,hd,S]) fall back to a broadcast-multiply-reduce that runs
4-8x slower and dominated our training step. `bmm` calls oneDNN's sgemm once
per batch entry instead; on a GPU, or without oneDNN, it is Jittor's matmul.
"""
import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

SGEMM_DECLARATION = """
#include <cstdint>
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
"""


def onednn_available() -> bool:
    return jt.compile_extern.mkl_ops is not None and not jt.flags.use_cuda


def sgemm_batched(a: jt.Var, b: jt.Var, trans_a: bool, trans_b: bool) -> jt.Var:
    """op(a) @ op(b) over equal leading dims, fp32, no autograd."""
    n, m = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    k = b.shape[-2] if trans_b else b.shape[-1]
    batch = int(np.prod(a.shape[:-2]))
    src = f"""
    for (int64_t i = 0; i < {batch}; i++)
        dnnl_sgemm('{"T" if trans_a else "N"}', '{"T" if trans_b else "N"}', {n}, {k}, {m}, 1.f,
                   in0_p + i * {n * m}, {n if trans_a else m}, in1_p + i * {m * k}, {m if trans_b else k},
                   0.f, out0_p + i * {n * k}, {k});
    """
    return jt.code(tuple(a.shape[:-2]) + (n, k), "float32", [a.float32(), b.float32()],
                   cpu_header=SGEMM_DECLARATION, cpu_src=src)


class BatchedMatmul(jt.Function):
    """op(a) @ op(b) with its gradient, each piece itself a batched sgemm."""

    def execute(self, a, b, trans_a=False, trans_b=False):
        self.saved = (a, b, trans_a, trans_b)
        return sgemm_batched(a, b, trans_a, trans_b)

    def grad(self, grad_out):
        a, b, trans_a, trans_b = self.saved
        if not trans_a and not trans_b:  # c = a b
            return sgemm_batched(grad_out, b, False, True), sgemm_batched(a, grad_out, True, False)
        if not trans_a and trans_b:  # c = a b^T
            return sgemm_batched(grad_out, b, False, False), sgemm_batched(grad_out, a, True, False)
        if trans_a and not trans_b:  # c = a^T b
            return sgemm_batched(b, grad_out, False, True), sgemm_batched(a, grad_out, False, False)
        return sgemm_batched(b, grad_out, True, True), sgemm_batched(grad_out, a, True, True)


def bmm(a: jt.Var, b: jt.Var, trans_b: bool = False) -> jt.Var:
    """a [...,n,m] @ b [...,m,k] (or b^T for b [...,k,m]) -> [...,n,k]; leading dims must match."""
    if not onednn_available():
        return nn.matmul(a, b.transpose(*range(b.ndim - 2), b.ndim - 1, b.ndim - 2) if trans_b else b)
    return BatchedMatmul.apply(a, b, False, trans_b)


ATTENTION_FORWARD = """
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t h = 0; h < H; h++) {
    const float *q = in0_p + (b * T * H + h) * hd, *k = in1_p + (b * S * Hkv + h / n_rep) * hd;
    const float *v = in2_p + (b * S * Hkv + h / n_rep) * hd, *mask = in3_p;
    float *p = out1_p + (b * H + h) * T * S, *o = out0_p + (b * T * H + h) * hd;
    dnnl_sgemm('N', 'T', T, S, hd, scale, q, H * hd, k, Hkv * hd, 0.f, p, S);
    for (int64_t t = 0; t < T; t++) {
        float *row = p + t * S, top = -INFINITY, total = 0.f;
        for (int64_t s = 0; s < S; s++) { row[s] += mask[t * S + s]; top = std::max(top, row[s]); }
        for (int64_t s = 0; s < S; s++) { row[s] = std::exp(row[s] - top); total += row[s]; }
        for (int64_t s = 0; s < S; s++) row[s] /= total;
    }
    dnnl_sgemm('N', 'N', T, hd, S, 1.f, p, S, v, Hkv * hd, 0.f, o, H * hd);
}
"""

ATTENTION_BACKWARD = """
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t g = 0; g < Hkv; g++) {
    std::vector<float> ds(T * S);
    const float *k = in1_p + (b * S * Hkv + g) * hd, *v = in2_p + (b * S * Hkv + g) * hd;
    float *dk = out1_p + (b * S * Hkv + g) * hd, *dv = out2_p + (b * S * Hkv + g) * hd;
    for (int64_t r = 0; r < n_rep; r++) {
        int64_t h = g * n_rep + r;
        const float *q = in0_p + (b * T * H + h) * hd, *p = in3_p + (b * H + h) * T * S;
        const float *dout = in4_p + (b * T * H + h) * hd;
        float *dq = out0_p + (b * T * H + h) * hd, beta = r == 0 ? 0.f : 1.f;
        dnnl_sgemm('T', 'N', S, hd, T, 1.f, p, S, dout, H * hd, beta, dv, Hkv * hd);
        dnnl_sgemm('N', 'T', T, S, hd, 1.f, dout, H * hd, v, Hkv * hd, 0.f, ds.data(), S);
        for (int64_t t = 0; t < T; t++) {
            const float *pr = p + t * S; float *dr = ds.data() + t * S, dot = 0.f;
            for (int64_t s = 0; s < S; s++) dot += dr[s] * pr[s];
            for (int64_t s = 0; s < S; s++) dr[s] = pr[s] * (dr[s] - dot) * scale;
        }
        dnnl_sgemm('N', 'N', T, hd, S, 1.f, ds.data(), S, k, Hkv * hd, 0.f, dq, H * hd);
        dnnl_sgemm('T', 'N', S, hd, T, 1.f, ds.data(), S, q, H * hd, beta, dk, Hkv * hd);
    }
}
"""


class FusedAttention(jt.Function):
    """softmax(q k^T * scale + mask) v with grouped kv heads, in the [B,T,heads,hd] layout.

    One C++ loop per (batch, head) calls oneDNN's sgemm with strides instead of
    transposing, and does the masked softmax in place; the probabilities are kept
    for the backward, which accumulates each kv head's gradient over its query group.
    """

    def execute(self, q, k, v, mask):
        # q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [T,S] -> out [B,T,H,hd]
        B, T, H, hd = q.shape
        S, Hkv = k.shape[1], k.shape[2]
        sizes = (f"const int64_t B = {B}, T = {T}, H = {H}, hd = {hd}, S = {S}, Hkv = {Hkv}, "
                 f"n_rep = {H // Hkv}; const float scale = {1.0 / float(np.sqrt(hd))!r}f;\n")
        out, probs = jt.code([(B, T, H, hd), (B, H, T, S)], ["float32", "float32"], [q, k, v, mask],
                             cpu_header=SGEMM_DECLARATION + "#include <cmath>\n#include <algorithm>\n",
                             cpu_src=sizes + ATTENTION_FORWARD)
        self.saved = (q, k, v, probs.detach(), sizes)
        return out

    def grad(self, grad_out):
        q, k, v, probs, sizes = self.saved
        dq, dk, dv = jt.code([q.shape, k.shape, v.shape], ["float32"] * 3, [q, k, v, probs, grad_out],
                             cpu_header=SGEMM_DECLARATION + "#include <vector>\n", cpu_src=sizes + ATTENTION_BACKWARD)
        return dq, dk, dv, None


def attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var) -> jt.Var:
    """q [B,T,H,hd], k/v [B,S,Hkv,hd], additive mask [T,S] -> [B,T,H,hd]."""
    if onednn_available():
        return FusedAttention.apply(q.float32(), k.float32(), v.float32(), mask)
    return reference_attention(q, k, v, mask)


def reference_attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var) -> jt.Var:
    """The same attention in plain Jittor ops (GPU, or no oneDNN)."""
    n_rep = q.shape[2] // k.shape[2]
    keys = repeat_kv(k, n_rep).transpose(0, 2, 3, 1)  # [B,H,hd,S]
    values = repeat_kv(v, n_rep).transpose(0, 2, 1, 3)  # [B,H,S,hd]
    scores = nn.matmul(q.transpose(0, 2, 1, 3), keys) / float(np.sqrt(q.shape[-1])) + mask  # [B,H,T,S]
    return nn.matmul(nn.softmax(scores.float32(), dim=-1), values).transpose(0, 2, 1, 3)  # [B,T,H,hd]


def repeat_kv(x: jt.Var, n_rep: int) -> jt.Var:
    """[B,S,Hkv,hd] -> [B,S,Hkv*n_rep,hd], each kv head repeated n_rep times in a row."""
    if n_rep == 1:
        return x
    B, S, Hkv, hd = x.shape
    return x.reshape(B, S, Hkv, 1, hd).broadcast((B, S, Hkv, n_rep, hd)).reshape(B, S, Hkv * n_rep, hd)


ROTATE_PAIRS = """
#pragma omp parallel for
for (int64_t bt = 0; bt < B * T; bt++) {
    const float *c = in1_p + (bt % T) * half, *s = in2_p + (bt % T) * half;
    for (int64_t h = 0; h < H; h++) {
        const float *x = in0_p + (bt * H + h) * 2 * half;
        float *y = out0_p + (bt * H + h) * 2 * half;
        for (int64_t i = 0; i < half; i++) {
            float even = x[2 * i], odd = x[2 * i + 1], sine = sign * s[i];
            y[2 * i] = even * c[i] - odd * sine;
            y[2 * i + 1] = even * sine + odd * c[i];
        }
    }
}
"""


def rotate_pairs(x: jt.Var, cos: jt.Var, sin: jt.Var, sign: float) -> jt.Var:
    """Rotate each (even, odd) pair of x [B,T,H,hd] by +-angle; cos/sin [T,hd/2]."""
    B, T, H, hd = x.shape
    sizes = f"const int64_t B = {B}, T = {T}, H = {H}, half = {hd // 2}; const float sign = {sign!r}f;\n"
    return jt.code(x.shape, "float32", [x.float32(), cos, sin], cpu_src=sizes + ROTATE_PAIRS)


class Rope(jt.Function):
    """RoPE in one threaded pass; its gradient is the rotation by the opposite angle."""

    def execute(self, x, cos, sin):
        self.saved = (cos, sin)
        return rotate_pairs(x, cos, sin, 1.0)

    def grad(self, grad_out):
        cos, sin = self.saved
        return rotate_pairs(grad_out, cos, sin, -1.0), None, None


CROSS_ENTROPY_FORWARD = """
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *x = in0_p + r * V;
    float top = -INFINITY, total = 0.f;
    for (int64_t v = 0; v < V; v++) top = std::max(top, x[v]);
    for (int64_t v = 0; v < V; v++) total += std::exp(x[v] - top);
    out1_p[r] = top + std::log(total);
    out0_p[r] = out1_p[r] - x[in1_p[r]];
}
"""

CROSS_ENTROPY_BACKWARD = """
#pragma omp parallel for
for (int64_t r = 0; r < N; r++) {
    const float *x = in0_p + r * V;
    float *g = out0_p + r * V, scale = in3_p[r], lse = in2_p[r];
    for (int64_t v = 0; v < V; v++) g[v] = scale * std::exp(x[v] - lse);
    g[in1_p[r]] -= scale;
}
"""


class CrossEntropyRows(jt.Function):
    """nll [N] = logsumexp(logits [N,V]) - logits[target], one threaded pass each way."""

    def execute(self, logits, targets):
        N, V = logits.shape
        self.sizes = f"const int64_t N = {N}, V = {V};\n"
        nll, lse = jt.code([(N,), (N,)], ["float32", "float32"], [logits, targets],
                           cpu_header="#include <cmath>\n#include <algorithm>\n",
                           cpu_src=self.sizes + CROSS_ENTROPY_FORWARD)
        self.saved = (logits, targets, lse.detach())
        return nll

    def grad(self, grad_nll):
        logits, targets, lse = self.saved
        grad = jt.code(logits.shape, "float32", [logits, targets, lse, grad_nll],
                       cpu_header="#include <cmath>\n", cpu_src=self.sizes + CROSS_ENTROPY_BACKWARD)
        return grad, None


def token_nll(logits: jt.Var, targets: jt.Var) -> jt.Var:
    """-log softmax(logits)[target]: logits [B,T,V] fp32, targets [B,T] int -> [B,T]."""
    B, T, V = logits.shape
    if onednn_available():
        return CrossEntropyRows.apply(logits.reshape(B * T, V), targets.reshape(B * T).int32()).reshape(B, T)
    log_probs = nn.log_softmax(logits, dim=-1)
    return -jt.gather(log_probs, 2, targets.unsqueeze(-1)).squeeze(-1)
