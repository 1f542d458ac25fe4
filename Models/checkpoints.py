"""Adapter files (ours and the authors', both ways) and training checkpoints: saved, restored,
signed for resume. Meta's base checkpoints are read in Models/meta_checkpoint.py.

Every .pth goes through Models.torch_io.load_pth, an allow-list unpickler that
never runs code named by the file; every file is written atomically.

Names: our module attributes are the authors' (`llama.layers.0.attention.lora_Q.
lora_A.weight`, `llama.layers.0.adapter_type_router.w1.weight`, `lora_Q.lora_A_l.1.weight`,
...), so their names and ours are one and the same. The files:
- ours: `adapter.pth` holding a flat {name: fp32 tensor} plus `adapter_params.json`
  (our ModelArgs, Meta's fields included);
- theirs, as their extract_adapter_from_checkpoint.py writes it: the same flat
  `adapter.pth` (every name containing lora, prompt or adapter, possibly bf16) plus
  an `adapter_params.json` of their option names, a different set per folder of
  their release (Sparse and Soft MoA, each baseline: Models/authors_options.py),
  which their loader passes to their ModelArgs as keyword arguments;
- their training checkpoint `checkpoint-N.pth`: {"model": full state dict, "args":
  the argparse.Namespace of the run, "optimizer", "epoch", "scaler"}.
The two json files are told apart by our `variant` field, which theirs lack. `load_adapter` reads
both adapter layouts; `export_authors_adapter` writes theirs, `import_authors_adapter`
turns theirs (or their checkpoint-N.pth) into ours.
"""
import hashlib
import json
import os
import random

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from .authors_options import authors_params, fields_from_authors, folder_of
from .ModelArgs import ModelArgs
from .precision import cast_to
from .torch_io import CheckpointError, PlainNamespace, load_pth
from .torch_write import save_pth
from Utils.misc import is_main_process, read_json_object, write_json

ADAPTER_WEIGHTS = "adapter.pth"
ADAPTER_PARAMS = "adapter_params.json"
IGNORED_META_KEYS = ("rope.freqs",)  # in Meta's files, recomputed here


def check_strict(params: dict, shapes: dict, source: str, what: str):
    """A missing, unexpected or mis-shaped tensor (name -> shape in `shapes`) is an error naming `source`."""
    missing = sorted(set(params) - set(shapes))
    unexpected = sorted(set(shapes) - set(params) - set(IGNORED_META_KEYS))
    problems = []
    if missing:
        problems.append(f"missing {what} tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    misshaped = [f"'{name}' has shape {list(shapes[name])}, the model expects {list(params[name].shape)}"
                 for name in sorted(set(params) & set(shapes))
                 if tuple(shapes[name]) != tuple(params[name].shape)]
    problems += misshaped[:4] + ([f"... and {len(misshaped) - 4} more mis-shaped"] if len(misshaped) > 4 else [])
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def assign_strict(params: dict, arrays: dict, source: str, what: str):
    """Copy numpy arrays into the Vars of `params` (small: adapters, golden files), checked as above."""
    check_strict(params, {name: array.shape for name, array in arrays.items()}, source, what)
    for name, var in params.items():
        var.assign(cast_to(jt.array(np.ascontiguousarray(arrays[name], dtype=np.float32)), var.dtype))  # bf16 stays bf16


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


