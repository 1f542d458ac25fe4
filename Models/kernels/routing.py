"""The type router's fused kernels: the SwiGLU router as one op each way (training), and a decode
step's whole routing (router, sigmoid, Gamma, selection) in one op. Their plain references are
the model's own modules (Models/Routing.py)."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .linear import plain_linear
from .switch import Kernel


# The SwiGLU router with its gradients, one op each way, w1 and w3 as one matrix (cpp/swiglu_router_*.cc)
SWIGLU_ROUTER_HEADER = cpp.source("sgemm_ops.h")
SWIGLU_ROUTER_FORWARD = cpp.source("swiglu_router_forward.cc")
SWIGLU_ROUTER_BACKWARD = cpp.source("swiglu_router_backward.cc")


class SwiGLURouterOp(jt.Function):
    """w2(silu(w1 x + b1) * (w3 x + b3)) + b2 for x [M,D]; keeps x and the [M,2H] pre-activations."""

    def execute(self, x, w1, b1, w3, b3, w2, b2):
        (M, D), H, NT = x.shape, w1.shape[0], w2.shape[0]
        self.numbers = cpp.Numbers().declare(M=M, D=D, H=H, NT=NT)
        logits, gu = jt.code([(M, NT), (M, 2 * H)], ["float32"] * 2, [x, w1, b1, w3, b3, w2, b2],
                             cpu_header=SWIGLU_ROUTER_HEADER, cpu_src=self.numbers.code + SWIGLU_ROUTER_FORWARD,
                             data=self.numbers.data)
        self.saved = (x, w1, w3, w2, b1, b3, b2, gu.detach())
        return logits

    def grad(self, grad_logits):
        x, w1, w3, w2, b1, b3, b2, gu = self.saved
        shapes = [x.shape, w1.shape, b1.shape, w3.shape, b3.shape, w2.shape, b2.shape]
        return tuple(jt.code(shapes, ["float32"] * 7, [x, w1, w3, w2, gu, grad_logits],
                             cpu_header=SWIGLU_ROUTER_HEADER, cpu_src=self.numbers.code + SWIGLU_ROUTER_BACKWARD,
                             data=self.numbers.data))


def fused_swiglu_router(x, w1, b1, w3, b3, w2, b2):
    rows = x.shape[:-1]
    logits = SwiGLURouterOp.apply(x.float32().reshape(-1, x.shape[-1]), w1, b1, w3, b3, w2, b2)
    return logits.reshape(*rows, w2.shape[0])


def plain_swiglu_router(x, w1, b1, w3, b3, w2, b2):
    return plain_linear(nn.silu(plain_linear(x, w1, b1)) * plain_linear(x, w3, b3), w2, b2)


# x [..., D] -> logits [..., NT]: w2 [NT,H], b2; w1, w3 [H,D], b1, b3; all fp32
swiglu_router = Kernel(fused_swiglu_router, plain_swiglu_router)


# The same for a few rows and no gradient (a decode step): every output in one op, per row the
# router (SwiGLU or Linear), the sigmoid, Gamma and the selection (cpp/route_row.cc)
TYPE_WEIGHTS_HEADER = cpp.source("router.h")
TYPE_WEIGHTS = cpp.source("type_weights.cc")


def declare_router(inputs: cpp.CodeInputs, router, threshold_fn, dim: int) -> int:
    """Declare the router's (and learned Gamma's) weights on `inputs` as cpp/route_row.cc reads them,
    with the router's sizes; returns the number of types. router None (a layer without experts):
    no inputs and zero types."""
    swiglu = hasattr(router, "w1")  # a SwiGLU router, else a Linear
    output = router.w2 if swiglu else router  # the layer with a row per type
    sparse = threshold_fn is not None
    learned = sparse and not threshold_fn.const
    n_types = output.weight.shape[0] if output is not None else 0
    inputs.declare(D=dim, NT=n_types, HIDDEN=router.w1.weight.shape[0] if swiglu else 0)
    inputs.declare("bool", SPARSE=sparse, LEARNED=learned)
    inputs.declare("float", MAX_THRESHOLD=float(threshold_fn.max_threshold) if sparse else 0.0)
    weights = {}
    if swiglu:
        weights.update(W1=router.w1.weight, B1=router.w1.bias, W3=router.w3.weight, B3=router.w3.bias)
    if output is not None:
        weights.update(W2=output.weight, B2=output.bias)
    if learned:
        weights.update(GW=threshold_fn.weight, GB=threshold_fn.bias)
    for name in ("W1", "B1", "W3", "B3", "W2", "B2", "GW", "GB"):
        inputs.add(name, weights.get(name))
    return n_types


def fused_type_weights(x: jt.Var, router: nn.Module, threshold_fn, gamma_grad: str):
    B, T, D = x.shape
    inputs, outputs = cpp.CodeInputs(), cpp.CodeOutputs()
    inputs.pointer(x.float32().reshape(B * T, D))  # in0_p
    n_types = declare_router(inputs, router, threshold_fn, D)
    outputs.pointer((B * T, n_types))  # out0_p: the type weights
    sparse = threshold_fn is not None
    if sparse:
        outputs.pointer((B * T, 1))  # out1_p: Gamma
    columns = [outputs.pointer((B * T,)) for _ in range(n_types)]
    inputs.declare(M=B * T)
    inputs.code += "float *columns[] = {" + ", ".join(columns) + "};\n"
    results = jt.code(outputs.shapes, ["float32"] * len(outputs.shapes), inputs.vars,
                      cpu_header=TYPE_WEIGHTS_HEADER, cpu_src=inputs.code + TYPE_WEIGHTS, data=inputs.numbers.data)
    probs, gamma = results[0].reshape(B, T, n_types), (results[1].reshape(B, T, 1) if sparse else None)
    return probs, gamma, [column.reshape(B, T) for column in results[len(results) - n_types:]]
