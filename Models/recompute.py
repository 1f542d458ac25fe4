"""Activation recomputation (--recompute): a decoder layer that keeps only its input for the backward.

Jittor differentiates the lazy graph a step builds, so a layer's forward keeps every activation its kernels save
until the backward has read them: at 64 layers of a 32B base, about 75 MB a layer at 300 tokens. Run as a
`Recomputed` Function, the layer's own graph is cut from the loss (Jittor's tape stops the gradient at the
Function's output, and the activations are freed once the forward has run); its `grad` runs the layer's forward
again from the kept input, through the same kernels (so the same numbers), and differentiates that. Jittor calls
`grad` while it builds the backward, from the last layer down, so each layer's second forward is created, and by
the executor's creation order run, after the layers above it have been differentiated: one layer's activations
live at a time.
"""
from contextlib import contextmanager

import Utils.jittor_env  # noqa: F401
import jittor as jt


class Recomputed(jt.Function):
    """layer(x, cos, sin, mask) with the training parameters of `layer` as the Function's inputs (a Function
    hands gradients only to its inputs), and the load-balancing terms the layer adds to `aux` as its further
    outputs (they are in the loss)."""

    def __init__(self, layer, cos: jt.Var, sin: jt.Var, mask: jt.Var, aux):
        self.layer, self.constants, self.aux = layer, (cos, sin, mask), aux
        # the parameters themselves: execute receives taped copies, which the layer's forward does not read
        self.params = [p for p in layer.parameters() if not p.is_stop_grad()]

    def forward(self, x: jt.Var) -> list:
        """[the layer's output, then the terms it added to aux]."""
        added = None if self.aux is None else []
        out = self.layer(x, *self.constants, None, None, added)
        return [out, *(added or [])]

    def execute(self, x, *params):
        with released():
            return self.forward(x)  # this Function's tape cuts their graph from the loss: nothing asks for their grad

    def grad(self, *grads):
        x = self.x.detach()
        if self.x_grad:
            x.start_grad()
        with released():  # once their gradients are built
            terms = [(out * grad.detach()).sum() for out, grad in zip(self.forward(x), grads) if grad is not None]
            found = jt.grad(sum(terms[1:], terms[0]), ([x] if self.x_grad else []) + self.params)
        return ([] if self.x_grad else [None]) + list(found)


@contextmanager
def released():
    """On leaving, drop what each jt.Function called inside keeps for its gradient. A Function that Jittor has
    run stays alive, and the activations it keeps with it, until the whole step's graph has run (its tape
    outlives the run): without this a recomputed layer would free nothing."""
    functions, plain = [], jt.Function.__call__

    def recorded(function, *args):
        functions.append(function)
        return plain(function, *args)
    jt.Function.__call__ = recorded
    try:
        yield functions
    finally:
        jt.Function.__call__ = plain
        for function in functions:
            function.__dict__.clear()


def recomputed(layer, x: jt.Var, cos: jt.Var, sin: jt.Var, mask: jt.Var, aux) -> jt.Var:
    """layer(x, cos, sin, mask, aux=aux), its activations rebuilt in the backward from x."""
    function = Recomputed(layer, cos, sin, mask, aux)
    function.x, function.x_grad = x, not x.is_stop_grad()  # x itself: the Function's tape of it is a copy
    out, *added = function(x, *function.params)
    if aux is not None:
        aux.extend(added)
    return out
