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
import os

import numpy as np

from Utils.misc import read_json_object, write_json

from ..LLaMA_Adapter import LLaMA_adapter
from ..ModelArgs import ModelArgs
from ..Tokenizer import HFTokenizer
from .adapters import check_strict
from .pth import CheckpointError, TensorSource
from .reading import fill_base, read_var
from .safetensors import open_checkpoint, save_checkpoint

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

def config_fields(config: dict, path: str) -> dict:
    """ModelArgs fields of a LlamaForCausalLM / Qwen3ForCausalLM config.json; what is not implemented is
    an error naming the file and the field."""
    def field(name, kinds, default=None, required=False):
        value = config.get(name, default)
        if value is None and not required:
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"{path}: field '{name}' is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")
        return value

    def refuse(name, value, why):
        raise ValueError(f"{path}: {name} {value!r}: {why}, which MoA-Jittor does not implement")
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in ARCHITECTURES):
        raise ValueError(f"{path}: architectures {architectures!r}: MoA-Jittor opens {' and '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[architectures[0]]
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", config["hidden_act"], "an FFN activation other than SiLU")
    for name in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(name):
            refuse(name, config[name], {"use_sliding_window": "sliding-window attention"}.get(name, "biases"))
    if config.get("attention_dropout"):
        refuse("attention_dropout", config["attention_dropout"], "dropout in attention")
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        refuse("quantization_config", method, "quantized weights")
    other_layers = [t for t in config.get("layer_types") or [] if t != "full_attention"]
    if other_layers:
        refuse("layer_types", other_layers[0], "an attention other than full attention")
    rope_key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = config.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: field '{rope_key}' is {rope!r}, expected an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES[arch]:
        refuse(f"{rope_key}.rope_type", rope_type, f"a RoPE other than {' or '.join(ROPE_TYPES[arch])} for {arch}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "RoPE on part of each head")
    heads = field("num_attention_heads", (int,), required=True)
    fields = dict(architecture=arch, dim=field("hidden_size", (int,), required=True),
                  n_layers=field("num_hidden_layers", (int,), required=True), n_heads=heads,
                  n_kv_heads=field("num_key_value_heads", (int,), heads), head_dim=field("head_dim", (int,)),
                  vocab_size=field("vocab_size", (int,), required=True),
                  ffn_dim=field("intermediate_size", (int,), required=True),
                  norm_eps=float(field("rms_norm_eps", (int, float), 1e-6)),
                  rope_theta=float(rope.get("rope_theta", field("rope_theta", (int, float), 10000.0))),
                  qk_norm=arch == "qwen3", tied_embeddings=field("tie_word_embeddings", (bool,), False))
    if rope_type == "llama3":
        fields["use_scaled_rope"] = True
        for name, ours in LLAMA3_ROPE.items():
            value = rope.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{path}: field '{rope_key}.{name}' is {value!r}, expected a number (rope_type "
                                 "llama3)")
            fields[ours] = int(value) if ours == "rope_original_context" else float(value)
    return fields


def args_from_config(folder: str, **overrides) -> ModelArgs:
    """The folder's config.json updated with runtime/MoA overrides."""
    path = os.path.join(folder, CONFIG)
    fields = config_fields(read_json_object(path, "model settings"), path)
    try:
        return ModelArgs(**{**fields, **overrides})
    except (TypeError, ValueError) as e:  # a bad file is bad input, whichever check caught it
        raise ValueError(f"{path}: {e}") from None


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
    base = {name[len("llama."):]: var for name, var in model.base_parameters().items()}
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
        return read_var(fds[t.path], t.offset, t.nbytes, t.shape, t.dtype, var.dtype, paired_head_dim(name, args),
                        (t.path, hf_name(name)))
    fill_base(base, value_of, sorted({t.path for t in tensors.values()}), source)
    model.freeze_base()


def weight_paths(folder: str) -> list:
    """The folder's safetensors files."""
    return sorted({t.path for t in open_checkpoint(folder)[0].values()})


def to_hf_rows(array: np.ndarray, head_dim: int) -> np.ndarray:
    """Meta's row order of a q/k tensor (pairs) -> HF's (halves): Meta row 2i + c becomes HF row c*hd/2 + i."""
    heads = array.reshape(-1, head_dim // 2, 2, int(np.prod(array.shape[1:], dtype=np.int64)))
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(array.shape)


def write_hf_base(folder: str, args: ModelArgs, weights: dict, max_shard_bytes: int = None, bf16: bool = False):
    """config.json and the safetensors of `weights` ({our name: numpy array or pth.TensorSource}, the names
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
    ends = generation.get("eos_token_id")
    ends = [ends] if isinstance(ends, int) else [] if ends is None else ends
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ends):
        raise CheckpointError(f"{generation_path}: eos_token_id {generation.get('eos_token_id')!r} is not token ids")
    eos = special("eos_token")
    eos = ends[0] if eos is None and ends else eos
    if eos is None:
        raise CheckpointError(f"{settings_path}: no eos_token (and no eos_token_id in {generation_path}): training "
                              "needs the token that ends an answer")
    bos = special("bos_token") if settings.get("add_bos_token", True) else None
    tokenizer.use_special_ids(bos, eos, special("pad_token"), {eos, *ends})
    largest = max(tokenizer.n_words - 1, *tokenizer.stop_tokens)
    if largest >= vocab_size:
        raise CheckpointError(f"{path} (with {generation_path}) has token id {largest}, past the vocab_size "
                              f"{vocab_size} of {os.path.join(folder, CONFIG)}: tokenizer and model do not belong "
                              "together")
    return tokenizer
