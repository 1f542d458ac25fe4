"""Seeded random cases of every Kernel pair (Models/kernels): the fused side against its plain reference over
random shapes (odd sizes, one row, sizes off the vector width and the tiles, grouped kv heads, head_dim apart
from dim / heads), base storages (fp32, bf16, int8, nf4) and values (kernel_inputs.VALUES), forward and backward.

tests/test_kernel_pairs.py runs a seeded slice; `python tests/kernel_soak.py --cases N` a soak. The decode
layer (LLM.layer_step) is the one pair not here: it needs a whole model, and tests/test_decode_layer.py runs
it over architectures, variants and storages.
"""
import contextlib
import math
from dataclasses import dataclass, field

import numpy as np

from kernel_inputs import gates, odd, storage, stored, values, var
import jittor as jt
from Models.Block import attention_mask
from Models.Routing import Gamma, swiglu_router, type_router, type_weights
from Models.kernels import adamw, attention, bf16, elementwise, experts, finite, int8, linear, nf4, projections, switch
from Models.rope import rope_tables

FLOOR = 1e-30  # errors are relative to an output's largest value, or to this below it (where flushing to 0 is fine)
# Where a side rounds an fp32 intermediate to bf16 that the two sides compute in another order (a probability,
# a SwiGLU hidden), a value next to a rounding boundary rounds either way: two bf16 ulps of the largest value
BF16_ROUNDED = 2.0 ** -7
# bf16 attention: each probability that rounds the other way moves its term by 2^-8, and an output averages
# many terms, so relative to its largest value the error reaches a few such steps
BF16_AVERAGED = 2.0 ** -5


@dataclass
class Case:
    """kernel.fused(*inputs) against kernel.plain(*inputs); the gradients of the inputs at `wrt` (none: no
    backward) under a random weighting of every output; errors normwise, at most `tol` (gradients: 10 tol; a
    tuple: one per output)."""
    name: str
    kernel: object
    inputs: list
    wrt: list = field(default_factory=list)
    tol: float = 1e-5
    no_grad: bool = False
    describe: str = ""
    # gradients that are sums of the same terms (attention's dq, dk, dv of dS and P): each one's error against the
    # case's largest gradient, since one can be all but cancelled (a softmax over one key, or over tied scores)
    # where the others are not, and rounding is of the terms
    shared_scale: bool = False
    # what the outputs' errors are measured against at the least: their scale where all of them are far below it
    # (a probability's: 2^-24, where one side saturates a sigmoid at 1e-13 and the other at 1e-35)
    floor: float = FLOOR


@contextlib.contextmanager
def all_plain():
    """Every Kernel's plain side, inner ones too (a plain side built from other Kernels)."""
    saved = switch.fused_kernels_on
    switch.fused_kernels_on = lambda: False
    try:
        yield
    finally:
        switch.fused_kernels_on = saved


def normwise(got: np.ndarray, want: np.ndarray, floor: float = FLOOR) -> float:
    """max |got - want| over max |want| (`floor` at least); inf where they are not finite at the same places."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or (np.isfinite(got) != np.isfinite(want)).any():
        return math.inf
    finite = np.isfinite(want)
    if not finite.any():
        return 0.0
    return float(np.abs(got[finite] - want[finite]).max() / max(np.abs(want[finite]).max(), floor))


def outputs_of(result) -> list:
    if isinstance(result, jt.Var):
        return [result]
    return [o for o in result if isinstance(o, jt.Var)]


def over_tolerance(case: Case, forward: list, backward: float) -> float:
    """The case's worst error over its tolerance (forward errors against theirs, the gradients' against 10 times
    the largest); above 1 fails."""
    tols = case.tol if isinstance(case.tol, tuple) else (case.tol,) * len(forward)
    ratio = lambda error, tol: error / tol if tol else (0.0 if error == 0 else math.inf)  # noqa: E731
    return max([ratio(e, t) for e, t in zip(forward, tols)] + [ratio(backward, 10 * max(tols))])


def within(case: Case, forward: list, backward: float) -> bool:
    return over_tolerance(case, forward, backward) <= 1


def run(case: Case, seed: int = 0) -> tuple:
    """(forward errors, one an output; gradient error, worst over the inputs), normwise."""
    if case.name == "adamw_update":
        return [run_adamw(case)], 0.0
    errors, grads = [], []
    for side in ("fused", "plain"):
        with jt.no_grad() if case.no_grad else contextlib.nullcontext(), \
                all_plain() if side == "plain" else contextlib.nullcontext():
            outs = outputs_of(getattr(case.kernel, side)(*case.inputs))
            if case.wrt and not case.no_grad:
                rng = np.random.default_rng(seed)
                loss = sum((o * jt.array(rng.standard_normal(o.shape).astype(np.float32))).sum() for o in outs)
                grads.append([g.numpy() for g in jt.grad(loss, [case.inputs[i] for i in case.wrt])])
            errors.append([o.numpy() for o in outs])
    forward = [normwise(f.astype(np.float64), p.astype(np.float64), case.floor) for f, p in zip(*errors)]
    floor = case.floor
    if grads and case.shared_scale:
        floor = max([FLOOR] + [float(np.abs(p[np.isfinite(p)]).max()) for p in grads[1] if np.isfinite(p).any()])
    backward = max((normwise(f, p, floor) for f, p in zip(*grads)), default=0.0) if grads else 0.0
    return forward, backward


def run_adamw(case: Case) -> float:
    """The update of each slot's (p, m, v) by both sides, from the same state."""
    slots, updates = case.inputs
    results = []
    for update in (adamw.fused_adamw_update, adamw.plain_adamw_update):
        copies = [(p.clone(), g, m.clone(), v.clone(), *rest) for p, g, m, v, *rest in slots]
        update(copies, updates)
        results.append([t.numpy() for p, _, m, v, *_ in copies for t in (p, m, v)])
    return max(normwise(f, p) for f, p in zip(*results))


