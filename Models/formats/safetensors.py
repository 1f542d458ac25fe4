"""Safetensors files (Hugging Face's weights), read and written in this one module.

A file is an 8-byte little-endian length N, N bytes of a JSON header {name: {"dtype": "BF16", "shape":
[...], "data_offsets": [begin, end]}, "__metadata__": {str: str}} (padded with spaces), then the
tensors' bytes, the offsets counted from the end of the header. A sharded checkpoint names the file
of each tensor in model.safetensors.index.json ({"metadata": {...}, "weight_map": {name: file}}).

The `safetensors` library is not on this path, by necessity: its numpy API has no bfloat16 (a BF16
tensor raises "data type 'bfloat16' not understood"), it hands out no file offsets to pread from,
`deserialize` wants the whole file's bytes in memory, and its writer wants every tensor in memory
at once. So `read_header` parses and checks the header itself (a crafted file is one error naming
it), the base loader preads each tensor's bytes straight into its Var (reading.py: bf16 stays bf16
bytes), and `save_safetensors` writes tensor by tensor (numpy arrays or tensor_bytes.TensorSource, so a
file larger than memory streams). The tests check reading and writing against the library.
"""
import json
import math
import os
import struct
from typing import NamedTuple

import numpy as np

from Utils.file_io import atomic_write, read_json_object, write_json

from . import CheckpointError
from .tensor_bytes import TensorSource, bf16_bits_to_float32, storage_bytes

