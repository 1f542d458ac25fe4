"""The fused AdamW update equals the plain one and IEEE float32's where the second moment is zero, subnormal
or infinite, whatever the CPU's denormal modes (cpp/adamw.h says why those cases are settled apart)."""
import numpy as np
import pytest

from kernel_inputs import denormal_mode
import jittor as jt
from Models.kernels.adamw import exact_for, fused_adamw_update, plain_adamw_update, step_numbers
from Models.kernels.switch import fused_kernels_on

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")

LR, WD, BETAS, EPS = 1e-3, 0.02, (0.9, 0.95), 1e-8


def ieee_update(p, g, m, v, updates):
    """numpy's float32 (subnormals kept, sqrt and division exact) in adamw_element's order."""
    decay, b0, c0, b1, c1, step_size, bc2_root, eps = (np.float32(h) for h in
                                                       step_numbers((0, 0, 0, 0, LR, WD, BETAS, EPS), updates))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        m2, v2 = b0 * m + c0 * g, b1 * v + c1 * g * g
        return p * decay - step_size * m2 / (np.sqrt(v2) / bc2_root + eps), m2, v2


def updated(update, p, g, m, v, updates):
    slot = [jt.array(t) for t in (p, g, m, v)]
    update([(*slot, LR, WD, BETAS, EPS)], updates)
    return [t.numpy() for t in (slot[0], slot[2], slot[3])]


# 30, 48, 54: vector loops of 16 lanes with an 8-lane rest per thread, which took the NaN; 45, 1030 others
@pytest.mark.parametrize("flush", [False, True], ids=["denormals", "flushed"])
@pytest.mark.parametrize("n", [30, 45, 48, 54, 1030])
def test_second_moments_zero_subnormal_and_infinite(n, flush):
    """g of 1e-19 to 4.9e-19 makes (1 - b1) g^2 subnormal; 1e20 makes g^2 overflow to inf (the step is then
    m' / inf = 0); decayed moments around 1e-42; a NaN gradient stays NaN."""
    rng = np.random.default_rng(n)
    grads = [2.6e-19, 1e-19, 4.9e-19, 1.1e-19, 0.0, 1e-30, 1e20, -1e20, np.nan]
    g = rng.choice(np.array(grads, np.float32), n).astype(np.float32)
    p = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    m = rng.choice(np.array([0, 1e-42, -3e-39, 1e-6], np.float32), n)
    v = rng.choice(np.array([0, 1.1e-42, 4e-39, 1e-9], np.float32), n)
    with denormal_mode(flush) as set_again:
        updated(fused_adamw_update, p, g, m, v, 1), updated(plain_adamw_update, p, g, m, v, 1)  # compiled
        for updates in (1, 2, 1500):
            set_again()
            fused, plain = updated(fused_adamw_update, p, g, m, v, updates), updated(plain_adamw_update, p, g, m, v, updates)
            want = ieee_update(p, g, m, v, updates)
            nan = np.isnan(g)
            assert np.isnan(fused[0][nan]).all() and np.isfinite(fused[0][~nan]).all()
            np.testing.assert_allclose(fused[0], want[0], rtol=5e-6, atol=1e-12)  # vectorised division: 2 ulps
            np.testing.assert_allclose(fused[0][~nan], plain[0][~nan], rtol=5e-6, atol=1e-12)
            for got, expected in zip(fused[1:], want[1:]):  # the moments: flushed or not, as the mode says
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1.2e-38)


def test_an_expert_switched_off_for_2000_updates_comes_back():
    """A parameter whose gradient is 0 for 2,000 updates (Sparse MoA's threshold keeping an expert off): its
    moments decay through the subnormals to 0, the weights only decay; then its gradient returns. Fused and
    plain stay finite and equal at every stage, in either denormal mode."""
    n = 54
    for flush in (False, True):
        with denormal_mode(flush) as set_again:
            states = {}
            for name, update in (("fused", fused_adamw_update), ("plain", plain_adamw_update)):
                rng = np.random.default_rng(3)  # one state for both
                p, m, v = (jt.array((rng.standard_normal(n) * s).astype(np.float32)) for s in (0.02, 1e-4, 0))
                v.assign(jt.array(np.full(n, 1e-8, np.float32)))
                g = jt.array((rng.standard_normal(n) * 1e-3).astype(np.float32))
                zero = jt.zeros(n, "float32")
                p.sync(), g.sync(), zero.sync()
                set_again()
                for updates in range(1, 2102):
                    update([(p, g if updates <= 50 or updates > 2050 else zero, m, v, LR, WD, BETAS, EPS)], updates)
                    jt.sync([p, m, v])  # as training's step does: 2,000 updates left lazy make one huge graph
                    if updates in (50, 1000, 2050, 2101):
                        states.setdefault(name, []).append([t.numpy().copy() for t in (p, m, v)])
        assert np.abs(states["fused"][2][2]).max() < 1e-38  # v decayed to the subnormals or 0
        for stage_fused, stage_plain in zip(states["fused"], states["plain"]):
            for got, want in zip(stage_fused, stage_plain):
                assert np.isfinite(got).all()
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


def test_the_fused_update_is_kept_to_an_eps_it_is_exact_for():
    slot = (None, None, None, None, LR, WD, BETAS)
    assert exact_for([(*slot, 1e-8)], 1) and not exact_for([(*slot, 1e-14)], 1) and not exact_for([], 1)
