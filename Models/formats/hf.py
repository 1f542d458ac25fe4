"""Hugging Face model folders: config.json + safetensors (+ index) + tokenizer.json, tokenizer_config.json,
generation_config.json -> ModelArgs, the frozen base and the tokenizer; and such a folder written from
our weights (tests, bench/scale.py).

Architectures: LlamaForCausalLM (LLaMA-3; 3.1 with rope_type llama3, its factor, low/high_freq_factor and
original_max_position_embeddings; 3.2 with tied embeddings) and Qwen3ForCausalLM (head_dim its own
setting, per-head q_norm/k_norm, tied or not). Any other architecture, or a config.json field that
changes the computation and is not implemented here, is an error naming config.json and the field.

Names: HF's map one to one onto ours, which are Meta's (hf_name). Rows: HF's rotary embedding rotates
the two halves of each head (rotate_half), Meta's rotates adjacent pairs, and HF's conversion permuted
the rows of q_proj and k_proj to match: per head, HF row c*hd/2 + i is Meta row 2i + c. The loader
undoes it while reading (reading.read_var), q_norm/k_norm's weights too (they scale each element of a
head), so the model keeps Meta's RoPE and an adapter means the same on either layout of one model.
"""
import math
import os
import re
from dataclasses import fields as dataclass_fields

import numpy as np

from Utils.file_io import read_json_object, write_json
from Utils.settings import check_value

from ..LLaMA_Adapter import LLaMA_adapter
from ..ModelArgs import ModelArgs
from ..Tokenizer import HFTokenizer
from . import CheckpointError
from .tensor_match import check_strict
from ..kernels.precision import split_scales
from .reading import fill_base, read_quantized, read_var
from .safetensors import open_checkpoint, save_checkpoint
from .tensor_bytes import TensorSource

CONFIG = "config.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
ROPE_TYPES = {"llama": ("default", "llama3"), "qwen3": ("default",)}
LLAMA3_ROPE = {"factor": "rope_scale_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
               "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
               "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
               "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
               "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight"}
# the tensors whose rows (elements of a head) HF stores as halves, Meta as adjacent pairs
PAIRED = ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight")
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def hf_name(name: str) -> str:
    """Our (Meta's) tensor name -> HF's: 'layers.3.attention.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def paired_head_dim(name: str, args: ModelArgs) -> int:
    """head_dim for a tensor stored with HF's half-split heads, 0 for the others."""
    return args.head_dim if name.split(".", 2)[-1] in PAIRED else 0


# ---- config.json -----------------------------------------------------------------------------------

# config.json's fields that set a ModelArgs field, each checked by that field's declared rule (type,
# bounds) under its config.json name (rope_theta may sit in the RoPE object instead); the required ones,
# and Hugging Face's defaults where they differ from ModelArgs' (num_key_value_heads and head_dim, when
# absent, ModelArgs derives from the others)
SHAPE_FIELDS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
                "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
                "tie_word_embeddings": "tied_embeddings"}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}
MODEL_FIELDS = {f.name: f for f in dataclass_fields(ModelArgs)}
JSON_KINDS = {str: "a string", bool: "true or false", int: "an integer", float: "a finite number", list: "a list",
              dict: "an object"}


def json_field(values: dict, path: str, name: str, kinds: tuple, default=None):
    """Field `name` of the JSON object `values` read from `path` (a dotted name reads inside objects),
    `default` when absent or null. A value of none of `kinds` (float: any finite number; int and float
    never take true or false) is an error naming the file and the field."""
    value = values
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return default if value is None else checked(value, path, name, kinds)


def checked(value, path: str, name: str, kinds: tuple):
    """`value`, the field `name` of `path`, when it is one of `kinds` (json_field); else an error naming them."""
    if not any(is_kind(value, kind) for kind in kinds):
        raise ValueError(f"{path}: field '{name}' is {value!r:.80}, expected {' or '.join(JSON_KINDS[k] for k in kinds)}")
    return value


