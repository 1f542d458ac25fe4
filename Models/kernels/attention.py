"""Attention through oneDNN's sgemm: causal (with the KV cache) and to Soft MoA's learned prompt.

Jittor's CPU `matmul` maps 2-D products to oneDNN, but batched ones
([B,H,T,hd] @ [B,H,hd,S]) fall back to a broadcast-multiply-reduce that ran
4-8x slower and dominated our training step, and its softmax is single-threaded.
FusedAttention calls oneDNN's sgemm per (batch, head) on strided views instead.
Each is a switch.Kernel beside its plain-Jittor reference.
"""
import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .linear import SGEMM_DECLARATION
from .precision import BF16_HEADER, cpu_has_bf16_units
from .switch import GEMV_ROWS, Kernel

# The products in the base's precision. fp32: the fp32 operands through sgemm. bf16 (training and
# prefill of a bf16 base, as autocast does): q, k, v, the probabilities and, backwards, the incoming
# gradient and the scores' gradient rounded to bf16, products summed in fp32: bf16 bits on the bf16
# units (E = uint16_t), else their fp32 values through sgemm (E = float, ROUND). Softmax, the
# log-sum-exp and every output stay fp32.
ATTENTION_HEADER = BF16_HEADER + """
#include <cmath>
#include <type_traits>
static inline void gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
static inline void gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A, int64_t lda,
                        const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    dnnl_gemm_bf16bf16f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
// rows x cols of x (row stride ld) as operands: x itself in fp32, else a rounded copy in buf (rows * ld)
template <typename E>
static const E *operands(const float *x, int64_t rows, int64_t cols, int64_t ld, bool round, E *buf) {
    if (std::is_same<E, float>::value && !round) return reinterpret_cast<const E *>(x);
    #pragma omp parallel for if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) for (int64_t c = 0; c < cols; c++) round_to(x[r * ld + c], buf + r * ld + c);
    return buf;
}
// a buffer for operands(): n elements where they are rounded copies, none where fp32 operands are read in place
template <typename E>
static std::unique_ptr<E[]> operand_buffer(bool round, int64_t n) { return scratch<E>(round ? n : 0); }
"""

# Key spans: query t sees keys [0, span[t]) (beyond, the additive mask is -inf), and a
# block of ROWS queries works on the widest span in it. Causal training then skips
# the upper triangle block by block, and a decode step reads only the filled cache.
KEY_SPANS = """
const int64_t ROWS = 64, n_blocks = (T + ROWS - 1) / ROWS;
std::vector<int64_t> span(T), width(n_blocks, 0);
#pragma omp parallel for
for (int64_t t = 0; t < T; t++) {  // from the row's end back to its last unmasked key
    int64_t s = S;
    while (s > 0 && !(mask[t * S + s - 1] > -1e30f)) s--;
    span[t] = s;
}
for (int64_t t = 0; t < T; t++) width[t / ROWS] = std::max(width[t / ROWS], span[t]);
const auto q_buf = operand_buffer<E>(ROUND, B * T * H * hd), k_buf = operand_buffer<E>(ROUND, B * S * Hkv * hd),
           v_buf = operand_buffer<E>(ROUND, B * S * Hkv * hd);
const E *qe = operands(in0_p, B * T * H, hd, hd, ROUND, q_buf.get()),
        *ke = operands(in1_p, B * S * Hkv, hd, hd, ROUND, k_buf.get()),
        *ve = operands(in2_p, B * S * Hkv, hd, hd, ROUND, v_buf.get());
"""

# The probabilities of a block of queries live in a per-thread scratch: the forward keeps
# each row's log-sum-exp [B,H,T] and the backward recomputes them from it, so no [B,H,T,S]
# tensor outlives the op (at 300 tokens and 32 heads, 11.5 MB per layer held for the backward).
SCORES = "gemm('N', 'T', rows, w, hd, scale, q, H * hd, k, Hkv * hd, 0.f, p, S);\n"