def case_linear(rng, kind):
    M, K, N = odd(rng, 1, 70), odd(rng, 1, 130), odd(rng, 1, 90)
    bias = rng.random() < 0.5
    x, w = var(rng, (M, K), kind), var(rng, (N, K), scale=K ** -0.5)
    inputs = [x, w] + ([var(rng, (N,))] if bias else [])
    return Case("linear", linear.linear, inputs, list(range(len(inputs))), 1e-5, describe=f"{M}x{K} -> {N}")


def case_base_linear(rng, kind):
    """bf16_linear, int8_linear or nf4_linear: the input (and the backward's gradient) rounded to bf16 by both
    sides. nf4: an even K, most often not a multiple of the groups' 64 or the blocks' 32."""
    M, K, N = odd(rng, 1, 70), odd(rng, 1, 300), odd(rng, 1, 160)
    dtype = ["bfloat16", "int8", "uint8"][rng.integers(0, 3)]
    K += dtype == "uint8" and K % 2
    weight, scale = stored(var(rng, (N, K), scale=K ** -0.5), dtype)
    x = var(rng, (M, K), kind)
    decode = rng.random() < 0.3
    if dtype == "bfloat16":
        return Case("bf16_linear", bf16.bf16_linear, [x, weight], [0], 1e-5, decode, f"{M}x{K} -> {N}")
    name, kernel = ("int8_linear", int8.int8_linear) if dtype == "int8" else ("nf4_linear", nf4.nf4_linear)
    return Case(name, kernel, [x, weight, scale], [0], 1e-5, decode, f"{M}x{K} -> {N}")


def case_quantize(rng, kind):
    N, K = odd(rng, 1, 40), odd(rng, 1, 300)
    # values within one step (a half-way product rounds either way), scales to fp32
    return Case("quantize", int8.quantize, [var(rng, (N, K), kind)], [], (1.01 / 127, 1e-6), True, f"{N}x{K}")


def case_nf4_quantize(rng, kind):
    N, K = odd(rng, 1, 40), 2 * odd(rng, 1, 150)
    # the same codes and scales, bit for bit: both sides divide by the same bf16 scale and compare with the same
    # midpoints
    return Case("nf4_quantize", nf4.nf4_quantize, [var(rng, (N, K), kind)], [], (0.0, 0.0), True, f"{N}x{K}")


def case_attention(rng, kind):
    Hkv = int(rng.integers(1, 4))
    H, hd = Hkv * int(rng.integers(1, 5)), int(rng.integers(1, 20)) * 2
    B, T = int(rng.integers(1, 3)), odd(rng, 1, 140)
    start = 0 if rng.random() < 0.6 else int(rng.integers(0, 70))
    S = start + T
    bf16 = rng.random() < 0.4
    q, k = (scores_input(rng, shape, kind, 3.0) for shape in [(B, T, H, hd), (B, S, Hkv, hd)])
    v = var(rng, (B, S, Hkv, hd))
    return Case("attention", attention.attention, [q, k, v, jt.array(attention_mask(T, S, start)), bf16], [0, 1, 2],
                BF16_AVERAGED if bf16 else 1e-5, describe=f"B{B} T{T} S{S} H{H}/{Hkv} hd{hd} bf16={bf16}",
                shared_scale=True)