def is_kind(value, kind) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def config_fields(config: dict, path: str) -> dict:
    """ModelArgs fields of a LlamaForCausalLM / Qwen3ForCausalLM config.json. Every field read is checked
    by its kind (and a shape field by its ModelArgs rule) before anything is computed from it; a wrong
    one, or one that asks for what is not implemented, is an error naming the file and the field."""
    def refuse(name, value, why):
        raise ValueError(f"{path}: {name} {value!r:.80}: {why}, which MoA-Jittor does not implement")
    architectures = json_field(config, path, "architectures", (list,), [])
    if len(architectures) != 1 or not isinstance(architectures[0], str) or architectures[0] not in ARCHITECTURES:
        given = f"{architectures!r:.80}" if config.get("architectures") is not None else "missing"
        raise ValueError(f"{path}: architectures {given}: MoA-Jittor opens "
                         f"{' and '.join(ARCHITECTURES)} (a list of one of them)")
    arch = ARCHITECTURES[architectures[0]]
    if json_field(config, path, "hidden_act", (str,), "silu") != "silu":
        refuse("hidden_act", config["hidden_act"], "an FFN activation other than SiLU")
    for name in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if json_field(config, path, name, (bool,), False):
            refuse(name, config[name], {"use_sliding_window": "sliding-window attention"}.get(name, "biases"))
    if json_field(config, path, "attention_dropout", (float,), 0.0):
        refuse("attention_dropout", config["attention_dropout"], "dropout in attention")
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", quantization) if isinstance(quantization, dict) else quantization
        refuse("quantization_config", method, "quantized weights")
    for i, kind in enumerate(json_field(config, path, "layer_types", (list,), [])):
        if checked(kind, path, f"layer_types[{i}]", (str,)) != "full_attention":
            refuse("layer_types", kind, "an attention other than full attention")
    rope_key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = json_field(config, path, rope_key, (dict,), {})
    rope_type = json_field(config, path, f"{rope_key}.rope_type", (str,),
                           json_field(config, path, f"{rope_key}.type", (str,), "default"))
    if rope_type not in ROPE_TYPES[arch]:
        refuse(f"{rope_key}.rope_type", rope_type, f"a RoPE other than {' or '.join(ROPE_TYPES[arch])} for {arch}")
    partial = json_field(config, path, f"{rope_key}.partial_rotary_factor", (float,),
                         json_field(config, path, "partial_rotary_factor", (float,), 1.0))
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "RoPE on part of each head")
    fields = dict(architecture=arch, qk_norm=arch == "qwen3")
    for name, ours in SHAPE_FIELDS.items():
        if config.get(name) is not None:
            fields[ours] = check_value(MODEL_FIELDS[ours], config[name], path, name)
        elif name in REQUIRED:
            raise ValueError(f"{path}: field '{name}' is missing (the base's shape needs it)")
        elif name in HF_DEFAULTS:
            fields[ours] = HF_DEFAULTS[name]
    if rope.get("rope_theta") is not None:
        fields["rope_theta"] = check_value(MODEL_FIELDS["rope_theta"], rope["rope_theta"], path, f"{rope_key}.rope_theta")
    if rope_type == "llama3":
        fields["use_scaled_rope"] = True
        for name, ours in LLAMA3_ROPE.items():
            if rope.get(name) is None:
                raise ValueError(f"{path}: field '{rope_key}.{name}' is missing (rope_type llama3 needs it)")
            fields[ours] = check_value(MODEL_FIELDS[ours], rope[name], path, f"{rope_key}.{name}")
    return fields


def args_from_config(folder: str, **overrides) -> ModelArgs:
    """The folder's config.json updated with runtime/MoA overrides."""
    path = os.path.join(folder, CONFIG)
    fields = config_fields(read_json_object(path, "model settings"), path)
    try:
        ModelArgs(**fields)  # the file alone: a bad file is bad input, whichever check caught it
    except (TypeError, ValueError) as e:
        named = [f"{ours} is its {theirs}" for theirs, ours in SHAPE_FIELDS.items() if re.search(rf"\b{ours}\b", str(e))]
        raise ValueError(f"{path}: {e}{' (' + ', '.join(named) + ')' if named else ''}") from None
    return ModelArgs(**{**fields, **overrides})  # the overrides' rules: their caller names where they came from


def hf_config(args: ModelArgs) -> dict:
    """config.json of the base `args` describes (the inverse of config_fields)."""
    config = {"architectures": [next(k for k, v in ARCHITECTURES.items() if v == args.architecture)],
              "model_type": args.architecture, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
              "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
              "intermediate_size": args.ffn_hidden_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
              "rope_theta": args.rope_theta, "tie_word_embeddings": args.tied_embeddings, "hidden_act": "silu",
              "attention_bias": False, "max_position_embeddings": args.max_seq_len}
    if args.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dict(zip(LLAMA3_ROPE, args.rope_scaling))}
    return config


# ---- weights ---------------------------------------------------------------------------------------

def load_base(model: LLaMA_adapter, folder: str):
    """Fill the frozen base from the folder's safetensors, tensor by tensor (reading.fill_base)."""
    tensors, source = open_checkpoint(folder)
    args = model.args
    base, scales = split_scales({name[len("llama."):]: var for name, var in model.base_parameters().items()})
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")  # older files: recomputed
               or (args.tied_embeddings and name == "lm_head.weight")}  # tied: the embedding table serves
    check_strict({hf_name(name): var for name, var in base.items()},
                 {name: t.shape for name, t in tensors.items() if name not in ignored}, source, "base")
    for name in base:
        tensor = tensors[hf_name(name)]
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{tensor.path}: tensor '{hf_name(name)}' is {tensor.dtype}, expected one of "
                                  f"{FLOAT_DTYPES}")

    def value_of(name, var, fds):
        t = tensors[hf_name(name)]
        where = (t.path, hf_name(name))
        if name in scales:
            return read_quantized([(fds[t.path], t.offset, 0, t.shape[0], 0, t.shape[1])], t.shape, t.dtype,
                                  paired_head_dim(name, args), where, str(var.dtype))
        return read_var(fds[t.path], t.offset, t.nbytes, t.shape, t.dtype, var.dtype, paired_head_dim(name, args),
                        where)
    fill_base(base, value_of, sorted({t.path for t in tensors.values()}), source, scales)
    model.freeze_base()


