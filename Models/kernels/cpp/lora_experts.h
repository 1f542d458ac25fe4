// A projection's LoRA experts as a decode step takes them (Models/kernels/decode_layer.py declares one per
// target): none, one, or E of rank R mixed per row by their own router (Models/Experts.py, SparseLoRA.py):
//   SOFTMAX (MoLoRA, HydraLoRA):  gate = softmax(x W_r^T)
//   TOP_K:      p = softmax(x W_r^T + b_r); gate = p where p >= the k-th largest p (ties kept), renormalised
//   THRESHOLD (AdaMoLE): p as TOP_K, tau = sigmoid(x W_t^T + b_t) / E; kept = (p - tau) where p >= tau,
//               gate = kept / sum(kept) (kept as it is when nothing clears tau)
// Shared by the CPU's lora_project.h and the GPU's cuda/products.cuh: one home for the gates' arithmetic and
// the gated rows' layout.
#ifndef MOA_LORA_EXPERTS_H
#define MOA_LORA_EXPERTS_H
#include <cmath>
#include <cstdint>
#ifdef __CUDACC__
#define MOA_HOST_DEVICE __host__ __device__
#else
#define MOA_HOST_DEVICE
#endif
// The most experts a projection's mixture may have here (decode_layer.fuses_decode_step reads it)
static const int64_t MAX_EXPERTS = 16;
enum Mixing { SINGLE, SOFTMAX, TOP_K, THRESHOLD };
struct LoraExperts {
    int64_t E, NA, R;  // experts (0: none), A matrices (E, or 1 when every B reads one A: HydraLoRA), rank
    float scale;       // alpha / R
    const float *A[MAX_EXPERTS], *B[MAX_EXPERTS];  // A [R,K] (NA of them), B [N,R]
    Mixing mixing;
    const float *router_w, *router_b;        // [E,K], [E] or null
    const float *threshold_w, *threshold_b;  // [1,K], [1]: AdaMoLE's
    int64_t top_k;
};
// gate [E] = softmax(logits + bias) of one row (bias null: none; logits [E] overwritten, gate may be logits): the
// experts' shares of a softmax router, the LoRA mixtures' and the decode layer's prompt and adapter mixtures'
MOA_HOST_DEVICE inline void softmax_gates(float *logits, const float *bias, int64_t E, float *gate) {
    float top = -INFINITY, total = 0.f;
    for (int64_t e = 0; e < E; e++) {
        logits[e] += bias ? bias[e] : 0.f;
        top = fmaxf(top, logits[e]);
    }
    for (int64_t e = 0; e < E; e++) total += (gate[e] = expf(logits[e] - top));
    for (int64_t e = 0; e < E; e++) gate[e] /= total;
}
// gate [E] of one row from its router's logits [E] (bias not yet added; overwritten) and, for THRESHOLD, the
// threshold's logit (bias not yet added)
MOA_HOST_DEVICE inline void mixture_gates(const LoraExperts &ex, float *logits, float threshold_logit, float *gate) {
    const int64_t E = ex.E;
    softmax_gates(logits, ex.router_b, E, gate);
    if (ex.mixing == SOFTMAX) return;
    float cut = 0.f;  // TOP_K: the k-th largest probability; THRESHOLD: tau
    if (ex.mixing == TOP_K) {
        for (int64_t e = 0; e < E; e++) {  // gate[e] is the k-th largest when k - 1 others beat it, k or more tie it
            int64_t above = 0, tied = 0;
            for (int64_t o = 0; o < E; o++) above += gate[o] > gate[e], tied += gate[o] == gate[e];
            if (above < ex.top_k && above + tied >= ex.top_k) cut = gate[e];
        }
    } else {
        cut = 1.f / (1.f + expf(-(threshold_logit + ex.threshold_b[0]))) / (float)E;
    }
    float kept_total = 0.f;
    for (int64_t e = 0; e < E; e++) {
        const float kept = gate[e] >= cut ? (ex.mixing == TOP_K ? gate[e] : gate[e] - cut) : 0.f;
        kept_total += (gate[e] = kept);
    }
    if (kept_total == 0.f) return;
    for (int64_t e = 0; e < E; e++) gate[e] /= kept_total;
}
// Row m of U [M,E*R] = factor * gate[m,e] * (x A_e^T)[m] for each expert e, from low [NA,M,R] = x A_a^T (NA 1:
// every expert reads block 0), the row's router logits [E] and threshold logit as mixture_gates takes them
MOA_HOST_DEVICE inline void mixture_row(const LoraExperts &ex, float *logits, float threshold_logit, const float *low,
                                        int64_t M, int64_t m, float factor, float *U) {
    float gate[MAX_EXPERTS];
    mixture_gates(ex, logits, threshold_logit, gate);
    for (int64_t e = 0; e < ex.E; e++)
        for (int64_t r = 0; r < ex.R; r++)
            U[(m * ex.E + e) * ex.R + r] = factor * gate[e] * low[((ex.NA == 1 ? 0 : e) * M + m) * ex.R + r];
}
#endif