ATTENTION_FORWARD = """
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t h = 0; h < H; h++) {
    const auto scores = scratch<float>(ROWS * S);
    const auto p_buf = operand_buffer<E>(ROUND, ROWS * S);
    float *p = scores.get();
    const E *k = ke + (b * S * Hkv + h / n_rep) * hd, *v = ve + (b * S * Hkv + h / n_rep) * hd;
    for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
        const int64_t rows = std::min(ROWS, T - t0), w = width[t0 / ROWS];
        const E *q = qe + ((b * T + t0) * H + h) * hd;
        float *o = out0_p + ((b * T + t0) * H + h) * hd, *lse = out1_p + (b * H + h) * T + t0;
        if (w > 0) """ + SCORES + """
        for (int64_t t = 0; t < rows; t++) {
            float *row = p + t * S, top = -INFINITY, total = 0.f;
            const float *m = mask + (t0 + t) * S;
            const int64_t n = span[t0 + t];
            for (int64_t s = 0; s < n; s++) { row[s] += m[s]; top = std::max(top, row[s]); }
            for (int64_t s = 0; s < n; s++) { row[s] = std::exp(row[s] - top); total += row[s]; }
            for (int64_t s = 0; s < n; s++) row[s] /= total;
            for (int64_t s = n; s < w; s++) row[s] = 0.f;
            lse[t] = top + std::log(total);
        }
        if (w > 0) gemm('N', 'N', rows, hd, w, 1.f, operands(p, rows, w, S, ROUND, p_buf.get()), S, v, Hkv * hd, 0.f, o, H * hd);
        else for (int64_t t = 0; t < rows; t++) std::fill(o + t * H * hd, o + t * H * hd + hd, 0.f);
    }
}
"""

ATTENTION_BACKWARD = """
const auto dout_buf = operand_buffer<E>(ROUND, B * T * H * hd);
const E *dout_e = operands(in4_p, B * T * H, hd, hd, ROUND, dout_buf.get());
#pragma omp parallel for collapse(2)
for (int64_t b = 0; b < B; b++)
for (int64_t g = 0; g < Hkv; g++) {
    const auto scores = scratch<float>(ROWS * S), ds = scratch<float>(ROWS * S);
    const auto p_buf = operand_buffer<E>(ROUND, ROWS * S), ds_buf = operand_buffer<E>(ROUND, ROWS * S);
    float *p = scores.get();
    const E *k = ke + (b * S * Hkv + g) * hd, *v = ve + (b * S * Hkv + g) * hd;
    float *dk = out1_p + (b * S * Hkv + g) * hd, *dv = out2_p + (b * S * Hkv + g) * hd;
    for (int64_t s = 0; s < S; s++) {
        std::fill(dk + s * Hkv * hd, dk + s * Hkv * hd + hd, 0.f);
        std::fill(dv + s * Hkv * hd, dv + s * Hkv * hd + hd, 0.f);
    }
    for (int64_t r = 0; r < n_rep; r++)
    for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
        const int64_t h = g * n_rep + r, rows = std::min(ROWS, T - t0), w = width[t0 / ROWS];
        const E *q = qe + ((b * T + t0) * H + h) * hd, *dout = dout_e + ((b * T + t0) * H + h) * hd;
        const float *lse = in3_p + (b * H + h) * T + t0;
        float *dq = out0_p + ((b * T + t0) * H + h) * hd;
        if (w == 0) {
            for (int64_t t = 0; t < rows; t++) std::fill(dq + t * H * hd, dq + t * H * hd + hd, 0.f);
            continue;
        }
        """ + SCORES + """        for (int64_t t = 0; t < rows; t++) {
            float *row = p + t * S;
            const float *m = mask + (t0 + t) * S;
            const int64_t n = span[t0 + t];
            for (int64_t s = 0; s < n; s++) row[s] = std::exp(row[s] + m[s] - lse[t]);
            for (int64_t s = n; s < w; s++) row[s] = 0.f;
        }
        gemm('T', 'N', w, hd, rows, 1.f, operands(p, rows, w, S, ROUND, p_buf.get()), S, dout, H * hd, 1.f, dv, Hkv * hd);
        gemm('N', 'T', rows, w, hd, 1.f, dout, H * hd, v, Hkv * hd, 0.f, ds.get(), w);
        for (int64_t t = 0; t < rows; t++) {
            const float *pr = p + t * S; float *dr = ds.get() + t * w, dot = 0.f;
            for (int64_t s = 0; s < w; s++) dot += dr[s] * pr[s];
            for (int64_t s = 0; s < w; s++) dr[s] = pr[s] * (dr[s] - dot) * scale;
        }
        const E *dse = operands(ds.get(), rows, w, w, ROUND, ds_buf.get());
        gemm('N', 'N', rows, hd, w, 1.f, dse, w, k, Hkv * hd, 0.f, dq, H * hd);
        gemm('T', 'N', w, hd, rows, 1.f, dse, w, q, H * hd, 1.f, dk, Hkv * hd);
    }
}
"""


