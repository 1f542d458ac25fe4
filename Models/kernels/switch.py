"""The one switch between fused CPU kernels and plain Jittor ops.

Every fused op of the project is a `Kernel`: a fused CPU implementation (C++ through jt.code,
OpenMP, oneDNN) paired with its plain-Jittor reference, defined next to each other.
`fused_kernels_on()` alone decides which one runs; tests call `.fused` and `.plain` directly and
compare values and gradients.
"""
import math

import Utils.jittor_env  # noqa: F401
import jittor as jt

# Products of at most this many rows run as one GEMV pass over the weights (a decode step)
GEMV_ROWS = 16


def fused_kernels_on() -> bool:
    """The switch: fused kernels need Jittor's oneDNN (libdnnl found) and a CPU run; a GPU run,
    or a CPU without oneDNN, takes the plain-Jittor references."""
    return jt.compile_extern.mkl_ops is not None and not jt.flags.use_cuda


def decoding(x: jt.Var) -> bool:
    """Fused kernels, no gradient and at most GEMV_ROWS rows of x [..., K]: a decode step, where
    the cost of each op dominates, so a layer's routing and each base projection with its expert
    run as one op (Routing.type_weights, projections.lora_projections, decode_layer)."""
    return jt.flags.no_grad and fused_kernels_on() and math.prod(x.shape[:-1]) <= GEMV_ROWS


class Kernel:
    """A fused CPU kernel and its plain-Jittor reference; calling it runs the one the switch picks.

    `when(*args)`, if given, further limits the fused kernel to the inputs it handles.
    """

    def __init__(self, fused, plain, when=None):
        self.fused, self.plain, self.when = fused, plain, when

    def __call__(self, *args):
        if fused_kernels_on() and (self.when is None or self.when(*args)):
            return self.fused(*args)
        return self.plain(*args)