def scores_input(rng, shape, kind, bound):
    """q or k of the kind within +-bound (their tiny, subnormal and zero values kept): a softmax's gradient carries
    the scores' rounding (fp32's |s| 2^-24; bf16's q and k, 2^-9 of |s|), which each side makes otherwise, so the
    scores stay below about 60 (bound 3; the prompt's keys are normal); past scores of about 1e10 the plain side's
    softmax (Jittor's ops fused under -Ofast) is NaN, the fused one right."""
    return jt.array(np.clip(values(rng, shape, kind), -bound, bound))


def case_prompt_attention(rng, kind):
    Hkv = int(rng.integers(1, 4))
    H, hd, L = Hkv * int(rng.integers(1, 4)), int(rng.integers(1, 12)), odd(rng, 1, 12)
    B, T = int(rng.integers(1, 3)), odd(rng, 1, 40)
    q = scores_input(rng, (B, T, H, hd), kind, 3.0)
    k, v = var(rng, (L, Hkv * hd)), var(rng, (L, Hkv * hd))
    weighted = rng.random() < 0.7
    tw = jt.array(rng.random((B, T)).astype(np.float32)) if weighted else None
    inputs = [q, k, v, var(rng, (H,)), tw, var(rng, (B, T, H, hd))]
    return Case("prompt_attention", attention.prompt_attention, inputs, [0, 1, 2, 3, 5] + ([4] if weighted else []),
                1e-5, describe=f"T{T} H{H}/{Hkv} hd{hd} L{L}", shared_scale=True)


def case_rope(rng, kind):
    hd, T, start = int(rng.integers(1, 40)) * 2, odd(rng, 1, 30), int(rng.integers(0, 100))
    cos, sin = (jt.array(t[start:start + T]) for t in rope_tables(hd, start + T, 500000.0))
    x = var(rng, (int(rng.integers(1, 3)), T, odd(rng, 1, 5), hd), kind)
    return Case("rope", elementwise.rope, [x, cos, sin], [0], 1e-5, describe=f"T{T} hd{hd}")


def case_output_nll(rng, kind):
    B, T, D, V = int(rng.integers(1, 3)), odd(rng, 1, 90), odd(rng, 2, 40), odd(rng, 2, 1500)
    dtype = storage(rng, D)
    weight, scale = stored(var(rng, (V, D), scale=0.5), dtype)
    targets = jt.array(rng.integers(0, V, (B, T)).astype(np.int32))
    # fp32: the plain side's gradient is the less exact one (up to 6e-4 normwise from float64's where the logits
    # are all 0, the fused 1e-6); bf16 / int8: softmax - onehot rounded to bf16 before the product
    return Case("output_nll", elementwise.output_nll, [var(rng, (B, T, D), kind), weight, targets, scale], [0],
                1e-4 if dtype == "float32" else BF16_ROUNDED, describe=f"{B}x{T}x{D} V{V} {dtype}")


def case_silu_gate(rng, kind):
    shape = (int(rng.integers(1, 3)), odd(rng, 1, 20), odd(rng, 1, 70))
    gate, up = gates(rng, shape, kind, 3.0), var(rng, shape, kind, 3.0)
    # at the least against an ulp of the largest |gate| |up|: past a gate of -80 the fused side's exp is capped (its
    # silu e^-80 |g| where e^g |g| is due, both far below that ulp)
    scale = float(np.abs(gate.numpy()).max() * np.abs(up.numpy()).max()) * 2.0 ** -24
    return Case("silu_gate", elementwise.silu_gate, [gate, up], [0, 1], 1e-5, describe=str(shape),
                floor=max(scale, FLOOR))


def case_rms_norm(rng, kind):
    # two features at least: with one, x / rms(x) is sign(x), whose gradient is 0 up to rounding
    shape = (int(rng.integers(1, 3)), odd(rng, 1, 20), odd(rng, 2, 130))
    weight = jt.array((1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)).stop_grad()
    if rng.random() < 0.5:
        return Case("rms_norm", elementwise.rms_norm, [var(rng, shape, kind), weight, 1e-5], [0], 1e-5,
                    describe=str(shape))
    n = int(rng.integers(1, 4))
    return Case("rms_norm_branches", elementwise.rms_norm_branches, [var(rng, shape, kind), weight, 1e-6, n], [0],
                1e-5, describe=f"{shape} n{n}")