def operand_type(bf16: bool) -> str:
    """The C++ operand type of the products: fp32, bf16 bits on the bf16 units, else rounded fp32."""
    if not bf16:
        return "typedef float E; const bool ROUND = false;\n"
    if cpu_has_bf16_units():
        return "typedef uint16_t E; const bool ROUND = true;\n"
    return "typedef float E; const bool ROUND = true;\n"


class FusedAttention(jt.Function):
    """softmax(q k^T * scale + mask) v with grouped kv heads, in the [B,T,heads,hd] layout.

    One C++ loop per (batch, head) calls oneDNN's gemm with strides instead of
    transposing, and does the masked softmax in place, a block of 64 queries at a time;
    the backward recomputes each block's probabilities from the rows' log-sum-exp
    and accumulates each kv head's gradient over its query group. bf16: the products'
    operands rounded to bf16 (see ATTENTION_HEADER).
    """

    def execute(self, q, k, v, mask, bf16=False):
        # q [B,T,H,hd], k/v [B,S,Hkv,hd], mask [T,S] -> out [B,T,H,hd]
        B, T, H, hd = q.shape
        S, Hkv = k.shape[1], k.shape[2]
        sizes = (f"const int64_t B = {B}, T = {T}, H = {H}, hd = {hd}, S = {S}, Hkv = {Hkv}, "
                 f"n_rep = {H // Hkv}; const float scale = {1.0 / float(np.sqrt(hd))!r}f;\n" + operand_type(bf16))
        out, lse = jt.code([(B, T, H, hd), (B, H, T)], ["float32", "float32"], [q, k, v, mask],
                           cpu_header=ATTENTION_HEADER,
                           cpu_src=sizes + "const float *mask = in3_p;\n" + KEY_SPANS + ATTENTION_FORWARD)
        self.saved = (q, k, v, lse.detach(), mask, sizes)
        return out

    def grad(self, grad_out):
        q, k, v, lse, mask, sizes = self.saved
        dq, dk, dv = jt.code([q.shape, k.shape, v.shape], ["float32"] * 3, [q, k, v, lse, grad_out, mask],
                             cpu_header=ATTENTION_HEADER,
                             cpu_src=sizes + "const float *mask = in5_p;\n" + KEY_SPANS + ATTENTION_BACKWARD)
        return dq, dk, dv, None, None


def fused_attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var, bf16: bool = False) -> jt.Var:
    # a decode step's few queries stay fp32: rounding would cost a pass over the whole cache
    bf16 = bf16 and q.shape[0] * q.shape[1] > GEMV_ROWS
    return FusedAttention.apply(q.float32(), k.float32(), v.float32(), mask, bf16)


def plain_attention(q: jt.Var, k: jt.Var, v: jt.Var, mask: jt.Var, bf16: bool = False) -> jt.Var:
    """The same attention in plain Jittor ops, fp32 products (bf16 is the fused kernels' rule only)."""
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


# q [B,T,H,hd], k/v [B,S,Hkv,hd], additive mask [T,S], bf16 (the products' rule) -> [B,T,H,hd]
attention = Kernel(fused_attention, plain_attention)


