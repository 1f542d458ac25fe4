"""LLaMA_adapter: a frozen LLaMA-3 base with MoA experts, the masked loss, router records.

One naming rule drives freezing, the optimiser and saving: a parameter is an
adapter parameter when its name contains `lora`, `prompt` or `adapter` (which
catches the authors' `adapter_type_router` and `adapter_threshold_fn`, and the
baselines' routers and gates). Adapter parameters the authors' code gives no gradient
(Routing.gradientless_modules) are saved but frozen, as their AdamW leaves them alone.
"""
from collections import Counter

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .kernels.elementwise import output_nll
from .LLM import LLaMA
from .ModelArgs import SPARSE_MOE_METHODS, ModelArgs
from .kernels.precision import SCALE_SUFFIX, matrix_shape, set_base_precision
from .Routing import gradientless_modules

ADAPTER_KEYS = ("lora", "prompt", "adapter")
EXPERT_FAMILIES = {"lora_Q": "Q", "lora_K": "K", "lora_V": "V", "lora_O": "O", "lora_UP": "FFN_UP",
                   "lora_GATE": "FFN_GATE", "lora_DOWN": "FFN_DOWN", "prompt": "PROMPT", "prompt_gate": "PROMPT",
                   "p_adapter": "PADAPTER", "adapter_type_router": "ROUTER", "adapter_threshold_fn": "GAMMA",
                   "lora_gate": "ROUTER", "p_adapter_gate": "ROUTER"}


def is_adapter_param(name: str) -> bool:
    return any(key in name for key in ADAPTER_KEYS)


def expert_family(name: str) -> str:
    """The expert type a parameter belongs to, for the per-type parameter count."""
    parts = name.split(".")
    for before, part in zip(["", *parts], parts):
        if part == "prompt_gate" and before.isdigit():  # UniPEFT's block-level gate, not attention's
            return "ROUTER"
        if part in EXPERT_FAMILIES:
            return EXPERT_FAMILIES[part]
    return "BASE"


class LLaMA_adapter(nn.Module):
    def __init__(self, args: ModelArgs):
        self.args = args
        self.llama = LLaMA(args)
        set_base_precision(self, args.precision)  # also freezes the base

    def freeze_base(self):
        frozen = gradientless_modules(self.args)
        for name, param in self.named_parameters():
            param.requires_grad = is_adapter_param(name) and not frozen.intersection(name.split("."))

    def adapter_parameters(self) -> dict:
        """name -> Var of every trainable (adapter) parameter, in module order."""
        return {name: p for name, p in self.named_parameters() if is_adapter_param(name)}

    def base_parameters(self) -> dict:
        return {name: p for name, p in self.named_parameters() if not is_adapter_param(name)}

    def parameter_counts(self) -> dict:
        """Trainable parameter count per expert type, plus 'total' and 'base' (the checkpoint's: a quantized
        base's scales are not counted, an nf4 matrix's weights are, two a byte)."""
        counts = Counter()
        for name, p in self.named_parameters():
            size = int(np.prod(matrix_shape(p)))
            if is_adapter_param(name):
                counts[expert_family(name)] += size
                counts["total"] += size
            elif not name.endswith(SCALE_SUFFIX):
                counts["base"] += size
        return dict(counts)

    def execute(self, tokens: jt.Var, loss_mask: jt.Var, records=None, with_logits=True):
        """Masked next-token loss.

        tokens [B,T]; loss_mask [B,T] float: loss_mask[:, t] weighs predicting
        tokens[:, t] from the prefix before it (column 0 is never used).
        Returns (loss scalar, logits [B,T,V]), or (loss, None) with with_logits=False:
        the loss itself never holds [B,T,V] logits (output_nll works in row chunks).
        In training, the sparse MoE-LoRA baselines add lb_loss_coeff times the sum of their
        modules' load-balancing terms, as the authors do; `last_loss_parts` keeps both parts.
        """
        aux = [] if self.is_training() and self.args.method in SPARSE_MOE_METHODS else None
        h = self.llama.hidden(tokens, records=records, aux=aux)  # [B,T,D]
        # Position t predicts tokens[:, t+1]; the last position gets a dummy target and
        # weight 0, which spares slicing h[:, :-1] (a [B,T-1,D] copy) both ways.
        B = tokens.shape[0]
        targets = jt.concat([tokens[:, 1:], jt.zeros((B, 1), tokens.dtype)], dim=1)  # [B,T]
        mask = jt.concat([loss_mask[:, 1:].float32(), jt.zeros((B, 1), "float32")], dim=1)
        nll = output_nll(h, self.llama.output.weight, targets, self.llama.output.weight_scale)  # [B,T]
        count = mask.sum()
        loss = (nll * mask).sum() / count.maximum(1.0)
        self.last_loss_parts = {"ce": loss}
        if aux:  # the authors add it only when some target counts
            aux_loss = sum(aux[1:], aux[0])
            self.last_loss_parts["aux"] = aux_loss
            loss = loss + self.args.lb_loss_coeff * aux_loss * (count > 0).float32()
        return loss, (self.llama.output(h) if with_logits else None)
