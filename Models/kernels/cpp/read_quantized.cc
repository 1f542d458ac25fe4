// The quantized values (out0) and scales (out1) of a checkpoint matrix stored as STORED in data's parts (int8 or
// nf4 by the types VALUES and SCALES: read_quantized.h's quantize_into), blocks of
// BLOCK rows on each thread; out2 [1] <- its elements that are NaN or inf (their rows are left unquantized). head_dim > 0: within each head of head_dim rows, row 2i+c is read from row
// c*head_dim/2+i (the halves of a Hugging Face head -> Meta's pairs; BLOCK is a multiple of head_dim).
// Declared per call: N, K, BLOCK, STORED, VALUES, SCALES.
std::vector<MatrixPart> parts((int64_t)data["parts"]);
for (size_t i = 0; i < parts.size(); i++) {
    const std::string p = std::to_string(i);
    parts[i] = MatrixPart{(int)data["fd" + p], (int64_t)data["offset" + p], (int64_t)data["row0" + p],
                          (int64_t)data["rows" + p], (int64_t)data["col0" + p], (int64_t)data["cols" + p]};
}
const int64_t hd = (int64_t)data["head_dim"];
int64_t unread = -1, bad = 0;
#pragma omp parallel
{
    std::vector<char> raw;
    std::vector<float> f(BLOCK * K);
    #pragma omp for schedule(dynamic) reduction(max : unread) reduction(+ : bad)
    for (int64_t r0 = 0; r0 < N; r0 += BLOCK) {
        const int64_t n = std::min(BLOCK, N - r0);
        if (!read_rows<STORED>(parts, K, r0, n, raw, f.data())) { unread = std::max(unread, r0); continue; }
        for (int64_t r = r0; r < r0 + n; r++) {
            const int64_t j = hd > 0 ? r % hd : 0, from = hd > 0 ? r - j + (j % 2) * (hd / 2) + j / 2 : r;
            const float *row = f.data() + (from - r0) * K;
            if (!quantize_into(row, K, r, (VALUES *)out0_p, (SCALES *)out1_p)) bad += non_finite_count(row, K);
        }
    }
}
if (unread >= 0) LOGf << "could not read rows" << unread << "on of a" << N << "x" << K << "matrix";
out2_p[0] = bad;
