"""Meta checkpoint directories, adapter files, and the authors' adapter format.

Every .pth goes through Models.torch_io.load_pth, an allow-list unpickler that
never runs code named by the file.

Names: our module attributes are the authors' (`llama.layers.0.attention.lora_Q.
lora_A.weight`, `llama.layers.0.adapter_type_router.w1.weight`, ...), so their
names and ours are one and the same. The two file formats differ:
- ours: `adapter.pth` holding a flat {name: fp32 tensor} plus `adapter_params.json`
  (the ModelArgs that shape the adapter);
- theirs: `adapter.pth` holding {"model": {name: tensor}} (what their
  extract_adapter_from_checkpoint.py keeps: every name containing lora,
  prompt or adapter), possibly bf16, no config.
`export_authors_adapter` and `import_authors_adapter` convert one into the other.
"""
import glob
import json
import os

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from .ModelArgs import ModelArgs
from .torch_io import CheckpointError, load_pth, save_pth

ADAPTER_WEIGHTS = "adapter.pth"
ADAPTER_PARAMS = "adapter_params.json"
IGNORED_META_KEYS = ("rope.freqs",)


def join_shards(shards: list, expected: dict, source: str) -> dict:
    """Model-parallel shards -> full tensors: replicated ones are taken once, split ones
    are joined along the one dimension whose sizes add up to the expected shape."""
    merged = {}
    for name, shape in expected.items():
        parts = [s[name] for s in shards if name in s]
        if len(parts) != len(shards):
            continue  # reported as missing by the strict check
        if tuple(parts[0].shape) == tuple(shape) or len(parts) == 1:
            merged[name] = parts[0]
            continue
        for dim in range(len(shape)):
            if sum(p.shape[dim] for p in parts) == shape[dim]:
                merged[name] = np.concatenate(parts, axis=dim)
                break
        else:
            raise CheckpointError(f"{source}: shards of '{name}' {[list(p.shape) for p in parts]} "
                                  f"do not join into {list(shape)}")
    for shard in shards:
        for name in shard:
            if name not in expected and name not in IGNORED_META_KEYS:
                merged.setdefault(name, shard[name])  # unexpected: the strict check names it
    return merged


def assign_strict(params: dict, arrays: dict, source: str, what: str):
    """Copy arrays into the Vars of `params`; a missing, unexpected or mis-shaped tensor is an error."""
    missing = sorted(set(params) - set(arrays))
    unexpected = sorted(set(arrays) - set(params) - set(IGNORED_META_KEYS))
    problems = []
    if missing:
        problems.append(f"missing {what} tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    misshaped = [f"'{name}' has shape {list(arrays[name].shape)}, the model expects {list(params[name].shape)}"
                 for name in sorted(set(params) & set(arrays))
                 if tuple(arrays[name].shape) != tuple(params[name].shape)]
    problems += misshaped[:4] + ([f"... and {len(misshaped) - 4} more mis-shaped"] if len(misshaped) > 4 else [])
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    for name, var in params.items():
        var.assign(jt.array(np.ascontiguousarray(arrays[name], dtype=np.float32)).cast(var.dtype))  # bf16 stays bf16


def load_base(model: LLaMA_adapter, ckpt_dir: str):
    """Fill the frozen base from Meta's consolidated.NN.pth shards (names without 'llama.')."""
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "consolidated.*.pth")))
    if not paths:
        raise FileNotFoundError(f"{ckpt_dir}: no consolidated.NN.pth checkpoint file")
    shards = []
    for path in paths:
        shard = load_pth(path)
        if not isinstance(shard, dict) or not all(isinstance(v, np.ndarray) for v in shard.values()):
            raise CheckpointError(f"{path}: expected a flat dict of tensor names to tensors")
        shards.append(shard)
    base = {name[len("llama."):]: var for name, var in model.base_parameters().items()}
    source = paths[0] if len(paths) == 1 else f"{ckpt_dir} ({len(paths)} shards)"
    assign_strict(base, join_shards(shards, {k: v.shape for k, v in base.items()}, source), source, "base")
    model.freeze_base()


