"""Meta checkpoint directories: params.json plus consolidated.NN.pth shards -> the frozen base.

Every .pth goes through Models.torch_io.load_pth, an allow-list unpickler that never runs
code named by the file. Meta's names are our attribute names under `llama.`.
"""
import glob
import os

import numpy as np

from .checkpoints import IGNORED_META_KEYS, assign_strict
from .LLaMA_Adapter import LLaMA_adapter
from .ModelArgs import ModelArgs
from .Tokenizer import Tokenizer
from .torch_io import CheckpointError, load_pth


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


def open_tokenizer(llama_dir: str, vocab_size: int) -> Tokenizer:
    """The directory's tokenizer.model, refused when its ids (special tokens included) reach past the
    embedding table of params.json's vocab_size: those ids would read outside the table."""
    path = os.path.join(llama_dir, "tokenizer.model")
    tokenizer = Tokenizer(path)
    if tokenizer.n_words > vocab_size:
        raise CheckpointError(f"{path} has {tokenizer.n_words} token ids (special tokens included), more than "
                              f"the vocab_size {vocab_size} of {os.path.join(llama_dir, 'params.json')}: "
                              "tokenizer and model do not belong together")
    return tokenizer


def build_model(llama_dir: str, args: ModelArgs) -> LLaMA_adapter:
    """The model `args` describes, its frozen base read from a Meta checkpoint directory."""
    model = LLaMA_adapter(args)
    load_base(model, llama_dir)
    return model
