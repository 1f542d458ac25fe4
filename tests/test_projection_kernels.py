"""The base projections with their LoRA experts, and the SwiGLU with the down projection, as fused ops: equal to
their plain references in values and gradients, in decoding's passes over the weights and in training's."""
import functools

import numpy as np
import pytest

from kernel_inputs import normal, stored
import jittor as jt
from Models.kernels import elementwise
from Models.kernels.elementwise import silu_gate
from Models.kernels.bf16 import bf16_values
from Models.kernels.projections import (ExpertTerm, LoRAProjections, Projection, gemv_lora_projections,
                                        lora_projections, plain_lora_projections, projections_op, swiglu_down,
                                        swiglu_projection_op, swiglu_then_project)
from Models.kernels.switch import GEMV_ROWS, fused_kernels_on

pytestmark = pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")


def projections_case(rng, base_dtype, rows):
    """x and three projections of it: a LoRA expert under a type weight, one unweighted, none."""
    def projection(n, expert=None):
        weight, scale = stored(normal(rng, (n, 96), 0.1), base_dtype)
        return Projection(weight, expert, scale)
    x = normal(rng, (*rows, 96))
    A1, B1, A2, B2 = normal(rng, (8, 96), 0.1), normal(rng, (150, 8), 0.1), normal(rng, (4, 96), 0.1), normal(rng, (40, 4), 0.1)
    weight = jt.array(rng.random(rows).astype(np.float32))
    projections = [projection(150, ExpertTerm(A1, B1, weight, 2.0)), projection(40, ExpertTerm(A2, B2, None, 0.5)),
                   projection(70)]
    return x, projections, [A1, B1, weight, A2, B2]


# 4 rows: GEMV passes, fp32, bf16 or int8 base; 20 rows of a bf16 or int8 base: the rows kernel (cpp/bf16_rows.h)
@pytest.mark.parametrize("base_dtype, rows", [("float32", 4), ("bfloat16", 4), ("bfloat16", 20), ("int8", 4),
                                              ("int8", 20)])
def test_lora_projections_decoding(base_dtype, rows):
    """A decode step's base projections with their LoRA experts: one pass over each weight (inference)."""
    x, projections, _ = projections_case(np.random.default_rng(12), base_dtype, (rows, 1))
    with jt.no_grad():
        assert lora_projections.when(x, projections)
        for got, want in zip(gemv_lora_projections(x, projections), plain_lora_projections(x, projections)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-5)
            assert got.shape == want.shape == [rows, 1, want.shape[-1]]
    with jt.no_grad():  # an fp32 base above GEMV_ROWS rows takes training's kernels
        assert not lora_projections.when(normal(np.random.default_rng(0), (GEMV_ROWS + 1, 96)),
                                         [Projection(projections[0].base_weight.float32())])


# 2 x 40 rows: training's sgemm (or bf16 units) path; 3 rows: a short batch with gradients, whose bf16
# and int8 forward adds the base's GEMV pass onto the expert's output
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [(2, 40), (3, 1)])
def test_lora_projections_with_gradients(base_dtype, rows):
    """Projections of one input with their LoRA experts as one op each way (training): the outputs,
    and dx (summed over the projections), dA, dB and the type weight's gradient as the op-by-op
    reference gives them."""
    rng = np.random.default_rng(14)
    x, projections, trained = projections_case(rng, base_dtype, rows)
    fused, plain = projections_op.fused(x, projections), projections_op.plain(x, projections)
    out_grads = [normal(rng, out.shape) for out in plain]
    for got, want in zip(fused, plain):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=2e-5)
    loss = [sum((out * g).sum() for out, g in zip(outputs, out_grads)) for outputs in (fused, plain)]
    for got, want in zip(jt.grad(loss[0], [x] + trained), jt.grad(loss[1], [x] + trained)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_lora_projections_of_a_stop_grad_input(base_dtype, monkeypatch):
    """Layer 0's projections read the normed rows of the frozen embedding (stop-grad: LLaMA.hidden): the
    op computes no dx for them, and the experts' gradients are the bits of the op with dx and, within
    rounding, the op-by-op reference's."""
    rng = np.random.default_rng(16)
    x, projections, trained = projections_case(rng, base_dtype, (2, 40))
    scale = jt.array((1 + 0.1 * rng.standard_normal(96)).astype(np.float32)).stop_grad()
    out_grads = [normal(rng, (2, 40, p.base_weight.shape[0])) for p in projections]
    asked, input_grads_code = [], LoRAProjections.input_grads_code

    def spy(self, pointers, outputs, needs_x, needs_dx):
        asked.append(needs_dx)
        return input_grads_code(self, pointers, outputs, needs_x, needs_dx)
    monkeypatch.setattr(LoRAProjections, "input_grads_code", spy)

    def expert_grads(run, x):
        normed = elementwise.rms_norm_branches.fused(x, scale, 1e-5, 1)[0]
        loss = sum((out * g).sum() for out, g in zip(run(normed, projections), out_grads))
        return [g.numpy() for g in jt.grad(loss, trained)]
    frozen = (x * 1).stop_grad()
    no_dx, with_dx = expert_grads(projections_op.fused, frozen), expert_grads(projections_op.fused, x)
    assert asked == [False, True]
    for got, same, want in zip(no_dx, with_dx, expert_grads(projections_op.plain, frozen)):
        np.testing.assert_array_equal(got, same)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "int8"])
