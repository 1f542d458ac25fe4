"""The tiny models as the model tests build and compare them: each kind of expert layer on the tiny bases' three
layers (MOA, BASELINES, MIXTURES: every kind the decode layer takes), adapters drawn at random so that experts and
routers act, the decode layer's steps counted, KV-cache logits and the largest difference of two results."""
import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt
from Models import LLM


def randomize_adapters(model, seed, scale):
    """Every adapter parameter drawn from scale * N(0, 1), so experts and router really act."""
    rng = np.random.default_rng(seed)
    for var in model.adapter_parameters().values():
        var.assign(jt.array((scale * rng.standard_normal(var.shape)).astype(np.float32)))


# MoA on the tiny bases' three layers: Sparse with LoRA on every target and the parallel adapter; Soft with the
# adapter in two layers and prompt experts in two (the decode layer's tests: every expert it fuses)
MOA = {"sparse": dict(variant="sparse", lora_layers="0-2", p_adapter_layers="0-2",
                      lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN"),
       "soft": dict(variant="soft", lora_layers="0-2", p_adapter_layers="0-1", prompt_layers="1-2")}
# The baselines with one expert per family, whose decode steps the decode layer takes too: LoRA (every target,
# weight 1), instance (Soft's experts, weighed by the type router on the sequence mean) and UniPEFT (a gate per
# family from the sequence mean; its adapter layers must be among its prompt layers)
EVERY_TARGET = dict(lora_layers="0-2", lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN")
BASELINES = {"lora": dict(method="moe", expert_num=1, **EVERY_TARGET),
             "instance": dict(method="instance", **MOA["soft"]),
             "unipeft": dict(method="unipeft", variant="soft", lora_layers="0-2", prompt_layers="0-2",
                             p_adapter_layers="1-2")}
# The baselines mixing several LoRA experts per target, which the decode layer gates per row: MoLoRA and HydraLoRA
# (softmax), top-k and AdaMoLE (sparse), four experts each on every target; ranks 8, 12 and 4, so that the low-rank
# pass takes its eight lanes, its lanes and the rest, and the rest alone
MIXTURES = {"molora": dict(method="moe", expert_num=4, **EVERY_TARGET),
            "hydralora": dict(method="moe", expert_num=4, hydra_moe=True, lora_rank=12, **EVERY_TARGET),
            "topk": dict(method="topk", expert_num=4, top_k=2, **EVERY_TARGET),
            "adamole": dict(method="adamole", expert_num=4, lora_rank=4, **EVERY_TARGET),
            # and the mixtures of prompt and adapter experts, gated per row in the decode layer's ops too: Soft MoA
            # with three experts a family (LoRA, prompt, adapter), and the prompt and adapter MoE with one down
            # projection for its adapters' ups (p_adapter_hydra)
            "moa_experts": dict(MOA["soft"], expert_num=3, p_adapter_layers="0-2", prompt_layers="1-2",
                                lora_targets=EVERY_TARGET["lora_targets"]),
            "prompt_adapter_moe": dict(method="moe", expert_num=2, p_adapter_hydra=True, prompt_layers="0-2",
                                       p_adapter_layers="1-2", prompt_len=3)}
DECODE_EXPERTS = {**MOA, **BASELINES, **MIXTURES}  # every kind of layer the decode layer takes


def fused_layer_steps(monkeypatch) -> list:
    """The batch size of each layer step that LLM.layer_step's fused side (the decode layer) runs from now on."""
    fused, steps = LLM.layer_step.fused, []
    monkeypatch.setattr(LLM.layer_step, "fused", lambda *a: steps.append(a[1].shape[0]) or fused(*a))
    return steps


def kv_logits(llama, tokens: np.ndarray, prefill: int) -> np.ndarray:
    """Prefill, then one token at a time; row j = last-position logits of step j."""
    llama.reset_cache()
    rows = [llama(jt.array(tokens[:, :prefill]), start_pos=0)[:, -1].numpy()]
    for pos in range(prefill, tokens.shape[1]):
        rows.append(llama(jt.array(tokens[:, pos:pos + 1]), start_pos=pos)[:, -1].numpy())
    return np.stack(rows, 1)


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