def content_hash(examples) -> str:
    """sha256 of the examples as canonical JSON: the same data gives the same hash wherever it lives."""
    return hashlib.sha256(json.dumps(examples, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def resume_signature(llama_path: str, data_path, val_data_path, train, max_seq_len: int, examples) -> dict:
    """What a resumed run must share with its checkpoint besides the model's settings; `examples` the
    (train, val or None) lists it trains and validates on, compared by content."""
    keys = ("val_fraction", "batch_size", "accum_iter", "epochs", "warmup_epochs", "lr", "min_lr",
            "weight_decay", "clip_grad", "seed")
    return {**{k: getattr(train, k) for k in keys}, "max_seq_len": max_seq_len,
            "llama_path": os.path.abspath(llama_path),
            "data": os.path.abspath(data_path) if data_path else "synthetic",
            "val_data": os.path.abspath(val_data_path) if val_data_path else None,
            "train_sha256": content_hash(examples[0]),
            "val_sha256": content_hash(examples[1]) if examples[1] is not None else None}


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
    skip = {"max_batch_size", "max_seq_len", "precision"}
    return [f"{k}: adapter has {saved[k]!r}, model has {current[k]!r}"
            for k in sorted(saved) if k in current and k not in skip and saved[k] != current[k]]


def read_adapter(path: str) -> dict:
    """Adapter tensors from a flat adapter.pth or a {'model': ...} checkpoint (bf16 allowed)."""
    if os.path.isdir(path):
        path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter file")
    return adapter_tensors(load_pth(path), path)


def adapter_tensors(state, path: str) -> dict:
    """The adapter tensors of a loaded flat {name: tensor} or {'model': {...}, ...}."""
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensor names to tensors (or {{'model': ...}})")
    return {name: value for name, value in state.items() if is_adapter_param(name)}


def adapter_config_path(path: str) -> str:
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(path), ADAPTER_PARAMS)


def read_adapter_config(path: str, hint: str = None):
    """The adapter_params.json beside an adapter (ours or the authors') as our ModelArgs
    fields (Meta's fields only when ours carries them), or None when there is none. `hint`
    names the authors' folder where their option sets coincide (authors_options.authors_folder)."""
    config_path = adapter_config_path(path)
    if not os.path.isfile(config_path):
        return None
    try:
        config = read_json_object(config_path, "adapter settings")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if "variant" in config:
        return config
    return fields_from_authors(config, config_path, hint=hint or tensor_names_hint(path))


def unipeft_by_names(names) -> str:
    """'unipeft' when tensor names hold UniPEFT's gates (its options are Soft MoA's), else None."""
    return "unipeft" if any(str(n).endswith(".lora_gate.weight") for n in names) else None


def tensor_names_hint(path: str):
    """unipeft_by_names of the authors' adapter.pth beside their json, read lazily: names only."""
    weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
    if not os.path.isfile(weights):
        return None
    state = load_pth(weights, lazy=True)
    names = state["model"] if isinstance(state, dict) and isinstance(state.get("model"), dict) else state
    return unipeft_by_names(names) if isinstance(names, dict) else None


def load_adapter(model: LLaMA_adapter, path: str):
    """Load our adapter directory or file, or the authors' adapter.pth, into `model` strictly."""
    config = read_adapter_config(path, hint=folder_of(model.args))
    if config is not None:
        differences = config_differences(config, model.args)
        if differences:
            raise CheckpointError(f"{adapter_config_path(path)}: adapter from another configuration: "
                                  + "; ".join(differences))
    weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
    assign_strict(model.adapter_parameters(), read_adapter(weights), weights, "adapter")


def export_authors_adapter(adapter_path: str, out_path: str, bf16: bool = False):
    """Our adapter (directory or adapter.pth with its adapter_params.json) -> the authors'
    adapter.pth at out_path (a flat dict) and their adapter_params.json beside it."""
    config = read_adapter_config(adapter_path)
    if config is None:
        raise FileNotFoundError(f"{adapter_config_path(adapter_path)}: no adapter_params.json beside the adapter")
    args = ModelArgs(**config) if "dim" in config else None
    if args is None:
        raise CheckpointError(f"{adapter_config_path(adapter_path)}: already the authors' format")
    params = authors_params(args)
    save_pth(read_adapter(adapter_path), out_path, bf16=bf16)
    write_json(params, os.path.join(os.path.dirname(os.path.abspath(out_path)), ADAPTER_PARAMS))


def read_authors(path: str, method: str = None):
    """The authors' adapter.pth (their adapter_params.json beside it) or their training
    checkpoint-N.pth (its 'args' Namespace) -> (adapter tensors, our ModelArgs fields).
    Soft MoA and instance-level MoA write the same options and names: `method` "instance"
    says which; UniPEFT is told by its gates' names."""
    state = load_pth(path)
    arrays = adapter_tensors(state, path)
    hint = method or unipeft_by_names(arrays)
    if isinstance(state, dict) and isinstance(state.get("args"), PlainNamespace):
        fields = fields_from_authors(vars(state["args"]), f"{path} (args)", hint=hint)
    else:
        fields = read_adapter_config(path, hint=hint)
        if fields is None or "dim" in fields:
            raise CheckpointError(f"{path}: neither the authors' checkpoint-N.pth (with 'args') nor their "
                                  f"adapter.pth with their {ADAPTER_PARAMS} beside it")
    return arrays, fields


def import_authors_adapter(authors_path: str, out_dir: str, base: ModelArgs, method: str = None):
    """The authors' adapter.pth or checkpoint-N.pth -> our adapter directory, with no MoA
    setting to repeat. `base` gives Meta's fields (dim, layers, ...), which their files lack;
    `method` "instance" marks an instance-level MoA file (its options are Soft MoA's)."""
    arrays, fields = read_authors(authors_path, method)
    model = LLaMA_adapter(ModelArgs(**{**base.to_dict(), **fields}))
    assign_strict(model.adapter_parameters(), arrays, authors_path, "adapter")
    save_adapter(model, out_dir)


def main(argv=None):
    """python -m Models.checkpoints export|import ...: convert adapter files without Python code."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m Models.checkpoints", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="our adapter -> the authors' adapter.pth + adapter_params.json")
    e.add_argument("adapter", help="our adapter directory (adapter.pth + adapter_params.json)")
    e.add_argument("out", help="the authors' adapter.pth to write (their json goes beside it)")
    e.add_argument("--bf16", action="store_true", help="store the tensors in bfloat16")
    i = sub.add_parser("import", help="the authors' adapter.pth or checkpoint-N.pth -> our adapter directory")
    i.add_argument("authors", help="their adapter.pth (with their adapter_params.json beside it) or checkpoint-N.pth")
    i.add_argument("out", help="our adapter directory to write")
    i.add_argument("--llama_path", required=True, help="the Meta checkpoint directory the adapter was trained on")
    i.add_argument("--method", choices=["instance"], help="the file comes from LLaMA3_soft_moa_instance, whose "
                   "options and names are Soft MoA's (every other method is told from the file)")
    args = p.parse_args(argv)
    try:
        if args.command == "export":
            export_authors_adapter(args.adapter, args.out, bf16=args.bf16)
        else:
            import_authors_adapter(args.authors, args.out, ModelArgs.from_params_json(args.llama_path), args.method)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        p.exit(2, f"error: {e}\n")
    print(f"[checkpoints] wrote {args.out}")


if __name__ == "__main__":
    main()
