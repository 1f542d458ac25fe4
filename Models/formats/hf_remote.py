"""MoA adapters as a folder stock transformers loads with trust_remote_code: config.json (our MoAConfig, the base
named by path or hub id), moa_adapter.safetensors (the adapter's tensors) and the torch modeling files of
hf_remote_code/ (copied, never imported here), plus the base's tokenizer files.

The tensors keep our names under the HF module each expert sits in (`llama.layers.N.attention.lora_Q.lora_A.weight`
-> `model.layers.N.self_attn.lora_Q.lora_A.weight`, `feed_forward` -> `mlp`, the layer's routers under
`model.layers.N`), so hf_remote_code/modeling_moa.py attaches the same modules by the same names. The Q and K
experts' B rows (any lora_B under lora_Q or lora_K, mixtures included) go to HF's q/k row order (hf.to_hf_rows):
they add to HF's q_proj/k_proj outputs. Nothing else is in a head's element order: the routers and A read the
layer's input, the prompt's keys go through HF's own k_proj, the attention's output per head follows v_proj.
"""
import os

from ..ModelArgs import ModelArgs
from .hf import to_hf_rows

MODELING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_remote_code")
MODELING_FILES = ("configuration_moa.py", "experts_moa.py", "modeling_moa.py")
REMOTE_WEIGHTS = "moa_adapter.safetensors"
REMOTE_CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GENERATION_CONFIG = "generation_config.json"  # the base's token ids with the run's decoding
PARENTS = {"attention": "self_attn", "feed_forward": "mlp"}
# the HF config.json fields the exported adapter checks its base against when it loads
BASE_CHECKS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size", "vocab_size": "vocab_size"}
MOA_SETTINGS = ("method", "variant", "lora_rank", "lora_alpha", "expert_num", "hydra_moe", "p_adapter_size",
                "p_adapter_hydra", "prompt_len", "swi_x", "max_threshold", "const_threshold", "top_k")


def remote_name(name: str) -> str:
    """Our adapter tensor's name -> its name in the transformers model: 'llama.layers.3.attention.lora_Q.lora_A.weight'
    -> 'model.layers.3.self_attn.lora_Q.lora_A.weight'."""
    _, _, layer, rest = name.split(".", 3)
    parent, _, tail = rest.partition(".")
    return f"model.layers.{layer}.{PARENTS[parent]}.{tail}" if parent in PARENTS else f"model.layers.{layer}.{rest}"


def in_hf_rows(name: str) -> bool:
    """Whether a tensor's rows are a Q or K projection's output (a B of the Q or K experts)."""
    parts = name.split(".")
    return any(p in ("lora_Q", "lora_K") for p in parts) and any(p.startswith("lora_B") for p in parts)


def remote_tensors(arrays: dict, args: ModelArgs) -> dict:
    """Our adapter's tensors -> the exported file's names, Q/K's B rows in HF's order."""
    return {remote_name(name): to_hf_rows(array, args.head_dim) if in_hf_rows(name) else array
            for name, array in arrays.items()}


def remote_settings(args: ModelArgs) -> dict:
    """MoAConfig.moa: the adapter's settings and the precision it trained in, its layers as lists, its targets in the router's families, the
    clamp of MoA's fp16 guard (every method but Sparse MoA), the base's shape it checks."""
    settings = {name: getattr(args, name) for name in MOA_SETTINGS}
    settings.update(trained_precision=args.precision, lora_targets=list(args.targets),
                    lora_layers=sorted(args.lora_layer_set), prompt_layers=sorted(args.prompt_layer_set), p_adapter_layers=sorted(args.p_adapter_layer_set),
                    clamp=not (args.method == "moa" and args.variant == "sparse"),
                    base_config={"model_type": args.architecture,
                                 **{hf: getattr(args, ours) for ours, hf in BASE_CHECKS.items()}})
    return settings


def remote_config(args: ModelArgs, base: str) -> dict:
    """config.json of the exported folder. Its model_type is the base's, one transformers knows: AutoConfig
    without trust_remote_code (AutoTokenizer loads it to choose the tokenizer) then takes transformers' own class
    and asks nothing, where "moa_jittor" made it stop at an interactive trust_remote_code prompt; with
    trust_remote_code, auto_map's MoAConfig reads it. `moa.trained_precision`: the base's precision in training
    (int8, nf4: the exported folder runs the adapter on the full-precision base, whose logits differ)."""
    return {"architectures": ["MoAForCausalLM"], "model_type": args.architecture,
            "auto_map": {"AutoConfig": "configuration_moa.MoAConfig",
                         "AutoModelForCausalLM": "modeling_moa.MoAForCausalLM"},
            "base_model_name_or_path": base, "moa": remote_settings(args)}
