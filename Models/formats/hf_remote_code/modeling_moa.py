"""MoA (Mixture of Adapters, arXiv 2506.05928) on a stock transformers LlamaForCausalLM or Qwen3ForCausalLM.

This file is copied into a folder exported by MoA-Jittor (scripts/export_hf.py) and run by transformers:

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

It loads the base the folder names (configuration_moa.MoAConfig.base_model_name_or_path) with transformers'
own class, LlamaForCausalLM or Qwen3ForCausalLM by its model_type (trust_remote_code is not passed on: no code
of the base's folder runs), and adds the adapter's experts to it, reading their tensors from moa_adapter.safetensors. The
returned model is that base model (its forward, KV cache and generate() are transformers'), its modules
carrying the experts (experts_moa.py) as children and forward hooks, under the names MoA-Jittor gives them.

Decoder layer l with input x [B,T,D] (the residual stream), as MoA-Jittor computes it:

    h   = x + Attention(input_layernorm(x))
    out = h + MLP(post_attention_layernorm(h)) + w_PADAPTER * up(silu(down(post_attention_layernorm(h))))

where each projection with an expert (q, k, v, o, gate, up, down: families Q, K, V, O, FFN_GATE, FFN_UP,
FFN_DOWN) computes on its input z

    y = z W^T + w_f * (alpha / r) * (z A^T) B^T                         (LoRA: A [r,in], B [out,r])

and the attention adds the prompt expert (learned rows P [L,D], no RoPE on its keys):

    attn += w_PROMPT * g[h] * softmax(q (P W_k^T)^T / sqrt(hd)) (P W_v^T)

The type weights w [B,T,n], one column per family present in the layer, in the order TYPE_ORDER:

    Soft MoA:    w = sigmoid(R(x))
    Sparse MoA:  w = p * 1[p >= Gamma(x)],  p = sigmoid(R(x)),  Gamma(x) = max_threshold * sigmoid(x W_g^T + b_g)

with R the type router, SwiGLU: R(x) = W_2(silu(W_1 x + b_1) * (W_3 x + b_3)) + b_2 (a Linear when swi_x is 0).
The baselines: `moe` weighs no family (w = 1) and mixes E experts inside a family by softmax(router(z));
`topk` keeps the k most probable of them, renormalised; `adamole` those above sigmoid(threshold(z)) / E,
weighted by the margin; `instance` routes the mean of x over the sequence with R; `unipeft` gives LoRA one
gate and the prompt and adapter another, sigmoid(Linear(mean of x)). Per-sequence decisions are taken on a
whole sequence, or on the prefill of a KV cache and kept for its decode steps.
Every layer output but Sparse MoA's is clamped to +-65500 (MoA's fp16 guard; not in bfloat16).
The q/k rows of HF's checkpoints are in the half-split order of its rotary embedding; the exported Q and K
experts' B were permuted to it.
"""
import os

import torch
from torch import nn
from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedModel, Qwen3ForCausalLM

from .configuration_moa import MoAConfig
from .experts_moa import Gamma, LoRA, MixedLoRA, PAdapter, SparseLoRA, SwiGLURouter, prompt_output, rotate