# Attention to the learned prompt (Soft MoA's prompt expert): L keys and values shared by the whole
# batch, no mask. The batch's rows are one matrix per head, so each product is one sgemm over all
# B*T rows (a few dozen calls per layer) instead of one per (sequence, head, block of 64 queries):
# with L in the tens, those calls cost more than they computed. The op also weighs the result by
# the head's gate and the row's type weight and adds it to `base` (the causal attention's output):
# built from Jittor ops, those products and their gradients' reductions were a dozen more passes.
PROMPT_ATTENTION_FORWARD = """
const bool few_rows = BT <= GEMV_ROWS;  // a decode step: plain loops, no sgemm set-up per head
const float *gate = in3_p, *tw = in4_p, *base = in5_p;
for (int64_t h = 0; h < H; h++) {
    const float *q = in0_p + h * hd, *k = in1_p + h / n_rep * hd;
    if (!few_rows) dnnl_sgemm('N', 'T', BT, L, hd, scale, q, H * hd, k, Hkv * hd, 0.f, out1_p + h * L, H * L);
    else for (int64_t r = 0; r < BT; r++) for (int64_t s = 0; s < L; s++) {
        float dot = 0.f;
        for (int64_t i = 0; i < hd; i++) dot += q[r * H * hd + i] * k[s * Hkv * hd + i];
        out1_p[(r * H + h) * L + s] = dot * scale;
    }
}
#pragma omp parallel for if (!few_rows)
for (int64_t row = 0; row < BT * H; row++) {
    float *p = out1_p + row * L, top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < L; s++) top = std::max(top, p[s]);
    for (int64_t s = 0; s < L; s++) { p[s] = std::exp(p[s] - top); total += p[s]; }
    for (int64_t s = 0; s < L; s++) p[s] /= total;
}
attend_prompt(out1_p, in2_p, BT, H, hd, L, Hkv, n_rep, out0_p);
#pragma omp parallel for if (!few_rows)
for (int64_t row = 0; row < BT * H; row++) {
    const float c = gate[row % H] * tw[row / H];
    for (int64_t i = 0; i < hd; i++) out0_p[row * hd + i] = base[row * hd + i] + c * out0_p[row * hd + i];
}
"""

# g = grad_out, c = gate[h] tw[bt] per row. The prompt's raw output is probs v, so g . raw is
# sum_s p_s (g . v_s): the softmax backward's own expectation, and dgate[h] = sum_bt tw[bt] (g . raw),
# dtw[bt] = sum_h gate[h] (g . raw) come without rebuilding raw; the scores' gradient and dv carry c.
PROMPT_ATTENTION_BACKWARD = """
const float *gate = in5_p, *tw = in6_p, *g = in4_p;
std::vector<float> dots(BT * H), ds(BT * H * L), scaled(BT * H * L);
for (int64_t h = 0; h < H; h++)
    dnnl_sgemm('N', 'T', BT, L, hd, 1.f, g + h * hd, H * hd, in2_p + h / n_rep * hd, Hkv * hd,
               0.f, ds.data() + h * L, H * L);
#pragma omp parallel for
for (int64_t row = 0; row < BT * H; row++) {
    const float *p = in3_p + row * L, c = gate[row % H] * tw[row / H];
    float *dr = ds.data() + row * L, expected = 0.f;
    for (int64_t s = 0; s < L; s++) expected += p[s] * dr[s];
    for (int64_t s = 0; s < L; s++) {
        dr[s] = c * p[s] * (dr[s] - expected) * scale;
        scaled[row * L + s] = c * p[s];
    }
    dots[row] = expected;
}
for (int64_t h = 0; h < H; h++) out3_p[h] = 0.f;
for (int64_t bt = 0; bt < BT; bt++) {
    float sum = 0.f;
    for (int64_t h = 0; h < H; h++) { sum += gate[h] * dots[bt * H + h]; out3_p[h] += tw[bt] * dots[bt * H + h]; }
    out4_p[bt] = sum;
}
std::fill(out1_p, out1_p + L * Hkv * hd, 0.f);
std::fill(out2_p, out2_p + L * Hkv * hd, 0.f);
for (int64_t h = 0; h < H; h++) {
    const int64_t kv = h / n_rep;
    dnnl_sgemm('N', 'N', BT, hd, L, 1.f, ds.data() + h * L, H * L, in1_p + kv * hd, Hkv * hd, 0.f, out0_p + h * hd, H * hd);
    dnnl_sgemm('T', 'N', L, hd, BT, 1.f, ds.data() + h * L, H * L, in0_p + h * hd, H * hd, 1.f, out1_p + kv * hd, Hkv * hd);
    dnnl_sgemm('T', 'N', L, hd, BT, 1.f, scaled.data() + h * L, H * L, g + h * hd, H * hd, 1.f, out2_p + kv * hd, Hkv * hd);
}
"""
PROMPT_ATTENTION_HEADER = (SGEMM_DECLARATION + f"static const int64_t GEMV_ROWS = {GEMV_ROWS};\n"
                           "#include <cmath>\n#include <algorithm>\n#include <vector>\n" + """
// out [BT,H,hd] = probs [BT,H,L] v [L,Hkv*hd], kv head h / n_rep serving query head h
static void attend_prompt(const float *probs, const float *v, int64_t BT, int64_t H, int64_t hd, int64_t L,
                          int64_t Hkv, int64_t n_rep, float *out) {
    if (BT > GEMV_ROWS) {
        for (int64_t h = 0; h < H; h++)
            dnnl_sgemm('N', 'N', BT, hd, L, 1.f, probs + h * L, H * L, v + h / n_rep * hd, Hkv * hd, 0.f, out + h * hd, H * hd);
        return;
    }
    for (int64_t r = 0; r < BT; r++) for (int64_t h = 0; h < H; h++) {  // a decode step: plain loops
        float *o = out + (r * H + h) * hd;
        const float *p = probs + (r * H + h) * L, *vh = v + h / n_rep * hd;
        for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
        for (int64_t s = 0; s < L; s++) for (int64_t i = 0; i < hd; i++) o[i] += p[s] * vh[s * Hkv * hd + i];
    }
}
""")