def test_swiglu_down(base_dtype):
    """The FFN's down projection with its LoRA expert under a type weight: the SwiGLU hidden and its
    low-rank view in one op (the hidden rebuilt in the backward), against silu_gate then the
    projections' kernel; outputs and the gradients of gate, up, A, B and the type weight."""
    rng = np.random.default_rng(17)
    gate, up = normal(rng, (2, 9, 40), 2.0), normal(rng, (2, 9, 40), 2.0)
    base, scale = stored(normal(rng, (24, 40), 0.1), base_dtype)
    A, B, weight = normal(rng, (4, 40), 0.1), normal(rng, (24, 4), 0.1), jt.array(rng.random((2, 9)).astype(np.float32))
    projection = Projection(base, ExpertTerm(A, B, weight, 2.0), scale)
    assert swiglu_down.when(gate, up, projection)
    fused, plain = swiglu_down.fused(gate, up, projection), swiglu_then_project(gate, up, projection)
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=2e-5)
    out_grad, wrt = normal(rng, fused.shape), [gate, up, A, B, weight]
    for got, want in zip(jt.grad((fused * out_grad).sum(), wrt), jt.grad((plain * out_grad).sum(), wrt)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("has_expert", [True, False])
def test_swiglu_projection(base_dtype, weighted, has_expert):
    """Training's FFN down projection with the SwiGLU inside the projections' op, which rebuilds the
    hidden in the backward instead of keeping it (plain LoRA's unweighted expert, a weighted one, none):
    exactly the numbers of silu_gate then the projections' kernel (the same passes; within an ulp where
    training keeps gate and up as bf16 bits), and the plain references' within rounding; outputs and the
    gradients of gate, up and the expert's parameters."""
    rng = np.random.default_rng(18)
    gate, up = normal(rng, (2, 9, 40), 2.0), normal(rng, (2, 9, 40), 2.0)
    base, _ = stored(normal(rng, (24, 40), 0.1), base_dtype)
    A, B, weight = normal(rng, (4, 40), 0.1), normal(rng, (24, 4), 0.1), jt.array(rng.random((2, 9)).astype(np.float32))
    trained = ([A, B] + ([weight] if weighted else [])) if has_expert else []
    projection = Projection(base, ExpertTerm(A, B, weight if weighted else None, 2.0) if has_expert else None)
    assert swiglu_projection_op.when(gate, up, projection)
    fused = swiglu_projection_op.fused(gate, up, projection)
    op_by_op = swiglu_then_project(gate, up, projection)
    kept = [bf16_values(t) for t in (gate, up)] if base_dtype != "float32" else (gate, up)  # training's rounding
    plain = projections_op.plain(silu_gate.plain(*kept), [projection])[0]
    out_grad, wrt = normal(rng, fused.shape), [gate, up] + trained
    grads = [jt.grad((out * out_grad).sum(), wrt) for out in (fused, op_by_op, plain)]
    # bf16 bits widened in the op: its exp loop vectorises otherwise than fp32's, an ulp apart
    same = np.testing.assert_array_equal if base_dtype == "float32" else \
        functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6)
    same(fused.numpy(), op_by_op.numpy())
    np.testing.assert_allclose(fused.numpy(), plain.numpy(), rtol=1e-5, atol=2e-5)
    for got, by_op, want in zip(*grads):
        same(got.numpy(), by_op.numpy())
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=2e-4)
