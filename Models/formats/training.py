"""Training checkpoints: checkpoint-latest.pth / checkpoint-best.pth hold the adapter, AdamW's
moments, where the run stands, the early stopper, the RNGs, the run's settings and the signature a
resume must match."""
import hashlib
import json
import os
import random

import numpy as np

from Utils.misc import is_main_process

from . import CheckpointError
from .adapters import adapter_arrays, assign_strict, differing_fields, write_adapter
from .pth_writer import save_pth


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
    keys = ("val_fraction", "batch_size", "accum_iter", "warmup_epochs", "lr", "min_lr",
            "weight_decay", "clip_grad", "seed")
    return {**{k: getattr(train, k) for k in keys}, "max_seq_len": max_seq_len,
            "llama_path": os.path.abspath(llama_path),
            "data": os.path.abspath(data_path) if data_path else "synthetic",
            "val_data": os.path.abspath(val_data_path) if val_data_path else None,
            "train_sha256": content_hash(examples[0]),
            "val_sha256": content_hash(examples[1]) if examples[1] is not None else None}


def check_extension(ckpt: dict, train, path: str):
    """A resumed run continues: refuse a --max_steps below the step the checkpoint reached, or --epochs below the
    checkpoint's (its records would say fewer steps than ran). Larger ones extend the run, a finished one too."""
    step, epochs = int(ckpt["global_step"]), (ckpt.get("args") or {}).get("epochs", train.epochs)
    if train.max_steps and train.max_steps < step:
        raise CheckpointError(f"--max_steps {train.max_steps} is below the step {path} reached ({step}): a resumed "
                              f"run continues; give --max_steps {step} or more (0: the recipe's epochs), or start "
                              "afresh with --overwrite")
    if train.epochs < epochs:
        raise CheckpointError(f"--epochs {train.epochs} is below the {epochs} of {path}: a resumed run continues; "
                              f"give --epochs {epochs} or more to extend it, or start afresh with --overwrite")


# a refusal names this many of the differences, then counts the rest: one line a reader takes in
SHOWN_DIFFERENCES = 3


def restore_checkpoint(path: str, ckpt, model, optimizer, stopper, signature: dict, fixed: dict = None,
                       sources: dict = None) -> dict:
    """Load a training checkpoint (`ckpt`, load_pth of `path`) into model, optimizer, stopper and the RNGs after
    checking it was made with the same settings (the model's, the signature's and `fixed`, the settings a resumed
    run may not change, against those the checkpoint recorded; the refusal says where this run's value came
    from, `sources` {name: where}); returns the checkpoint (its epoch, data_iter_step, global_step)."""
    if not isinstance(ckpt, dict) or "adapter" not in ckpt or "optimizer" not in ckpt:
        raise CheckpointError(f"{path}: not a training checkpoint of Math.py (no adapter/optimizer state)")
    differences = differing_fields(ckpt["model_args"], model.args)
    saved = ckpt.get("signature", {})
    differences += [(k, saved.get(k), v) for k, v in signature.items() if saved.get(k) != v]
    recorded = {**(ckpt.get("args") or {}), **ckpt["model_args"]}
    named = {k for k, _, _ in differences}
    differences += [(k, recorded[k], v) for k, v in (fixed or {}).items()
                    if k in recorded and recorded[k] != v and k not in named]
    if differences:
        said = [f"{k}: checkpoint has {old!r}, this run has {new!r}"
                + (f" ({sources[k]})" if k in (sources or {}) else "") for k, old, new in differences]
        more = len(said) - SHOWN_DIFFERENCES
        raise CheckpointError(f"{path}: checkpoint of another configuration, cannot resume: "
                              + "; ".join(said[:SHOWN_DIFFERENCES]) + (f"; and {more} more" if more > 0 else ""))
    assign_strict(model.adapter_parameters(), ckpt["adapter"], path, "adapter")
    optimizer.load_state_arrays(ckpt["optimizer"], path)
    stopper.load_state_dict(ckpt["early_stopper"])
    set_rng_state(ckpt["rng"])
    return ckpt