def build_model(llama_dir: str, **overrides) -> LLaMA_adapter:
    """A Meta checkpoint directory (params.json, consolidated.NN.pth) + MoA settings -> model."""
    args = ModelArgs.from_params_json(os.path.join(llama_dir, "params.json"), **overrides)
    model = LLaMA_adapter(args)
    load_base(model, llama_dir)
    return model


# ---- adapters --------------------------------------------------------------------

def adapter_arrays(model: LLaMA_adapter) -> dict:
    return {name: p.numpy().astype(np.float32) for name, p in model.adapter_parameters().items()}


def save_adapter(model: LLaMA_adapter, out_dir: str):
    """adapter.pth (adapter tensors only, fp32) and adapter_params.json, each written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    save_pth(adapter_arrays(model), os.path.join(out_dir, ADAPTER_WEIGHTS))
    tmp = os.path.join(out_dir, ADAPTER_PARAMS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(model.args.to_dict(), f, indent=2)
    os.replace(tmp, os.path.join(out_dir, ADAPTER_PARAMS))


def config_differences(saved: dict, args: ModelArgs) -> list:
    """Fields of a saved adapter config that disagree with the model's (runtime fields ignored)."""
    current = args.to_dict()
    skip = {"max_batch_size", "max_seq_len", "precision"}
    return [f"{k}: adapter has {saved[k]!r}, model has {current[k]!r}"
            for k in sorted(saved) if k in current and k not in skip and saved[k] != current[k]]


def read_adapter(path: str) -> dict:
    """Adapter tensors from our adapter.pth or the authors' ({'model': ...}, bf16 allowed)."""
    if os.path.isdir(path):
        path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter file")
    state = load_pth(path)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensor names to tensors (or {{'model': ...}})")
    return {name: value for name, value in state.items() if is_adapter_param(name)}


def load_adapter(model: LLaMA_adapter, path: str):
    """Load our adapter directory or file, or the authors' adapter.pth, into `model` strictly."""
    config_path = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), ADAPTER_PARAMS)
    if os.path.isfile(config_path):
        with open(config_path) as f:
            differences = config_differences(json.load(f), model.args)
        if differences:
            raise CheckpointError(f"{config_path}: adapter from another configuration: " + "; ".join(differences))
    weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
    assign_strict(model.adapter_parameters(), read_adapter(weights), weights, "adapter")


def export_authors_adapter(adapter_path: str, out_path: str, bf16: bool = False):
    """Our adapter (directory or adapter.pth) -> the authors' adapter.pth: {'model': {name: tensor}}."""
    save_pth({"model": read_adapter(adapter_path)}, out_path, bf16=bf16)


def import_authors_adapter(authors_path: str, out_dir: str, args: ModelArgs):
    """The authors' adapter.pth + the ModelArgs it was trained with -> our adapter directory."""
    model = LLaMA_adapter(args)
    assign_strict(model.adapter_parameters(), read_adapter(authors_path), authors_path, "adapter")
    save_adapter(model, out_dir)


# Fields of the authors' ModelArgs that we do not carry; False/None is their default and our behaviour.
AUTHORS_ONLY_FIELDS = ("flash_attention2", "bf16", "w_bias", "bool_weights", "adapter_noisy", "expert_weight")


def args_from_authors(model_args: dict, variant: str, **overrides) -> ModelArgs:
    """The authors' ModelArgs (as a dict) -> ours; an option we do not implement is an error."""
    unsupported = [k for k in ("w_bias", "bool_weights", "adapter_noisy", "expert_weight") if model_args.get(k)]
    if unsupported:
        raise ValueError(f"authors' option(s) {unsupported} are not implemented in MoA-Jittor")
    fields = {k: v for k, v in model_args.items() if k not in AUTHORS_ONLY_FIELDS}
    return ModelArgs(variant=variant, **{**fields, **overrides})
