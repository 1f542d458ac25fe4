"""Meta checkpoint directories: params.json plus consolidated.NN.pth shards -> the frozen base.

Every .pth goes through Models.formats.pth.load_pth, an allow-list unpickler that never runs
code named by the file. Meta's names are our attribute names under `llama.` (meta_shapes).

The base is loaded tensor by tensor: the shards are opened lazily (shapes and file offsets
only), then each tensor's bytes go from the file straight into its Var (reading.py).
"""
import glob
import os

import Utils.jittor_env  # noqa: F401
import jittor as jt

from . import CheckpointError
from .tensor_match import IGNORED_META_KEYS, check_strict
from ..LLaMA_Adapter import LLaMA_adapter
from ..ModelArgs import ModelArgs
from ..Tokenizer import Tokenizer
from ..kernels.precision import QUANTIZERS, matrix_shape, split_scales
from .pth import StoredTensor, load_pth
from .reading import TensorRead, checked_in_memory, fill_base, read_quantized, read_var


def meta_shapes(args: ModelArgs) -> dict:
    """The base's tensor names (Meta's: our attribute names under `llama.`) and shapes."""
    outer = args.outer_shapes()
    shapes = {"tok_embeddings.weight": outer.pop("tok_embeddings.weight")}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in args.layer_shapes().items()})
    return {**shapes, **outer}


# bf16 bits that came through numpy as uint16 -> a bfloat16 Var, same bytes
REINTERPRET_SOURCE = "std::memcpy(out0_p, in0_p, in0->size);"


def quantized_var(parts: list, dim, fds: dict, name: str, storage: str) -> TensorRead:
    """(values, scales) of the matrix `name` in the quantized `storage` (int8, uint8: nf4) joined from `parts`
    along `dim` (None: one part),
    quantized as it is read (reading.read_quantized); a part not stored contiguously goes through
    tensor_var first."""
    if any(part.file_range() is None for part in parts):
        reads = [tensor_var(part, fds[part.storage.reader.path], "float32", name) for part in parts]
        values = [read.value for read in reads]
        return TensorRead(QUANTIZERS[storage](values[0] if dim is None else jt.concat(values, dim)),
                          [c for read in reads for c in read.checks])
    pieces, start = [], 0
    for part in parts:
        rows, cols = part.shape
        offset = part.file_range()[0]
        pieces.append((fds[part.storage.reader.path], offset, start if dim == 0 else 0, rows,
                       start if dim == 1 else 0, cols))
        start += rows if dim == 0 else cols if dim == 1 else 0
    return read_quantized(pieces, joined_shape(parts, dim), parts[0].dtype, 0, (parts[0].storage.reader.path, name),
                          storage)


def tensor_var(tensor: StoredTensor, fd: int, dtype: str, name: str) -> TensorRead:
    """One stored tensor (`name` in its file) as a Var of `dtype`, read and checked finite when the Var
    is executed (reading.read_var)."""
    where = (tensor.storage.reader.path, name)
    span = tensor.file_range()
    if span is not None:
        return read_var(fd, *span, tensor.shape, tensor.dtype, dtype, where=where)
    array = jt.array(tensor.numpy())  # non-contiguous or big-endian: rare, through numpy
    if tensor.dtype == "bfloat16":
        array = jt.code(tensor.shape, "bfloat16", [array], cpu_header="#include <cstring>\n",
                        cpu_src=REINTERPRET_SOURCE)
    return checked_in_memory(array, tensor.dtype, dtype, where)


COMPARE_CHUNK = 64 << 20  # bytes of each copy held at once while replicated tensors are compared


def same_tensor(a: StoredTensor, b: StoredTensor) -> bool:
    """Whether two stored tensors hold the same bytes, read a chunk at a time."""
    if (a.shape, a.dtype, a.element) != (b.shape, b.dtype, b.element):
        return False
    if not (a.contiguous and b.contiguous):
        return a.numpy().tobytes() == b.numpy().tobytes()
    item = a.element.itemsize
    for start in range(0, a.nbytes, COMPARE_CHUNK):
        n = min(COMPARE_CHUNK, a.nbytes - start)
        if a.storage.read(a.offset * item + start, n) != b.storage.read(b.offset * item + start, n):
            return False
    return True


