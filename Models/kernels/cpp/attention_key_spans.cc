// Key spans: query t sees keys [0, span[t]) (beyond, the additive mask is -inf), and a block of ROWS
// queries works on the widest span in it. Causal training then skips the upper triangle block by block,
// and a decode step reads only the filled cache.
// Declared per call: B, T, H, hd, S, Hkv, n_rep, scale, E, ROUND, mask.
const int64_t ROWS = 64, n_blocks = (T + ROWS - 1) / ROWS;
std::vector<int64_t> span(T), width(n_blocks, 0);
#pragma omp parallel for
for (int64_t t = 0; t < T; t++) {  // from the row's end back to its last unmasked key
    int64_t s = S;
    while (s > 0 && !(mask[t * S + s - 1] > -1e30f)) s--;
    span[t] = s;
}
for (int64_t t = 0; t < T; t++) width[t / ROWS] = std::max(width[t / ROWS], span[t]);
