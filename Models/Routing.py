"""Routing between expert types: the per-token type router and Sparse MoA's threshold Gamma, the
instance-level routers of the baselines (one decision per sequence), and LayerRoute, which carries
one layer's decisions to its experts."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .kernels.linear import Linear, linear
from .kernels.routing import fused_type_weights, swiglu_router
from .kernels.switch import Kernel, decoding


def biased_linear(in_features: int, out_features: int) -> Linear:
    layer = Linear(in_features, out_features, bias=True)
    layer.bias = jt.zeros((out_features,), "float32")
    return layer


class SwiGLURouter(nn.Module):
    """w2(silu(w1 x) * w3 x) with hidden size n_types * swi_x, biases on (zero at start)."""

    def __init__(self, dim: int, n_types: int, swi_x: int):
        hidden = n_types * swi_x
        self.w1 = biased_linear(dim, hidden)
        self.w3 = biased_linear(dim, hidden)
        self.w2 = biased_linear(hidden, n_types)

    def execute(self, x: jt.Var) -> jt.Var:
        # x [B,T,D] -> logits [B,T,n_types]
        return swiglu_router(x, self.w1.weight, self.w1.bias, self.w3.weight, self.w3.bias, self.w2.weight, self.w2.bias)


def type_router(dim: int, n_types: int, swi_x: int) -> nn.Module:
    """The heterogeneous router: Linear when swi_x == 0, else SwiGLU."""
    return biased_linear(dim, n_types) if swi_x == 0 else SwiGLURouter(dim, n_types, swi_x)


STE_TEMPERATURE = 0.1


def hard_select(probs: jt.Var, gamma: jt.Var, gamma_grad: str) -> jt.Var:
    """1[probs - gamma >= 0] as float.

    "authors": a plain step, no gradient reaches Gamma (the PyTorch release).
    "ste": the same forward value; the backward uses the slope of
    sigmoid((probs - gamma) / STE_TEMPERATURE), so Gamma and the router learn where to cut.
    """
    margin = probs - gamma
    step = (margin >= 0).float32().stop_grad()
    if gamma_grad == "authors":
        return step
    surrogate = jt.sigmoid(margin / STE_TEMPERATURE)
    return step + surrogate - surrogate.detach()  # detach copies; stop_grad() would freeze surrogate itself


def plain_type_weights(x: jt.Var, router: nn.Module, threshold_fn, gamma_grad: str):
    """x [B,T,D] -> sigmoid(router(x)) [B,T,n] (Sparse MoA: zero below the threshold), the threshold
    Gamma [B,T,1] (None in Soft MoA), and the weights' n columns [B,T], one per expert type."""
    probs = jt.sigmoid(router(x))
    gamma = None
    if threshold_fn is not None:
        gamma = threshold_fn(x)
        probs = probs * hard_select(probs, gamma, gamma_grad)
    return probs, gamma, [probs[:, :, i] for i in range(probs.shape[-1])]


# x [B,T,D] -> the type weights [B,T,n], Gamma [B,T,1] or None, their n columns [B,T]
type_weights = Kernel(fused_type_weights, plain_type_weights, when=lambda x, *rest: decoding(x))


class Gamma(nn.Module):
    """Per-token threshold: max_threshold * sigmoid(x W^T + b), or the constant max_threshold.

    It holds the Linear's weight and bias itself so that its checkpoint names are
    the authors' `adapter_threshold_fn.weight` / `.bias`.
    """

    def __init__(self, dim: int, max_threshold: float, const: bool):
        self.max_threshold = max_threshold
        self.const = const
        if not const:
            layer = Linear(dim, 1, bias=True)
            self.weight, self.bias = layer.weight, layer.bias

    def execute(self, x: jt.Var) -> jt.Var:
        # x [B,T,D] -> gamma [B,T,1]
        if self.const:
            return jt.full((x.shape[0], x.shape[1], 1), self.max_threshold, "float32")
        return self.max_threshold * jt.sigmoid(linear(x, self.weight, self.bias))


class LayerRoute:
    """One layer's routing in one forward pass, as its experts see it.

    weight(family): the family's weight [B,T] from the layer's router, or None when the method
    weights nothing (the homogeneous baselines add every family as is). Expert mixtures inside a
    family report their own router outputs here (kept when the caller records them, keyed
    output name -> family) and add their load-balancing terms (kept in training).
    """

    def __init__(self, weights: dict, record=None, aux=None):
        self.weights, self.record, self.aux = weights, record, aux

    def weight(self, family: str):
        return self.weights.get(family)

    def report(self, family: str, **outputs):
        if self.record is not None:
            for key, value in outputs.items():
                self.record.setdefault(key, {})[family] = value

    def add_aux(self, family: str, loss: jt.Var):
        if self.aux is not None:
            self.aux.append(loss)
        self.report(family, aux_loss=loss)


def sequence_mean(x: jt.Var) -> jt.Var:
    """The instance-level routers' input: the plain mean of the block input over every position.

    Padding is included, as in the authors' code: their batches are right-padded with token 0,
    so the pads' hidden states move the mean (training pads to max_seq_len for these methods).
    """
    # x [B,T,D] -> [B,1,D]
    return x.mean(dim=1, keepdims=True)


# UniPEFT's gate columns and the block Linear each reads. The authors weight the parallel adapter
# by the prompt's gate: their `p_adapter_gate` is built and saved but never read (frozen here, so
# it keeps its value as their AdamW keeps a parameter without gradient).
UNIPEFT_GATES = {"LORA": "lora_gate", "PROMPT": "prompt_gate", "PADAPTER": "prompt_gate"}


def gradientless_modules(args) -> set:
    """Adapter modules the authors' code gives no gradient, frozen here so that they keep their values as
    their AdamW keeps a parameter without gradient (no weight decay either): UniPEFT's p_adapter_gate
    (never read) and, under gamma_grad='authors', Sparse MoA's threshold Linear (behind a hard step)."""
    if args.method == "unipeft":
        return {"p_adapter_gate"}
    if args.method == "moa" and args.variant == "sparse" and args.gamma_grad == "authors":
        return {"adapter_threshold_fn"}
    return set()