def join_plan(shards: list, expected: dict, source: str) -> dict:
    """Model-parallel shards -> {name: (parts, dim)}: replicated tensors (Meta's norms) are taken once
    (dim None) after every copy is found equal, split ones are joined along the one dimension whose
    sizes add up to the expected shape. Names only in some shards are left out (the strict check
    reports them missing)."""
    plan = {}
    for name, shape in expected.items():
        parts = [s[name] for s in shards if name in s]
        if len(parts) != len(shards):
            continue
        if tuple(parts[0].shape) == tuple(shape) or len(parts) == 1:
            differing = [part for part in parts[1:] if not same_tensor(parts[0], part)]
            if differing:
                raise CheckpointError(f"{source}: {parts[0].storage.reader.path} and {differing[0].storage.reader.path}"
                                      f" hold different copies of '{name}' {list(parts[0].shape)}: two checkpoints in "
                                      "one folder? Keep one model's consolidated.NN.pth files only")
            plan[name] = (parts[:1], None)
            continue
        for dim in range(len(shape)):
            others = [tuple(p.shape[:dim] + p.shape[dim + 1:]) for p in parts]
            if sum(p.shape[dim] for p in parts) == shape[dim] and len(set(others)) == 1:
                plan[name] = (parts, dim)
                break
        else:
            raise CheckpointError(f"{source}: shards of '{name}' {[list(p.shape) for p in parts]} "
                                  f"do not join into {list(shape)}")
    for shard in shards:
        for name in shard:
            if name not in expected and name not in IGNORED_META_KEYS:
                plan.setdefault(name, ([shard[name]], None))  # unexpected: the strict check names it
    return plan


def joined_shape(parts: list, dim) -> tuple:
    shape = list(parts[0].shape)
    if dim is not None:
        shape[dim] = sum(p.shape[dim] for p in parts)
    return tuple(shape)


def open_shards(paths: list) -> list:
    shards = []
    for path in paths:
        shard = load_pth(path, lazy=True)
        if not isinstance(shard, dict) or not all(isinstance(v, StoredTensor) for v in shard.values()):
            raise CheckpointError(f"{path}: expected a flat dict of tensor names to tensors")
        shards.append(shard)
    return shards


def checkpoint_paths(ckpt_dir: str) -> list:
    """The directory's consolidated.NN.pth shards, in order."""
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "consolidated.*.pth")))
    if not paths:
        raise FileNotFoundError(f"{ckpt_dir}: no consolidated.NN.pth checkpoint file")
    return paths


def load_base(model: LLaMA_adapter, ckpt_dir: str):
    """Fill the frozen base from Meta's consolidated.NN.pth shards (names without 'llama.'), one tensor at a time."""
    paths = checkpoint_paths(ckpt_dir)
    shards = open_shards(paths)
    base, scales = split_scales({name[len("llama."):]: var for name, var in model.base_parameters().items()})
    source = paths[0] if len(paths) == 1 else f"{ckpt_dir} ({len(paths)} shards)"
    plan = join_plan(shards, {k: matrix_shape(v) for k, v in base.items()}, source)
    check_strict(base, {name: joined_shape(*entry) for name, entry in plan.items()}, source, "base")

    def value_of(name, var, fds):
        parts, dim = plan[name]
        if name in scales:
            return quantized_var(parts, dim, fds, name, str(var.dtype))
        reads = [tensor_var(part, fds[part.storage.reader.path], var.dtype, name) for part in parts]
        if dim is None:
            return reads[0]
        return TensorRead(jt.concat([read.value for read in reads], dim), [c for read in reads for c in read.checks])
    fill_base(base, value_of, paths, source, scales)
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
