"""AdamW over the adapter parameters: Jittor's update rule, bias correction counted in updates, and
the whole step as one op.

Jittor's AdamW builds one small fused op per parameter (about 70 at the bench's small config, a
few hundred at 8B), each run alone on one core; here one op walks up to 64 parameters on all cores.
The plain reference is Jittor's per-parameter update, kept next to it (switch.Kernel chooses).
"""
import math

import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt

from . import cpp
from .switch import Kernel

# The update of one element (cpp/adamw.h) and the loop over a call's parameters (cpp/adamw.cc)
ADAMW_HEADER = cpp.source("adamw.h")
ADAMW_LOOP = cpp.source("adamw.cc")
HYPER = 8  # numbers per parameter (step_numbers)


def step_numbers(slot, updates: int) -> list:
    """The per-parameter numbers of adamw_element (cpp/adamw.h) for the `updates`-th update."""
    _, _, _, _, lr, weight_decay, (b0, b1), eps = slot
    return [1 - lr * weight_decay, b0, 1 - b0, b1, 1 - b1, lr / (1 - b0 ** updates), math.sqrt(1 - b1 ** updates), eps]


SLOTS_PER_OP = 64  # Jittor's code op fails to compile with a thousand inputs (4 per parameter)


def fused_adamw_update(slots: list, updates: int):
    """One op per SLOTS_PER_OP parameters: each (p, g, m, v) in slots updated (Var.update) with their numbers."""
    for start in range(0, len(slots), SLOTS_PER_OP):
        adamw_op(slots[start:start + SLOTS_PER_OP], updates)


def adamw_op(slots: list, updates: int):
    hyper = jt.array(np.array([step_numbers(s, updates) for s in slots], dtype=np.float32))
    inputs = [hyper]
    for p, g, m, v, *_ in slots:
        inputs += [p, g, m, v]
    n = len(slots)

    def array(declaration: str, items) -> str:  # a C array of n items
        return f"{declaration}[S] = {{{', '.join(items)}}};\n"
    # the parameters' sizes are their inputs' (in<i>->num), so one compiled op serves every model
    src = (f"const int64_t S = {n}, HYPER = {HYPER};\n"
           + array("const int64_t sizes", (f"in{1 + 4 * i}->num" for i in range(n)))
           + "".join(array(f"const float *{name}", (f"in{1 + k + 4 * i}_p" for i in range(n)))
                     for k, name in enumerate(("params", "grads", "ms", "vs")))
           + "".join(array(f"float *{name}", (f"out{k + 3 * i}_p" for i in range(n)))
                     for k, name in enumerate(("params_out", "ms_out", "vs_out"))))
    shapes = [t.shape for p, _, m, v, *_ in slots for t in (p, m, v)]
    outputs = jt.code(shapes, ["float32"] * len(shapes), inputs,
                      cpu_header=ADAMW_HEADER, cpu_src=src + ADAMW_LOOP)
    for i, (p, _, m, v, *_) in enumerate(slots):
        p.update(outputs[3 * i])
        m.update(outputs[3 * i + 1])
        v.update(outputs[3 * i + 2])


def plain_adamw_update(slots: list, updates: int):
    for slot in slots:
        p, g, m, v = slot[:4]
        decay, b0, _, b1, _, step_size, bc2_root, eps = step_numbers(slot, updates)
        p.update(p * decay)
        m.update(b0 * m + (1 - b0) * g)
        v.update(b1 * v + (1 - b1) * g * g)
        p.update(p - step_size * m / (jt.sqrt(v) / bc2_root + eps))


def exact_for(slots: list, updates: int) -> bool:
    """Whether the fused update is the plain one for every v': it takes sqrt(v') of a subnormal v' as 0
    (cpp/adamw.h), exact while that root over bc2_root (at least sqrt(1 - b1)) stays below a quarter of an
    ulp of eps (2^-25 eps); AdamW's eps 1e-8 leaves a margin of 10^4."""
    return len(slots) > 0 and all(2.0 ** -63 / math.sqrt(1 - b1) < eps * 2.0 ** -25 for *_, (_, b1), eps in slots)


# slots: (param, grad, m, v, lr, weight_decay, betas, eps) per trainable fp32 parameter
adamw_update = Kernel(fused_adamw_update, plain_adamw_update, when=exact_for)


class AdamW(jt.optim.AdamW):
    """jittor.optim.AdamW with bias correction counted in optimizer updates.

    Jittor's own AdamW takes the step count from `n_step`, which backward()
    increments, so under gradient accumulation its bias correction runs ahead.
    The rule is Jittor's: decoupled weight decay p *= 1 - lr * wd per param
    group, and gradients averaged over MPI ranks inside backward().
    """

    def __init__(self, params, lr, eps=1e-8, betas=(0.9, 0.95), weight_decay=0.0):
        super().__init__(params, lr, eps=eps, betas=betas, weight_decay=weight_decay)
        self.updates = 0

    def step(self, loss=None, retain_graph=False):
        self.pre_step(loss, retain_graph)
        self.updates += 1
        slots = []
        for pg in self.param_groups:
            numbers = (pg.get("lr", self.lr), pg.get("weight_decay", self.weight_decay),
                       pg.get("betas", self.betas), pg.get("eps", self.eps))
            slots += [(p, g, m, v, *numbers) for p, g, v, m in zip(pg["params"], pg["grads"], pg["values"], pg["m"])
                      if not p.is_stop_grad()]
        adamw_update(slots, self.updates)
        self.post_step()

    def named_slots(self):
        """name -> (param, m, v) over all groups."""
        return {name: (p, m, v) for pg in self.param_groups
                for name, p, m, v in zip(pg["names"], pg["params"], pg["m"], pg["values"])}

    def state_arrays(self):
        """{'updates', 'm': {name: array}, 'v': {name: array}}; call on every rank."""
        slots = self.named_slots()
        return {"updates": self.updates,
                "m": {name: m.numpy().copy() for name, (_, m, _) in slots.items()},
                "v": {name: v.numpy().copy() for name, (_, _, v) in slots.items()}}

    def load_state_arrays(self, state, source):
        slots = self.named_slots()
        for key in ("m", "v"):
            if set(state[key]) != set(slots):
                raise ValueError(f"{source}: optimizer state names differ from the model's adapter parameters")
        for name, (p, m, v) in slots.items():
            for var, array in ((m, state["m"][name]), (v, state["v"][name])):
                if tuple(array.shape) != tuple(p.shape):
                    raise ValueError(f"{source}: optimizer state of '{name}' has shape {list(array.shape)}")
                var.update(jt.array(np.asarray(array, dtype=np.float32)))
        self.updates = int(state["updates"])


def build_optimizer(model, lr, weight_decay):
    """AdamW over the adapter parameters: weight decay on matrices only, not on 1-D params or biases."""
    decay, no_decay = {}, {}
    for name, p in model.adapter_parameters().items():
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay)[name] = p
    groups = [{"names": list(g), "params": list(g.values()), "weight_decay": wd}
              for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
    return AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
