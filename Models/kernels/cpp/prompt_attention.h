// Attention to Soft MoA's learned prompt (Models/kernels/attention.py): L keys and values shared by the
// whole batch, no mask, so each product is one sgemm per head over all the batch's rows.
#ifndef MOA_PROMPT_ATTENTION_H
#define MOA_PROMPT_ATTENTION_H
#include "sgemm.h"
#include "gemv.h"
#include <cmath>
#include <algorithm>
#include <vector>

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
#endif
