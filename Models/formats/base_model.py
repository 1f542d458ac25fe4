"""A base model folder of either layout, told apart by its files: Meta's (params.json, consolidated.NN.pth,
tokenizer.model: meta.py) or Hugging Face's (config.json, model.safetensors or shards with their index,
tokenizer.json: hf.py). Math.py, Infer.py, Compare.py (through them), the scripts and bench/ open a
base only through here; `load_base_model` and `load_trained_model` are the public entries (`from Models
import ...`).
"""
import os

from ..LLaMA_Adapter import LLaMA_adapter
from ..memory import check_memory
from ..ModelArgs import BASE_FIELDS, ModelArgs
from . import CheckpointError, hf, meta
from .adapters import adapter_config_path, load_adapter, read_adapter_config

LAYOUTS = {"meta": "params.json", "hf": hf.CONFIG}
SIZE_SETTINGS = ("precision", "max_seq_len")  # the overrides that change what the base takes in memory


def base_layout(path: str) -> str:
    """'meta' or 'hf', by the settings file the folder holds."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such base model folder")
    found = [layout for layout, settings in LAYOUTS.items() if os.path.isfile(os.path.join(path, settings))]
    if len(found) == 2:
        raise ValueError(f"{path}: holds both params.json (Meta's layout) and config.json (Hugging Face's): "
                         "keep one layout per folder")
    if not found:
        raise FileNotFoundError(f"{path}: neither a Meta checkpoint folder (params.json, consolidated.NN.pth, "
                                "tokenizer.model) nor a Hugging Face one (config.json, model.safetensors or its "
                                "shards with model.safetensors.index.json, tokenizer.json)")
    return found[0]


def base_settings(path: str, **overrides) -> ModelArgs:
    """The base's settings file (params.json or config.json) updated with `overrides`, nothing sized: for a program
    that reads a field (n_layers, vocab_size) and then builds its model through base_args, which sizes it in the
    run's own precision."""
    return (ModelArgs.from_params_json if base_layout(path) == "meta" else hf.args_from_config)(path, **overrides)


def base_args(path: str, **overrides) -> ModelArgs:
    """The base's settings updated with runtime/MoA `overrides`. The base that the file and the sizing overrides
    (SIZE_SETTINGS) describe must fit: checked first, before anything is built from them (a layer span over
    n_layers, the RoPE tables, the model), in the precision the model will have (the overrides', else ModelArgs'
    default); with no overrides at all (a base read for its shape) in nf4, the least any precision takes."""
    sizing = {k: v for k, v in overrides.items() if k in SIZE_SETTINGS} if overrides else {"precision": "nf4"}
    least = "" if overrides else " (a lower bound: nf4 takes the least of any --precision)"
    check_memory(base_settings(path, **sizing), settings_file(path) + least)
    return base_settings(path, **overrides)


def settings_file(path: str) -> str:
    """The base's settings file (params.json or config.json)."""
    return os.path.join(path, LAYOUTS[base_layout(path)])


def weight_paths(path: str) -> list:
    """The files holding the base's weights."""
    return meta.checkpoint_paths(path) if base_layout(path) == "meta" else hf.weight_paths(path)


def build_model(path: str, args: ModelArgs) -> LLaMA_adapter:
    """The model `args` describes, its frozen base read from the folder tensor by tensor (and checked
    finite while it is read: reading.py); refused before anything is allocated when it does not fit in
    the memory left."""
    check_memory(args, settings_file(path))
    model = LLaMA_adapter(args)
    (meta if base_layout(path) == "meta" else hf).load_base(model, path)
    return model


def open_tokenizer(path: str, vocab_size: int):
    """The folder's tokenizer (tokenizer.model or tokenizer.json), refused when its ids reach past the
    embedding table of `vocab_size` rows."""
    return (meta if base_layout(path) == "meta" else hf).open_tokenizer(path, vocab_size)


def load_base_model(path: str, **settings) -> LLaMA_adapter:
    """A base of either layout as a LLaMA_adapter, its base loaded. `settings` are ModelArgs fields:
    max_seq_len, max_batch_size, precision (the defaults: ModelArgs'), and MoA settings (no experts
    unless given, e.g. lora_layers="all", variant="soft"). `model.llama(tokens)` gives logits
    [B,T,vocab]; after `model.eval()`, `model.llama(tokens, start_pos=p)` runs through the KV cache."""
    return build_model(path, base_args(path, **settings))


def adapter_settings(adapter: str, path: str) -> dict:
    """The MoA settings a trained adapter records (its adapter_params.json, ours or the authors'; {} without
    one), refused when it was trained on another base than the folder `path`."""
    base = base_settings(path)
    config = read_adapter_config(adapter, base=base)
    if config is None:
        return {}
    base = base.to_dict()
    other = [f"{k}: adapter {config[k]!r}, base {base[k]!r}" for k in BASE_FIELDS
             if k in config and config[k] != base[k]]
    if other:
        raise CheckpointError(f"{adapter_config_path(adapter)}: adapter trained on another base than {path}: "
                              + "; ".join(other))
    return {k: v for k, v in config.items() if k not in BASE_FIELDS}


def load_trained_model(path: str, adapter: str, **settings) -> tuple:
    """(model, tokenizer): the base folder `path` with a trained adapter (our adapter folder, or the authors'
    adapter.pth beside its adapter_params.json) loaded strictly, in eval mode, for Models.generate.generate.
    `settings`: ModelArgs fields over the adapter's, as load_base_model takes them (max_seq_len: the adapter's
    training length unless given)."""
    model = build_model(path, base_args(path, **{**adapter_settings(adapter, path), **settings}))
    load_adapter(model, adapter)
    model.eval()
    return model, open_tokenizer(path, model.args.vocab_size)