def case_sums(rng, kind):
    shape = (int(rng.integers(1, 3)), odd(rng, 1, 20), odd(rng, 1, 100))
    choice = rng.integers(0, 4)
    if choice == 0:
        return Case("residual_add", elementwise.residual_add, [var(rng, shape, kind), var(rng, shape)], [0, 1])
    if choice == 1:
        n = int(rng.integers(1, 4))
        return Case("branches", elementwise.branches, [var(rng, shape, kind), n], [0], describe=f"n{n}")
    rw = jt.array(rng.random(shape[:2]).astype(np.float32))
    if choice == 2:
        return Case("add_weighted", experts.add_weighted, [var(rng, shape, kind), var(rng, shape), rw, 0.5], [0, 1, 2])
    r = odd(rng, 1, 16)
    bias = var(rng, (shape[-1],)) if rng.random() < 0.5 else None
    inputs = [var(rng, shape, kind), var(rng, (*shape[:2], r), kind), var(rng, (shape[-1], r)), bias, rw, 0.5]
    return Case("add_projected", experts.add_projected, inputs, [0, 1, 2, 4] + ([3] if bias is not None else []),
                describe=f"{shape} r{r}")


def case_gated_projection(rng, kind):
    shape, r = (int(rng.integers(1, 3)), odd(rng, 1, 20), odd(rng, 1, 100)), odd(rng, 1, 16)
    bf16 = bool(rng.random() < 0.5)
    inputs = [gates(rng, shape, kind, 3.0), var(rng, shape, kind, 3.0), var(rng, (r, shape[-1])), bf16]
    return Case("gated_projection", experts.gated_projection, inputs, [0, 1, 2], BF16_ROUNDED if bf16 else 1e-5,
                describe=f"{shape} r{r} bf16={bf16}")


def case_swiglu_router(rng, kind):
    D, hidden, n = odd(rng, 1, 70), odd(rng, 1, 40), odd(rng, 1, 12)
    params = [var(rng, s, scale=0.3) for s in [(hidden, D), (hidden,), (hidden, D), (hidden,), (n, hidden), (n,)]]
    x = gates(rng, (int(rng.integers(1, 3)), odd(rng, 1, 40), D), kind, bound=10.0)  # its gates: x W1
    return Case("swiglu_router", swiglu_router, [x] + params, list(range(7)), 1e-5, describe=f"D{D} h{hidden} n{n}")


def case_type_weights(rng, kind):
    D, n, swi_x = odd(rng, 2, 70), odd(rng, 1, 12), int(rng.integers(0, 5))
    router = type_router(D, n, swi_x)
    for p in router.parameters():
        p.assign(var(rng, p.shape, scale=0.5))
    threshold = ["learned", "const", None][rng.integers(0, 3)]
    gamma = None if threshold is None else Gamma(D, 0.5, threshold == "const")
    # a router's input is a normed hidden state: within 10 (past it the sigmoids saturate, and a Sparse selection
    # at a threshold of exactly 1 is decided by rounding)
    x = gates(rng, (int(rng.integers(1, 5)), 1, D), kind, bound=10.0)
    # probabilities: at the least against 2^-24 (Jittor's sigmoid stops at 1e-13, the fused one's exp at 1e-35);
    # within 1e-4: the SwiGLU router's logits, quadratic in x, reach 10^3 here, and their fp32 rounding in another
    # summation order moves a sigmoid near its middle by a quarter of it
    return Case("type_weights", type_weights, [x, router, gamma, "authors"], [], 1e-4, True,
                f"D{D} n{n} swi_x{swi_x} {threshold}", floor=2.0 ** -24)


