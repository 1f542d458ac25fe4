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
import random

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from .ModelArgs import ModelArgs
from .torch_io import CheckpointError, load_pth, save_pth
from Utils.misc import is_main_process, write_json

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
        var.assign(jt.array(np.ascontiguousarray(arrays[name], dtype=np.float32)))


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


def build_model(llama_dir: str, args: ModelArgs) -> LLaMA_adapter:
    """The model `args` describes, its frozen base read from a Meta checkpoint directory."""
    model = LLaMA_adapter(args)
    load_base(model, llama_dir)
    return model


# ---- adapters --------------------------------------------------------------------

def adapter_arrays(model: LLaMA_adapter) -> dict:
    return {name: p.numpy().astype(np.float32) for name, p in model.adapter_parameters().items()}


def save_adapter(model: LLaMA_adapter, out_dir: str):
    """adapter.pth (adapter tensors only, fp32) and adapter_params.json, each written atomically.
    Call on every rank (it fetches Vars); rank 0 writes."""
    arrays = adapter_arrays(model)
    if is_main_process():
        write_adapter(arrays, model.args.to_dict(), out_dir)


def write_adapter(arrays: dict, model_args: dict, out_dir: str):
    save_pth(arrays, os.path.join(out_dir, ADAPTER_WEIGHTS))
    write_json(model_args, os.path.join(out_dir, ADAPTER_PARAMS))


# ---- training checkpoints ----------------------------------------------------------
# checkpoint-latest.pth / checkpoint-best.pth: the adapter, AdamW's moments, where the run stands,
# the early stopper, the RNGs, the run's settings and the signature a resume must match.

def rng_state() -> dict:
    keys, pos, has_gauss, cached = np.random.get_state()[1:]
    numpy_state = {"keys": keys.astype(np.int64), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return {"numpy": numpy_state, "python": np.asarray(random.getstate()[1], dtype=np.int64)}


def set_rng_state(state: dict):
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    random.setstate((3, tuple(int(x) for x in state["python"]), None))


def checkpoint_state(model, optimizer, stopper, position: dict, settings: dict, signature: dict) -> dict:
    """Everything a resume needs; call on EVERY rank (it fetches Vars), then save_checkpoint on rank 0.
    `position`: epoch, data_iter_step (the next global batch), global_step."""
    return {"adapter": adapter_arrays(model), "optimizer": optimizer.state_arrays(), **position,
            "early_stopper": stopper.state_dict(), "rng": rng_state(), "args": settings,
            "signature": signature, "model_args": model.args.to_dict()}


def save_checkpoint(state: dict, out_dir: str, name: str = "latest", with_adapter: bool = False):
    """checkpoint-<name>.pth (and with_adapter, adapter-<name>/), rank 0 only, each file atomically."""
    if not is_main_process():
        return
    save_pth(state, os.path.join(out_dir, f"checkpoint-{name}.pth"))
    if with_adapter:
        write_adapter(state["adapter"], state["model_args"], os.path.join(out_dir, f"adapter-{name}"))


def resume_signature(llama_path: str, data_path, val_data_path, train, max_seq_len: int) -> dict:
    """What a resumed run must share with its checkpoint besides the model's settings."""
    keys = ("val_fraction", "batch_size", "accum_iter", "epochs", "warmup_epochs", "lr", "min_lr",
            "weight_decay", "clip_grad", "seed")
    return {**{k: getattr(train, k) for k in keys}, "max_seq_len": max_seq_len,
            "llama_path": os.path.abspath(llama_path),
            "data": os.path.abspath(data_path) if data_path else "synthetic",
            "val_data": os.path.abspath(val_data_path) if val_data_path else None}


def restore_checkpoint(path: str, model, optimizer, stopper, signature: dict) -> dict:
    """Load a training checkpoint into model, optimizer, stopper and the RNGs after checking it was
    made with the same settings; returns the checkpoint (its epoch, data_iter_step, global_step)."""
    ckpt = load_pth(path)
    if not isinstance(ckpt, dict) or "adapter" not in ckpt or "optimizer" not in ckpt:
        raise CheckpointError(f"{path}: not a training checkpoint of Math.py (no adapter/optimizer state)")
    differences = config_differences(ckpt["model_args"], model.args)
    saved = ckpt.get("signature", {})
    differences += [f"{k}: checkpoint has {saved.get(k)!r}, this run has {v!r}"
                    for k, v in signature.items() if saved.get(k) != v]
    if differences:
        raise CheckpointError(f"{path}: checkpoint of another configuration, cannot resume: " + "; ".join(differences))
    assign_strict(model.adapter_parameters(), ckpt["adapter"], path, "adapter")
    optimizer.load_state_arrays(ckpt["optimizer"], path)
    stopper.load_state_dict(ckpt["early_stopper"])
    set_rng_state(ckpt["rng"])
    return ckpt


def config_differences(saved: dict, args: ModelArgs) -> list:
    """Fields of a saved adapter config that disagree with the model's (runtime fields ignored)."""
    current = args.to_dict()
    skip = {"max_batch_size", "max_seq_len"}
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