def weight_paths(folder: str) -> list:
    """The folder's safetensors files."""
    return sorted({t.path for t in open_checkpoint(folder)[0].values()})


def to_hf_rows(array: np.ndarray, head_dim: int) -> np.ndarray:
    """Meta's row order of a q/k tensor (pairs) -> HF's (halves): Meta row 2i + c becomes HF row c*hd/2 + i."""
    heads = array.reshape(-1, head_dim // 2, 2, int(np.prod(array.shape[1:], dtype=np.int64)))
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(array.shape)


def from_hf_rows(array: np.ndarray, head_dim: int) -> np.ndarray:
    """HF's row order of a q/k tensor (halves) -> Meta's (pairs): the inverse of to_hf_rows."""
    heads = array.reshape(-1, 2, head_dim // 2, int(np.prod(array.shape[1:], dtype=np.int64)))
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(array.shape)


def write_hf_base(folder: str, args: ModelArgs, weights: dict, max_shard_bytes: int = None, bf16: bool = False):
    """config.json and the safetensors of `weights` ({our name: numpy array or tensor_bytes.TensorSource}, the names
    of meta.meta_shapes), in HF's names and row order; sharded with an index above max_shard_bytes."""
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for name, value in weights.items():
        hd = paired_head_dim(name, args)
        if hd and isinstance(value, TensorSource):
            value = TensorSource(value.shape, value.dtype, lambda make=value.make, hd=hd: to_hf_rows(make(), hd))
        elif hd:
            value = to_hf_rows(value, hd)
        tensors[hf_name(name)] = value
    save_checkpoint(tensors, folder, max_shard_bytes, bf16)
    write_json(hf_config(args), os.path.join(folder, CONFIG))


# ---- tokenizer -------------------------------------------------------------------------------------

def open_tokenizer(folder: str, vocab_size: int) -> HFTokenizer:
    """tokenizer.json with its special ids: BOS, EOS and pad from tokenizer_config.json (bos_token, eos_token,
    pad_token; no BOS when bos_token is null or add_bos_token false), the ids that end a generation
    from generation_config.json's eos_token_id (plus EOS). Refused when an id reaches past the
    embedding table of config.json's vocab_size."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no tokenizer.json (training and generating read the folder's tokenizer)")
    tokenizer = HFTokenizer(path)
    settings_path = os.path.join(folder, "tokenizer_config.json")
    generation_path = os.path.join(folder, "generation_config.json")
    settings = read_json_object(settings_path, "tokenizer settings") if os.path.isfile(settings_path) else {}
    generation = read_json_object(generation_path, "generation settings") if os.path.isfile(generation_path) else {}

    def special(field):
        value = settings.get(field)
        text = value.get("content") if isinstance(value, dict) else value
        if text is None:
            return None
        if not isinstance(text, str) or tokenizer.token_id(text) is None:
            raise CheckpointError(f"{settings_path}: {field} {text!r} is not a token of {path}")
        return tokenizer.token_id(text)
    ends = json_field(generation, generation_path, "eos_token_id", (int, list), [])
    ends = [ends] if isinstance(ends, int) else [checked(end, generation_path, f"eos_token_id[{i}]", (int,))
                                                  for i, end in enumerate(ends)]
    if any(end < 0 for end in ends):
        raise CheckpointError(f"{generation_path}: eos_token_id {generation['eos_token_id']!r:.80} is not token ids")
    eos = special("eos_token")
    eos = ends[0] if eos is None and ends else eos
    if eos is None:
        raise CheckpointError(f"{settings_path}: no eos_token (and no eos_token_id in {generation_path}): training "
                              "needs the token that ends an answer")
    bos = special("bos_token") if json_field(settings, settings_path, "add_bos_token", (bool,), True) else None
    tokenizer.use_special_ids(bos, eos, special("pad_token"), {eos, *ends})
    largest = max(tokenizer.n_words - 1, *tokenizer.stop_tokens)
    if largest >= vocab_size:
        raise CheckpointError(f"{path} (with {generation_path}) has token id {largest}, past the vocab_size "
                              f"{vocab_size} of {os.path.join(folder, CONFIG)}: tokenizer and model do not belong "
                              "together")
    return tokenizer
