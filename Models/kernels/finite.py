"""How many elements of a set of fp32 tensors are NaN or infinite: the adapter after each optimizer
step (engine_finetune), so a non-finite adapter is caught at the step that made it, never saved; and
which rows of a decode step's logits hold one (Models/generate.pick_tokens), in one pass over them.

The fused op reads up to SLOTS_PER_OP tensors in one pass on all cores (a few ops for the whole
adapter instead of one reduction per tensor); it tests the exponent bits, which no compiler flag
can optimise away. The plain reference is Jittor's isfinite per tensor.
"""
import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt

from .switch import Kernel

SLOTS_PER_OP = 64  # as the AdamW op: Jittor's code op fails to compile with about a thousand inputs
COUNT_SOURCE = """
int64_t bad = 0;
#pragma omp parallel
for (int64_t s = 0; s < S; s++) {
    const uint32_t *bits = (const uint32_t *)tensors[s];
    #pragma omp for reduction(+:bad) schedule(static)
    for (int64_t i = 0; i < sizes[s]; i++)
        bad += (bits[i] & 0x7f800000u) == 0x7f800000u;  // exponent all ones: inf or NaN
}
out0_p[0] = (float)bad;
"""


def fused_nonfinite_count(tensors: list) -> jt.Var:
    """float32 [1]: the non-finite elements of `tensors` (fp32), one op per SLOTS_PER_OP of them."""
    counts = []
    for start in range(0, len(tensors), SLOTS_PER_OP):
        group = tensors[start:start + SLOTS_PER_OP]
        header = (f"const int64_t S = {len(group)};\n"
                  f"const int64_t sizes[S] = {{{', '.join(f'in{i}->num' for i in range(len(group)))}}};\n"
                  f"const float *tensors[S] = {{{', '.join(f'in{i}_p' for i in range(len(group)))}}};\n")
        counts.append(jt.code([(1,)], ["float32"], group, cpu_header="#include <cstdint>\n",
                              cpu_src=header + COUNT_SOURCE)[0])
    return sum(counts[1:], counts[0])


def plain_nonfinite_count(tensors: list) -> jt.Var:
    return sum(((1 - jt.isfinite(t).float32()).sum().reshape(1) for t in tensors[1:]),
               (1 - jt.isfinite(tensors[0]).float32()).sum().reshape(1))


nonfinite_count = Kernel(fused_nonfinite_count, plain_nonfinite_count,
                         when=lambda tensors: all(t.dtype == "float32" for t in tensors))


ROWS_SOURCE = """
#pragma omp parallel for schedule(static)
for (int64_t b = 0; b < in0_shape0; b++) {
    const uint32_t *bits = (const uint32_t *)in0_p + b * in0_shape1;
    uint32_t bad = 0;
    for (int64_t v = 0; v < in0_shape1; v++)
        bad |= (bits[v] & 0x7f800000u) == 0x7f800000u;
    out0_p[b] = bad;
}
"""


def fused_nonfinite_rows(x: jt.Var) -> jt.Var:
    """bool [B]: whether row b of x [B,V] (fp32) holds a NaN or inf; one pass, no [B,V] temporary."""
    return jt.code([x.shape[0]], "bool", [x], cpu_header="#include <cstdint>\n", cpu_src=ROWS_SOURCE)


def plain_nonfinite_rows(x: jt.Var) -> jt.Var:
    return jt.logical_not(jt.isfinite(x)).any(-1)


nonfinite_rows = Kernel(fused_nonfinite_rows, plain_nonfinite_rows, when=lambda x: x.dtype == "float32")