ADAPTER_FILE = "moa_adapter.safetensors"
TYPE_ORDER = ("Q", "K", "V", "PROMPT", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER")
# family -> (the layer's module, its projection, the expert's name beside it)
PROJECTIONS = {"Q": ("self_attn", "q_proj", "lora_Q"), "K": ("self_attn", "k_proj", "lora_K"),
               "V": ("self_attn", "v_proj", "lora_V"), "O": ("self_attn", "o_proj", "lora_O"),
               "FFN_UP": ("mlp", "up_proj", "lora_UP"), "FFN_GATE": ("mlp", "gate_proj", "lora_GATE"),
               "FFN_DOWN": ("mlp", "down_proj", "lora_DOWN")}
CLAMP = 65500.0
HUB_ONLY = ("revision", "subfolder", "code_revision", "_from_auto", "_commit_hash", "adapter_kwargs")
# the base is loaded by transformers' own class for its model_type, never by code of the base's folder (auto_map):
# trust_remote_code=True was given for this folder's code alone
BASE_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
CONFIG_LOOKUP = ("cache_dir", "force_download", "local_files_only", "token", "proxies")


class LayerExperts:
    """One decoder layer's routing, computed from its input x by the layer's pre-hook and read by its
    experts' hooks in the same forward. `types`: the routed families (router columns), `targets` the
    projections with LoRA."""

    def __init__(self, layer, settings, index, types, targets):
        self.layer, self.s, self.index, self.types, self.targets = layer, settings, index, types, targets
        self.weights, self.kept_gates, self.attention_input, self.rotary, self.queries = {}, None, None, None, None

    def route(self, x, cache):
        s, layer = self.s, self.layer
        if s["method"] == "moa" and self.types:
            probs = torch.sigmoid(layer.adapter_type_router(x))
            if s["variant"] == "sparse":
                probs = probs * (probs >= layer.adapter_threshold_fn(x))
            return {name: probs[..., i:i + 1] for i, name in enumerate(self.types)}
        if s["method"] in ("instance", "unipeft") and self.types:
            if cache is None or cache.get_seq_length(self.index) == 0:  # a whole sequence or a prefill decides
                pooled = x.mean(1, keepdim=True)
                if s["method"] == "instance":
                    self.kept_gates = torch.sigmoid(layer.adapter_type_router(pooled))
                else:
                    gates = {"LORA": layer.lora_gate, "PROMPT": layer.prompt_gate, "PADAPTER": layer.prompt_gate}
                    self.kept_gates = torch.sigmoid(torch.cat([gates[t](pooled) for t in self.types], -1))
            gates = self.kept_gates.expand(x.shape[0], x.shape[1], -1)
            columns = {name: gates[..., i:i + 1] for i, name in enumerate(self.types)}
            if s["method"] == "instance":
                return columns
            weights = {t: columns["LORA"] for t in self.targets if "LORA" in columns}
            weights.update({t: columns[t] for t in ("PROMPT", "PADAPTER") if t in columns})
            return weights
        return {}


def routed_types(settings, present: set) -> list:
    """The families a layer's router weighs, in its columns' order (none for moe, topk, adamole)."""
    if settings["method"] in ("moa", "instance"):
        return [t for t in TYPE_ORDER if t in present]
    if settings["method"] == "unipeft":
        on = {"LORA": bool(present & set(PROJECTIONS)), "PROMPT": "PROMPT" in present,
              "PADAPTER": "PADAPTER" in present}
        return [t for t in ("LORA", "PROMPT", "PADAPTER") if on[t]]
    return []


def add_experts(model, settings):
    """The experts of `settings` (MoAConfig.moa) added to the transformers model: modules and hooks.
    Returns {name: parameter} of what they added, under the model's names."""
    s = settings
    cfg = model.config
    D, H = cfg.hidden_size, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or D // H
    E, added = s["expert_num"], {}
    for index, layer in enumerate(model.model.layers):
        device = layer.input_layernorm.weight.device

        def attach(module, path, name, child):
            setattr(module, name, child.to(device=device, dtype=torch.float32))
            prefix = ".".join(["model.layers", str(index), *path, name])
            added.update({f"{prefix}.{n}": p for n, p in child.named_parameters()})
            return child
        targets = list(s["lora_targets"]) if index in s["lora_layers"] else []
        present = set(targets)
        present |= {"PROMPT"} if index in s["prompt_layers"] else set()
        present |= {"PADAPTER"} if index in s["p_adapter_layers"] else set()
        state = LayerExperts(layer, s, index, routed_types(s, present), targets)
        if state.types and s["method"] in ("moa", "instance"):
            n = len(state.types)
            router = SwiGLURouter(D, n, s["swi_x"]) if s["swi_x"] else nn.Linear(D, n)
            attach(layer, [], "adapter_type_router", router)
            if s["method"] == "moa" and s["variant"] == "sparse":
                attach(layer, [], "adapter_threshold_fn", Gamma(D, s["max_threshold"], s["const_threshold"]))
        if s["method"] == "unipeft":
            for name in dict.fromkeys({"LORA": "lora_gate", "PROMPT": "prompt_gate", "PADAPTER": "prompt_gate"}[t]
                                      for t in state.types):
                attach(layer, [], name, nn.Linear(D, 1))
            if "PADAPTER" in state.types:  # saved by MoA's UniPEFT, never read
                attach(layer, [], "p_adapter_gate", nn.Linear(D, 1))
        for family in state.targets:
            parent, proj, name = PROJECTIONS[family]
            base = getattr(getattr(layer, parent), proj)
            d_out, d_in = base.weight.shape
            if s["method"] in ("topk", "adamole"):
                expert = SparseLoRA(d_in, d_out, s["lora_rank"], E, s["method"], s["top_k"])
            elif E > 1:
                expert = MixedLoRA(d_in, d_out, s["lora_rank"], E, s["hydra_moe"])
            else:
                expert = LoRA(d_in, d_out, s["lora_rank"])
            attach(getattr(layer, parent), [parent], name, expert)
            base.register_forward_hook(lora_hook(state, family, expert, s["lora_alpha"] / s["lora_rank"]))
        if "PROMPT" in present:
            attn = layer.self_attn
            attach(attn, ["self_attn"], "prompt", nn.Embedding(E * s["prompt_len"], D))
            attn.prompt_gate = nn.Parameter(torch.zeros(1, H, 1, 1, device=device))
            added[f"model.layers.{index}.self_attn.prompt_gate"] = attn.prompt_gate
            if E > 1:
                attach(attn, ["self_attn"], "prompt_router", nn.Linear(D, E))
            attn.register_forward_pre_hook(attention_input_hook(state), with_kwargs=True)
            attn.q_proj.register_forward_hook(query_hook(state))
            attn.o_proj.register_forward_pre_hook(prompt_hook(state, attn, hd))
        if "PADAPTER" in present:
            adapter = attach(layer, [], "p_adapter", PAdapter(D, s["p_adapter_size"], E, s["p_adapter_hydra"]))
            layer.mlp.register_forward_hook(adapter_hook(state, adapter))
        layer.register_forward_pre_hook(route_hook(state), with_kwargs=True)
        if s["clamp"]:
            layer.register_forward_hook(clamp_hook)
    return added


def route_hook(state):
    def hook(layer, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).float()
        state.weights = state.route(x, kwargs.get("cache", kwargs.get("past_key_values")))
    return hook


def lora_hook(state, family, expert, scale):
    def hook(base, args, out):
        delta = scale * expert(args[0].float())
        weight = state.weights.get(family)
        return out + (delta if weight is None else weight * delta).to(out.dtype)
    return hook


def attention_input_hook(state):
    def hook(attn, args, kwargs):
        state.attention_input = args[0] if args else kwargs["hidden_states"]
        state.rotary = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    return hook


def query_hook(state):
    def hook(q_proj, args, out):
        state.queries = out
    return hook


def prompt_hook(state, attn, hd):
    def hook(o_proj, args):
        z = state.attention_input
        B, T = z.shape[:2]
        q = state.queries.view(B, T, -1, hd)
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        cos, sin = state.rotary
        q = rotate(q.float(), cos.float(), sin.float())
        out = prompt_output(attn, z.float(), q, state.weights.get("PROMPT"))
        return (args[0] + out.reshape(B, T, -1).to(args[0].dtype),) + tuple(args[1:])
    return hook


def adapter_hook(state, adapter):
    def hook(mlp, args, out):
        delta = adapter(args[0].float())
        weight = state.weights.get("PADAPTER")
        return out + (delta if weight is None else weight * delta).to(out.dtype)
    return hook


def clamp_hook(layer, args, out):
    hidden = out[0] if isinstance(out, tuple) else out
    if hidden.dtype == torch.bfloat16:
        return out
    hidden = hidden.clamp(-CLAMP, CLAMP)
    return (hidden,) + tuple(out[1:]) if isinstance(out, tuple) else hidden


def load_adapter(model, settings, path):
    """The experts added and their tensors read from `path`: every tensor there, and no other."""
    from safetensors.torch import load_file
    params = add_experts(model, settings)
    tensors = load_file(path)
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"{path}: missing adapter tensors {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(param.shape) != tuple(tensors[name].shape):
                raise ValueError(f"{path}: '{name}' has shape {list(tensors[name].shape)}, the model expects "
                                 f"{list(param.shape)}")
            param.copy_(tensors[name])
    return model


class MoAForCausalLM(PreTrainedModel):
    """What AutoModelForCausalLM finds in the folder: from_pretrained returns the base's own model class
    (LlamaForCausalLM or Qwen3ForCausalLM) with the adapter's experts added."""
    config_class = MoAConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        folder = str(pretrained_model_name_or_path)
        hub = {k: kwargs.pop(k) for k in HUB_ONLY if k in kwargs}
        if config is None:
            config = MoAConfig.from_pretrained(folder, **hub)
        base = config.base_model_name_or_path
        if os.path.isdir(folder) and not os.path.isabs(base) and os.path.isdir(os.path.join(folder, base)):
            base = os.path.join(folder, base)  # a base copied beside the adapter
        if os.path.isdir(folder):
            adapter = os.path.join(folder, ADAPTER_FILE)
        else:
            from transformers.utils import cached_file
            adapter = cached_file(folder, ADAPTER_FILE, **{k: v for k, v in hub.items() if k == "revision"})
        expected = config.moa.get("base_config", {})
        kwargs.pop("trust_remote_code", None)  # False for the base: its own class runs, not its folder's code
        found, _ = PretrainedConfig.get_config_dict(base, **{k: kwargs[k] for k in CONFIG_LOOKUP if k in kwargs})
        kind = found.get("model_type")
        if kind != expected.get("model_type") or kind not in BASE_CLASSES:
            raise ValueError(f"{base}: model_type {kind!r}; this adapter was trained on a "
                             f"{expected.get('model_type')!r} base, loaded with transformers' own class")
        model = BASE_CLASSES[kind].from_pretrained(base, *model_args, **kwargs)
        differing = [f"{k}: adapter {v!r}, base {getattr(model.config, k, None)!r}" for k, v in expected.items()
                     if getattr(model.config, k, None) != v]
        if differing:
            raise ValueError(f"{base} is not the base this adapter was trained on: " + "; ".join(differing))
        return load_adapter(model, config.moa, adapter)
