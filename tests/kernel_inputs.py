"""Random inputs of the fused kernels' tests (tests/test_kernels.py, tests/test_projection_kernels.py)."""
import numpy as np

import jittor as jt
from Models.kernels.precision import quantize, to_bf16


def normal(rng, shape, scale=1.0):
    return jt.array((scale * rng.standard_normal(shape)).astype(np.float32))


def stored(weight, dtype):
    """A frozen base weight in the base's storage `dtype` and its row scales (int8), else None."""
    if dtype == "int8":
        values, scale = quantize(weight)
        return values.stop_grad(), scale.stop_grad()
    return (weight if dtype == "float32" else to_bf16(weight)).stop_grad(), None