class PromptAttention(jt.Function):
    """base + gate[h] * type_weight[b,t] * softmax(q k^T * scale) v over L prompt rows shared by the
    batch; keeps the probabilities [B,T,H,L] (small) for the backward."""

    def execute(self, q, k, v, gate, type_weight, base):
        # q [B,T,H,hd], k/v [L, Hkv*hd], gate [H], type_weight [B,T], base [B,T,H,hd] -> [B,T,H,hd]
        B, T, H, hd = q.shape
        L, Hkv = k.shape[0], k.shape[1] // hd
        self.sizes = (f"const int64_t BT = {B * T}, H = {H}, hd = {hd}, L = {L}, Hkv = {Hkv}, n_rep = {H // Hkv}; "
                      f"const float scale = {1.0 / float(np.sqrt(hd))!r}f;\n")
        out, probs = jt.code([(B, T, H, hd), (B, T, H, L)], ["float32", "float32"], [q, k, v, gate, type_weight, base],
                             cpu_header=PROMPT_ATTENTION_HEADER, cpu_src=self.sizes + PROMPT_ATTENTION_FORWARD)
        self.saved = (q, k, v, probs.detach(), gate, type_weight)
        return out

    def grad(self, grad_out):
        q, k, v, probs, gate, type_weight = self.saved
        dq, dk, dv, dgate, dweight = jt.code([q.shape, k.shape, v.shape, gate.shape, type_weight.shape], ["float32"] * 5,
                                             [q, k, v, probs, grad_out, gate, type_weight],
                                             cpu_header=PROMPT_ATTENTION_HEADER,
                                             cpu_src=self.sizes + PROMPT_ATTENTION_BACKWARD)
        return dq, dk, dv, dgate, dweight, grad_out


def fused_prompt_attention(q, k, v, gate, type_weight, base):
    B, T = q.shape[:2]
    if type_weight is None:  # not routed: weight 1
        type_weight = jt.ones((B, T), "float32").stop_grad()
    return PromptAttention.apply(q.float32(), k.float32(), v.float32(), gate.float32(), type_weight.float32(),
                                 base.float32())


def plain_prompt_attention(q, k, v, gate, type_weight, base):
    B, T, H, hd = q.shape
    L, Hkv = k.shape[0], k.shape[1] // hd
    kv_shape = (B, L, Hkv, hd)
    keys, values = (t.reshape(1, L, Hkv, hd).broadcast(kv_shape) for t in (k, v))
    out = plain_attention(q, keys, values, jt.zeros((T, L), "float32")) * gate.reshape(1, 1, H, 1)
    return base + (out if type_weight is None else out * type_weight.reshape(B, T, 1, 1))


# base [B,T,H,hd] + gate [H] * type_weight [B,T] (or None) * attention of q [B,T,H,hd] to the prompt's
# keys/values [L, Hkv*hd] (the same for every sequence) -> [B,T,H,hd]
prompt_attention = Kernel(fused_prompt_attention, plain_prompt_attention)