def case_projections(rng, kind):
    K = odd(rng, 2, 130)
    dtype = storage(rng, K)
    rows = (odd(rng, 1, 40),) if rng.random() < 0.5 else (int(rng.integers(1, 3)), odd(rng, 1, 30))
    decode = rng.random() < 0.3
    if decode:
        rows = (int(rng.integers(1, switch.GEMV_ROWS + 1)), 1)
    x, items, trained = var(rng, (*rows, K), kind), [], []
    for _ in range(int(rng.integers(1, 4))):
        N, weight = odd(rng, 1, 90), None
        base, scale = stored(var(rng, (N, K), scale=K ** -0.5), dtype)
        if rng.random() < 0.7:
            r = odd(rng, 1, 9)
            A, B = var(rng, (r, K), scale=0.1), var(rng, (N, r), scale=0.1)
            weight = jt.array(rng.random(rows).astype(np.float32)) if rng.random() < 0.6 else None
            trained += [A, B] + ([weight] if weight is not None else [])
            items.append(projections.Projection(base, projections.ExpertTerm(A, B, weight, 2.0), scale))
        else:
            items.append(projections.Projection(base, None, scale))
    inputs = [x, items] + trained  # the trained tensors ride along as inputs for their gradients
    kernel = projections.lora_projections if decode else projections.projections_op
    return Case("lora_projections", ProjectionsOf(kernel), inputs, [] if decode else [0] + list(range(2, len(inputs))),
                1e-5, decode, f"{rows}x{K} {dtype} {len(items)} projections")


class ProjectionsOf:
    """A projections' Kernel called with (x, projections, *their trained tensors), those ignored."""

    def __init__(self, kernel):
        self.fused = lambda x, items, *_: kernel.fused(x, items)
        self.plain = lambda x, items, *_: kernel.plain(x, items)


def case_swiglu_down(rng, kind):
    F, D = odd(rng, 1, 90), odd(rng, 1, 40)
    dtype = storage(rng, F)
    rows = (int(rng.integers(1, 3)), odd(rng, 1, 20))
    gate, up = gates(rng, (*rows, F), kind, 2.0), var(rng, (*rows, F), kind, 2.0)
    base, scale = stored(var(rng, (D, F), scale=F ** -0.5), dtype)
    r = odd(rng, 1, 9)
    A, B, weight = var(rng, (r, F), scale=0.1), var(rng, (D, r), scale=0.1), jt.array(rng.random(rows).astype(np.float32))
    weighted = rng.random() < 0.6
    item = projections.Projection(base, projections.ExpertTerm(A, B, weight if weighted else None, 2.0), scale)
    kernel = projections.swiglu_down if weighted else projections.swiglu_projection_op
    # bf16 / int8: gate and up kept as bf16 bits by both sides, the hidden rounded to bf16 for the product
    return Case("swiglu_down", SwiGLUDownOf(kernel), [gate, up, item, A, B, weight], [0, 1, 3, 4] + ([5] if weighted else []),
                1e-5 if dtype == "float32" else BF16_ROUNDED, describe=f"{rows}x{F} -> {D} {dtype} weighted={weighted}")


class SwiGLUDownOf:
    def __init__(self, kernel):
        self.fused = lambda gate, up, item, *_: kernel.fused(gate, up, item)
        self.plain = lambda gate, up, item, *_: kernel.plain(gate, up, item)


def case_adamw(rng, kind):
    slots = []
    for _ in range(int(rng.integers(1, 5))):
        n = odd(rng, 1, 300)
        p, g = var(rng, (n,), scale=0.02), var(rng, (n,), kind, 1e-3)
        m = var(rng, (n,), "mixed" if kind != "zeros" else "zeros", 1e-4)
        v = jt.array(np.abs(values(rng, (n,), "tiny" if kind in ("tiny", "subnormal") else "normal", 1e-6)))
        slots.append((p, g, m, v, float(10 ** rng.uniform(-6, -2)), float(rng.choice([0.0, 0.02])), (0.9, 0.95), 1e-8))
    updates = int(rng.choice([1, 2, int(rng.integers(3, 3000))]))
    return Case("adamw_update", adamw.adamw_update, [slots, updates], describe=f"{len(slots)} params, update {updates}")


def case_nonfinite(rng, kind):
    tensors = [var(rng, (odd(rng, 1, 200),), kind) for _ in range(int(rng.integers(1, 4)))]
    for t in tensors:
        if rng.random() < 0.5:
            a = t.numpy()
            a[rng.integers(0, a.size, int(rng.integers(1, 4)))] = rng.choice([np.nan, np.inf, -np.inf])
            t.assign(jt.array(a))
    return Case("nonfinite_count", finite.nonfinite_count, [tensors], [], 0.0, True)


BUILDERS = [case_linear, case_base_linear, case_quantize, case_nf4_quantize, case_attention, case_prompt_attention, case_rope,
            case_output_nll, case_silu_gate, case_rms_norm, case_sums, case_gated_projection, case_swiglu_router,
            case_type_weights, case_projections, case_swiglu_down, case_adamw, case_nonfinite]
