"""Random inputs of the fused kernels' tests (tests/test_kernels.py, tests/test_projection_kernels.py)."""
import contextlib
import platform

import numpy as np

import jittor as jt
from Models.kernels.bf16 import to_bf16
from Models.kernels.precision import QUANTIZERS


def normal(rng, shape, scale=1.0):
    return jt.array((scale * rng.standard_normal(shape)).astype(np.float32))


def stored(weight, dtype):
    """A frozen base weight in the base's storage `dtype` and its scales (int8, uint8: nf4), else None."""
    if dtype in QUANTIZERS:
        values, scale = QUANTIZERS[dtype](weight)
        return values.stop_grad(), scale.stop_grad()
    return (weight if dtype == "float32" else to_bf16(weight)).stop_grad(), None


DENORMAL_MODE = """
// MXCSR's FTZ (bit 15) and DAZ (bit 6), set or cleared in every thread of the OpenMP pool and in this one
#pragma omp parallel
{ const unsigned int c = _mm_getcsr(); _mm_setcsr(FLUSH ? (c | 0x8040u) : (c & ~0x8040u)); }
{ const unsigned int c = _mm_getcsr(); _mm_setcsr(FLUSH ? (c | 0x8040u) : (c & ~0x8040u)); }
out0_p[0] = 0;
"""


@contextlib.contextmanager
def denormal_mode(flush: bool):
    """Kernels run with subnormals flushed (FTZ and DAZ on) or kept (off) in every thread, then flushed
    again (what a thread that loaded an -Ofast library has). x86 only; elsewhere the mode stays as it is.
    A kernel compiled meanwhile sets them in the thread that loads it (GCC's crtfastmath): the context
    gives the function that sets the mode again, to call once the kernels are compiled."""
    def set_mode(on):
        if platform.machine() in ("x86_64", "AMD64"):
            jt.code([(1,)], ["float32"], [], cpu_header=f"#include <xmmintrin.h>\n#define FLUSH {int(on)}\n",
                    cpu_src=DENORMAL_MODE)[0].sync()
    set_mode(flush)
    try:
        yield lambda: set_mode(flush)
    finally:
        set_mode(True)
