"""Random inputs of the fused kernels' tests (tests/test_kernels.py, tests/test_projection_kernels.py, the random cases
of tests/kernel_cases.py) and the denormal mode they run in."""
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


# What the data inputs of a case hold (weights stay normal): their normwise error is checked for each
VALUES = ("normal", "large", "tiny", "subnormal", "zeros", "mixed")

def values(rng, shape, kind: str, scale: float = 1.0) -> np.ndarray:
    """float32 `shape` of the kind: normal N(0, scale^2); large up to 1e8; tiny 1e-38 to 1e-19 (products
    and squares subnormal); subnormal; zeros; mixed: normal with a quarter of the entries of the others."""
    n = rng.standard_normal(shape)
    if kind == "normal":
        out = scale * n
    elif kind == "large":
        out = n * 10.0 ** rng.uniform(3, 8)
    elif kind == "tiny":
        out = n * 10.0 ** rng.uniform(-38, -19, shape)
    elif kind == "subnormal":
        out = n * 1e-40
    elif kind == "zeros":
        out = np.zeros(shape)
    else:
        out = scale * n
        mask = rng.random(shape) < 0.25
        other = VALUES[1 + rng.integers(0, 4)]
        out[mask] = values(rng, shape, other)[mask]
    return np.asarray(out, np.float32)


def var(rng, shape, kind="normal", scale=1.0):
    return jt.array(values(rng, shape, kind, scale))


def gates(rng, shape, kind, scale=1.0, bound=100.0):
    """A SwiGLU's gates of the kind within +-bound: past that the plain side's autograd of silu (s (1 + g (1 - s)),
    1 - s from a rounded s) is off by about |g| 2^-24 relative, where the fused one stays exact
    (test_kernels.py::test_swiglu_past_exp_range checks it against float64 up to 3e7)."""
    return jt.array(np.clip(values(rng, shape, kind, scale), -bound, bound))


def odd(rng, low, high):
    """A size in [low, high], odd more often than not (off any vector width)."""
    n = int(rng.integers(low, high + 1))
    return n | 1 if rng.random() < 0.7 else n


def storage(rng, K: int):
    """A base storage for a matrix of in-dimension K (nf4, uint8, where K is even: two codes a byte)."""
    return ["float32", "bfloat16", "int8", "uint8"][rng.integers(0, 4 if K % 2 == 0 else 3)]


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
