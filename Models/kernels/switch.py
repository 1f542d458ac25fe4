"""The one switch between fused CPU kernels and plain Jittor ops.

Every choice between a fused op and plain Jittor ops is a `Kernel`: a fused CPU implementation (C++
through jt.code, OpenMP, oneDNN; its source in Models/kernels/cpp/) paired with its plain-Jittor
reference, defined next to each other. `fused_kernels_on()` alone decides which one runs, with the
kernel's own `when` for the inputs its fused side handles; tests call `.fused` and `.plain`
directly and compare values and gradients.
"""
import math
import os

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .cpp import constant

# Products of at most this many rows run as one GEMV pass over the weights (a decode step)
GEMV_ROWS = constant("gemv.h", "GEMV_ROWS")
# ... and with bf16 or int8 weights up to this many rows as one pass of the rows kernel (cpp/bf16_rows.h)
DECODE_ROWS = constant("bf16_rows.h", "DECODE_ROWS")


def gpu_kernels_on() -> bool:
    """Whether the fused ops' CUDA forms (the decode layer's, Models/kernels/cuda/) run: a GPU run with
    MOA_GPU_KERNELS=1. They are compiled and run through a CPU emulation of their CUDA here
    (tests/test_cuda_sources.py) but not yet checked on a GPU (docs/gpu.md: `scripts/gpu_check.sh` sets it);
    until then a GPU run takes the checked plain path by default."""
    return bool(jt.flags.use_cuda) and os.environ.get("MOA_GPU_KERNELS") == "1"


def fused_kernels_on() -> bool:
    """The switch: fused kernels need Jittor's oneDNN (libdnnl found) and a CPU run; a GPU run,
    or a CPU without oneDNN, takes the plain-Jittor references."""
    return jt.compile_extern.mkl_ops is not None and not jt.flags.use_cuda


def decoding(x: jt.Var, weight=None) -> bool:
    """No gradient and at most GEMV_ROWS rows of x [..., K] (DECODE_ROWS for a bf16, int8 or nf4 `weight`, the
    base's): a decode step, whose products read the weights once for all its rows and where the cost
    of each op counts, so the kernels that serve it (a `when`) run a layer's routing, each base
    projection with its expert, or the whole layer as one op."""
    rows = DECODE_ROWS if weight is not None and weight.dtype in ("bfloat16", "int8", "uint8") else GEMV_ROWS
    return jt.flags.no_grad and math.prod(x.shape[:-1]) <= rows


class Kernel:
    """A fused CPU kernel and its plain-Jittor reference; calling it runs the one the switch picks.

    `when(*args)`, if given, further limits the fused kernel to the inputs it handles; the others take
    `plain`. A plain side may be built from other Kernels (each then decided the same way), which is
    also how an op with two fused forms reads: Kernel(fused_for_some, Kernel(fused, plain), when).
    `gpu`: the fused side's ops have a CUDA form too (jt.code's cuda_src), run on a GPU where gpu_kernels_on().
    """

    def __init__(self, fused, plain, when=None, gpu=False):
        self.fused, self.plain, self.when, self.gpu = fused, plain, when, gpu

    def on(self) -> bool:
        """Whether the fused side can run here (the `when` aside)."""
        return fused_kernels_on() or (self.gpu and gpu_kernels_on())

    def __call__(self, *args):
        if self.on() and (self.when is None or self.when(*args)):
            return self.fused(*args)
        return self.plain(*args)
