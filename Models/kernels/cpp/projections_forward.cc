// The forward's start, after x [M,K] is declared: x narrowed to bf16 once for all the op's base products
// where the bf16 units take them (xb, else null); one project_forward(M, ...) per projection follows,
// generated per op.
std::unique_ptr<uint16_t[]> x_bits;
if (BF16_RULE && UNITS && M > GEMV_ROWS) x_bits = narrowed(x, M * K);
const uint16_t *xb = x_bits.get();
