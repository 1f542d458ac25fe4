"""Every fused kernel equals its plain reference over seeded random cases (tests/kernel_cases.py): random
shapes, storages and values from normal to subnormal, with the CPU's denormal modes (MXCSR's FTZ and DAZ)
on and off in every thread of Jittor's OpenMP pool, since which threads have them depends on which -Ofast
libraries each one loaded. The soak runs many more: `python tests/kernel_soak.py --cases 5000`."""
import numpy as np
import pytest

import kernel_cases
from kernel_inputs import VALUES, denormal_mode
from Models.kernels.switch import fused_kernels_on

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")

CASES_PER_BUILDER = 6  # a case of each value kind, each builder


@pytest.mark.parametrize("builder", kernel_cases.BUILDERS, ids=lambda b: b.__name__[5:])
@pytest.mark.parametrize("flush", [False, True], ids=["denormals", "flushed"])
def test_fused_equals_plain_on_random_cases(builder, flush):
    failures = []
    with denormal_mode(flush) as set_again:
        for i, kind in enumerate(VALUES[:CASES_PER_BUILDER]):
            rng = np.random.default_rng([len(builder.__name__), sum(map(ord, builder.__name__)), i, flush])
            case = builder(rng, kind)
            if not flush:  # compiled first, which flushes in the compiling thread
                kernel_cases.run(case, seed=i)
                set_again()
            forward, backward = kernel_cases.run(case, seed=i)
            if not kernel_cases.within(case, forward, backward):
                failures.append(f"{case.name} {kind} {case.describe}: forward {forward}, gradients {backward}")
    assert not failures, "\n".join(failures)