# the format's dtype codes -> (torch's dtype name, bytes per element)
DTYPES = {"BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
          "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "BOOL": ("bool", 1)}
CODES = {name: code for code, (name, _) in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the library refuses larger headers too
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafeTensor(NamedTuple):
    """One tensor of a file: where its bytes lie (path, absolute offset, byte count), dtype, shape."""
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple


def read_header(path: str) -> dict:
    """{name: SafeTensor} of one .safetensors file. The header is checked against the file: its length,
    JSON, each tensor's dtype, shape and data_offsets (inside the data, no two overlapping, as many
    bytes as dtype and shape make); a failure is a CheckpointError naming the file."""
    def bad(message):
        return CheckpointError(f"{path}: {message}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            length = f.read(8)
            if len(length) < 8:
                raise bad("shorter than the 8 bytes of a safetensors header length")
            (n,) = struct.unpack("<Q", length)
            if n > size - 8:
                raise bad(f"the header length {n} reaches past the end of the file ({size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise bad(f"a header of {n} bytes (more than {MAX_HEADER_BYTES}): not a safetensors file")
            raw = f.read(n)
    except OSError as exc:
        raise bad(f"cannot read it ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    header.pop("__metadata__", None)
    start, data_bytes = 8 + n, size - 8 - n
    tensors, spans = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            raise bad(f"tensor '{name}': no dtype of the format ({', '.join(DTYPES)})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        sizes_ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        if not sizes_ok:
            raise bad(f"tensor '{name}': shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise bad(f"tensor '{name}': data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise bad(f"tensor '{name}': data_offsets {offsets} lie outside the {data_bytes} bytes of data")
        dtype, itemsize = DTYPES[entry["dtype"]]
        nbytes = math.prod(shape) * itemsize  # exact: a crafted shape may not fit 64 bits
        if end - begin != nbytes:
            raise bad(f"tensor '{name}': dtype {entry['dtype']} and shape {shape} make {nbytes} bytes, its "
                      f"data_offsets {offsets} hold {end - begin}")
        spans.append((begin, end, name))
        tensors[name] = SafeTensor(str(path), start + begin, nbytes, dtype, tuple(shape))
    spans.sort()
    for (begin, end, name), (next_begin, next_end, next_name) in zip(spans, spans[1:]):
        if next_begin < end:
            raise bad(f"tensors '{name}' {[begin, end]} and '{next_name}' {[next_begin, next_end]} overlap")
    return tensors


def open_checkpoint(folder: str):
    """({name: SafeTensor}, source) of a folder's model.safetensors, or of the shards its
    model.safetensors.index.json names (every tensor in the file the index maps it to)."""
    index_path, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(index_path):
        if not os.path.isfile(single):
            raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE} (the weights)")
        return read_header(single), single
    weight_map = read_json_object(index_path, "shards").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no weight_map of tensor names to file names")
    tensors = {}
    for file in sorted(set(weight_map.values())):
        if file != os.path.basename(file) or file in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: '{file}' is not a file name in {folder}")
        if not os.path.isfile(os.path.join(folder, file)):
            raise FileNotFoundError(f"{index_path}: its shard {file} is missing")
        for name, tensor in read_header(os.path.join(folder, file)).items():
            if weight_map.get(name) != file:
                raise CheckpointError(f"{index_path}: tensor '{name}' of {file} is mapped to "
                                      f"{weight_map.get(name) or 'no file'}")
            tensors[name] = tensor
    absent = [name for name in weight_map if name not in tensors]
    if absent:
        raise CheckpointError(f"{index_path}: its shards do not hold {absent[:4]}")
    return tensors, f"{folder} ({len(set(weight_map.values()))} safetensors shards)"


def stored(source, bf16: bool) -> tuple:
    """(torch's dtype name, byte count) of a numpy array or TensorSource as written (bf16: floats as bfloat16)."""
    dtype = source.dtype if isinstance(source, TensorSource) else source.dtype.name
    if bf16 and dtype.startswith("float"):
        dtype = "bfloat16"
    if dtype not in CODES:
        raise CheckpointError(f"cannot save a {dtype} tensor in safetensors")
    return dtype, math.prod(source.shape) * DTYPES[CODES[dtype]][1]


def save_safetensors(tensors: dict, path: str, bf16: bool = False):
    """{name: numpy array or TensorSource} as one .safetensors file, atomically, tensor by tensor in
    the given order (a TensorSource is made only when it is written). bf16=True stores floats as
    bfloat16, rounded to nearest even."""
    entries, kinds, offset = {}, {}, 0
    for name, source in tensors.items():
        kinds[name], nbytes = stored(source, bf16)
        entries[name] = {"dtype": CODES[kinds[name]], "shape": [int(n) for n in source.shape],
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as the library writes it

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for name, source in tensors.items():
                f.write(storage_bytes(source, kinds[name]))
    atomic_write(path, write)


def save_checkpoint(tensors: dict, folder: str, max_shard_bytes: int = None, bf16: bool = False):
    """Hugging Face's layout: model.safetensors when one file is asked for or everything fits in one
    shard, else model-0000i-of-0000n.safetensors of at most max_shard_bytes each (a larger tensor
    alone) and model.safetensors.index.json."""
    shards, size = [[]], 0
    for name, source in tensors.items():
        nbytes = stored(source, bf16)[1]
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        save_safetensors(tensors, os.path.join(folder, SINGLE_FILE), bf16)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors({name: tensors[name] for name in names}, os.path.join(folder, file), bf16)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(stored(source, bf16)[1] for source in tensors.values())
    write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, os.path.join(folder, INDEX_FILE))


def read_arrays(path: str) -> dict:
    """{name: numpy array} of one small .safetensors file (an adapter's): bfloat16 widened to float32 exactly."""
    arrays = {}
    with open(path, "rb") as f:
        for name, tensor in read_header(path).items():
            f.seek(tensor.offset)
            element = np.dtype("uint16" if tensor.dtype == "bfloat16" else tensor.dtype).newbyteorder("<")
            array = np.frombuffer(f.read(tensor.nbytes), element).reshape(tensor.shape)
            bf16 = tensor.dtype == "bfloat16"
            arrays[name] = bf16_bits_to_float32(array) if bf16 else array.astype(array.dtype.newbyteorder("="))
    return arrays
