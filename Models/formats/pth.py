"""PyTorch zip checkpoints (the torch.save format since 1.6), read without torch (pth_writer.py writes them).

A checkpoint is a zip holding `<prefix>/data.pkl` (a pickle of the containers) and
`<prefix>/data/<key>` (one raw storage per key). Plain unpickling would run any
callable the pickle names, so `load_pth` resolves globals through an allow-list:
only the tensor rebuild functions, storage/dtype markers, plain containers and an
argparse.Namespace of plain values (PlainNamespace).
Tensors come back as numpy arrays; bfloat16 becomes float32 exactly.
"""
import collections
import io
import math
import os
import pickle
import struct
import zipfile

import numpy as np

from . import CheckpointError
from .tensor_bytes import bf16_bits_to_float32


# Bounds on what a record may make of its bytes, checked from the zip's declared sizes before a byte is
# read or decompressed: torch stores its records, and deflate of real tensors gains little, so a
# record that would expand more than this is a zip bomb, not a checkpoint.
MAX_COMPRESSION_RATIO = 20
SMALL_RECORD = 64  # byteorder, version: a few bytes


# Stand-ins for torch dtypes and storage classes. Immutable, because a pickle's BUILD opcode
# may set attributes on any object it can name, and these are shared between loads.
_DType = collections.namedtuple("_DType", "name numpy_code")  # bfloat16 reads as uint16 bits
_StorageType = collections.namedtuple("_StorageType", "dtype")


def _numpy_dtype(dtype, byteorder="little"):
    return np.dtype(dtype.numpy_code).newbyteorder("<" if byteorder == "little" else ">")


_DTYPES = {name: _DType(name, code) for name, code in [
    ("float32", "f4"), ("float64", "f8"), ("float16", "f2"), ("bfloat16", "u2"),
    ("int64", "i8"), ("int32", "i4"), ("int16", "i2"), ("int8", "i1"), ("uint8", "u1"),
    ("uint16", "u2"), ("uint32", "u4"), ("uint64", "u8"), ("bool", "?"),
    ("complex64", "c8"), ("complex128", "c16")]}

# Legacy typed storage classes, as torch.save names them in each storage's persistent id.
TORCH_STORAGES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


_UNTYPED_STORAGE = _StorageType(_DTYPES["uint8"])  # torch reads untyped storages as bytes

_PLAIN = (type(None), bool, int, float, str)


def _is_plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (list, tuple)) and all(map(_is_plain, value)))


class PlainNamespace:
    """What an argparse.Namespace in a checkpoint (the authors' training 'args') loads as:
    its attributes, which must be plain values (None, bool, int, float, str, lists of
    them). The pickle can only create it empty and fill it through __setstate__, which
    checks every value, so a Namespace can carry no object of any other kind."""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:
            raise TypeError("an argparse.Namespace is rebuilt empty, then filled from its state")
        return super().__new__(cls)

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise TypeError(f"argparse.Namespace with a non-plain state {type(state).__name__}")
        bad = [k for k, v in state.items() if not (isinstance(k, str) and not k.startswith("__") and _is_plain(v))]
        if bad:
            raise TypeError(f"argparse.Namespace with non-plain value(s) or name(s): {bad!r:.120}")
        self.__dict__.update(state)

    def __repr__(self):
        return f"Namespace({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class _Storage:
    """One `data/<key>` record. Eager reads take the whole record through zipfile (CRC
    checked); lazy ones pread a byte range of the stored record straight from the file,
    so a large checkpoint is read one tensor at a time and never held twice."""

    def __init__(self, reader, key, dtype, numel):
        self.reader, self.key, self.dtype, self.numel = reader, key, dtype, numel
        self.nbytes = numel * _numpy_dtype(dtype).itemsize
        self.file_offset = reader.data_offset(f"data/{key}", self.nbytes) if reader.lazy else None

    def read(self, start, nbytes):
        """Bytes [start, start + nbytes) of the storage, as a writable buffer."""
        if self.file_offset is None:
            raw = self.reader.record(f"data/{self.key}", self.nbytes, what=f"storage '{self.key}'")
            return bytearray(memoryview(raw)[start:start + nbytes])
        buffer = bytearray(nbytes)
        with open(self.reader.path, "rb") as f:
            f.seek(self.file_offset + start)
            got = f.readinto(buffer)
        if got != nbytes:
            raise self.reader.error(f"storage '{self.key}' ends after {got} of {nbytes} bytes (truncated file?)")
        return buffer


class StoredTensor:
    """A tensor of a checkpoint opened with load_pth(lazy=True): shape and dtype now, data
    on `numpy()`. `file_range()` gives the bytes a contiguous little-endian tensor occupies
    in the file, for readers that copy them straight into their own storage."""

    def __init__(self, storage, offset, shape, stride, dtype, element):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride
        self.dtype, self.element = dtype, element  # torch's dtype name; the numpy element (bf16: uint16)
        self.size = math.prod(shape)  # exact: a crafted shape may not fit 64 bits
        self.nbytes = self.size * element.itemsize
        self.contiguous = list(stride) == [math.prod(shape[i + 1:]) for i in range(len(shape))]

    def numpy(self):
        """The tensor as an owned, native-order numpy array (bfloat16 as its uint16 bits)."""
        native = self.element.newbyteorder("=")
        if self.size == 0:
            return np.empty(self.shape, dtype=native)
        if self.contiguous:
            flat = np.frombuffer(self.storage.read(self.offset * self.element.itemsize, self.nbytes), self.element)
            return flat.reshape(self.shape).astype(native, copy=False)
        raw = self.storage.read(0, self.storage.nbytes)
        flat = np.frombuffer(raw, self.element, count=len(raw) // self.element.itemsize)
        view = np.lib.stride_tricks.as_strided(flat[self.offset:], shape=self.shape, writeable=False,
                                               strides=[s * flat.itemsize for s in self.stride])
        return np.array(view, dtype=native)

    def file_range(self):
        """(file offset, byte count) of a contiguous little-endian tensor of a lazy file, else None."""
        if self.storage.file_offset is None or not self.contiguous or self.element.byteorder == ">":
            return None
        return self.storage.file_offset + self.offset * self.element.itemsize, self.nbytes


class _CheckpointReader(pickle.Unpickler):
    """Unpickles data.pkl, resolving globals only from the allow-list below."""

    def __init__(self, path, archive, prefix, lazy=False):
        self.path, self.archive, self.prefix, self.lazy = path, archive, prefix, lazy
        self.file_size = os.path.getsize(path)
        self.byteorder = "little"
        if prefix + "byteorder" in archive.namelist():
            self.byteorder = self.record("byteorder", limit=SMALL_RECORD).decode("ascii", "replace").strip()
            if self.byteorder not in ("little", "big"):
                raise self.error(f"unknown byteorder '{self.byteorder}'")
        super().__init__(io.BytesIO(self.record("data.pkl")))
        self.allowed = {
            ("torch._utils", "_rebuild_tensor"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_tensor_v3,
            ("torch._utils", "_rebuild_parameter"): lambda data, *flags: data,
            ("torch", "UntypedStorage"): _UNTYPED_STORAGE,
            ("torch.storage", "UntypedStorage"): _UNTYPED_STORAGE,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("argparse", "Namespace"): PlainNamespace,  # the authors' checkpoint-N.pth keeps its run's args
            **{("builtins", c.__name__): c for c in (dict, list, tuple, set, frozenset)},
            **{("torch", name): _StorageType(_DTYPES[dtype]) for name, dtype in TORCH_STORAGES.items()},
            **{("torch", name): dtype for name, dtype in _DTYPES.items()},
        }

    def error(self, message):
        return CheckpointError(f"{self.path}: {message}")

    def record(self, name, expected: int = None, limit: int = None, what: str = None):
        """The bytes of a record, after its declared size is checked: `expected` bytes exactly (a storage,
        whose size the pickle declares), at most `limit`, and never more than MAX_COMPRESSION_RATIO
        times what it takes in the file."""
        try:
            info = self.archive.getinfo(self.prefix + name)
        except KeyError:
            raise self.error(f"record '{self.prefix}{name}' is missing") from None
        where = what or f"record '{self.prefix}{name}'"
        if expected is not None and info.file_size != expected:
            raise self.error(f"{where} has {info.file_size} bytes, expected {expected}")
        if limit is not None and info.file_size > limit:
            raise self.error(f"{where} declares {info.file_size} bytes, more than the {limit} it may have")
        if info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1) \
                or info.compress_size > self.file_size:
            raise self.error(f"{where} declares {info.file_size} bytes from {info.compress_size} stored: not a "
                             "checkpoint's record (torch stores records uncompressed); refused before reading it")
        try:
            return self.archive.read(self.prefix + name)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            raise self.error(f"{where} is unreadable ({exc})") from exc

    def data_offset(self, name, nbytes):
        """Where a stored (uncompressed) record's data starts in the file, after its local header."""
        try:
            info = self.archive.getinfo(self.prefix + name)
        except KeyError:
            raise self.error(f"record '{self.prefix}{name}' is missing") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise self.error(f"record '{self.prefix}{name}' is compressed, where torch stores its tensors' bytes "
                             "as they are (read lazily, straight from the file)")
        if info.file_size != nbytes:
            raise self.error(f"record '{self.prefix}{name}' has {info.file_size} bytes, expected {nbytes}")
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise self.error(f"record '{self.prefix}{name}' has no local header")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_length + extra_length
        if start + nbytes > self.file_size:
            raise self.error(f"record '{self.prefix}{name}' runs past the end of the file (truncated?)")
        return start

    def find_class(self, module, name):
        found = self.allowed.get((module, name))
        if found is None:
            raise self.error(f"refusing to load global '{module}.{name}' "
                             "(only tensors, storages, plain containers and argparse.Namespace are allowed)")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise self.error(f"unsupported persistent id {pid!r:.80}")
        storage_type, key, _location, numel = pid[1:]
        dtype = storage_type if isinstance(storage_type, _DType) else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, _DType) or not isinstance(numel, int) or numel < 0:
            raise self.error(f"malformed storage reference {pid!r:.80}")
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        return _Storage(self, key, dtype, numel)

    def _rebuild_tensor(self, storage, offset, size, stride, *_flags):
        return self._rebuild_tensor_v3(storage, offset, size, stride, None, None, None)

    def _rebuild_tensor_v3(self, storage, offset, size, stride, _grad, _hooks, dtype, *_meta):
        """The torch view (offset, size, stride in elements of dtype) as an owned numpy array."""
        dtype = dtype or getattr(storage, "dtype", None)
        if not isinstance(storage, _Storage) or not isinstance(dtype, _DType):
            raise self.error("tensor without a storage or dtype")
        where = f"tensor on storage '{storage.key}'"
        if not all(isinstance(v, int) and v >= 0 for v in (offset, *size, *stride)) \
                or len(size) != len(stride):
            raise self.error(f"{where} has a bad view: offset {offset}, size {size}, stride {stride}")
        element = _numpy_dtype(dtype, self.byteorder)  # differs from the storage's dtype for v3 views
        count = storage.nbytes // element.itemsize
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if 0 not in size and last >= count:
            raise self.error(f"{where} reads element {last} of {count}")
        tensor = StoredTensor(storage, offset, tuple(size), tuple(stride), dtype.name, element)
        if self.lazy:
            return tensor
        array = tensor.numpy()
        return bf16_bits_to_float32(array) if dtype.name == "bfloat16" else array


def _materialise(obj, reader, seen):
    """Bare storages (saved without a tensor; rare) become 1-D arrays. Each container is
    visited once, so shared or cyclic containers in a crafted pickle cannot blow up the walk."""
    if isinstance(obj, _Storage):
        return reader._rebuild_tensor(obj, 0, (obj.numel,), (1,))
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
        return obj
    seen.add(id(obj))
    if isinstance(obj, tuple):
        return tuple(_materialise(value, reader, seen) for value in obj)
    for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
        obj[key] = _materialise(value, reader, seen)
    return obj


def load_pth(path, lazy=False):
    """Load a torch zip checkpoint as its containers with numpy arrays in place of tensors.

    lazy=True puts a StoredTensor (shape, dtype, data read on demand) in place of each
    tensor instead, keeping bfloat16 as bfloat16; the archive must be stored, as torch writes it."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the open; a folder fail it
        raise CheckpointError(f"{path}: not a regular file (a checkpoint is read with seeks)")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc})") from exc
    if not zipfile.is_zipfile(path):
        if head.startswith(b"\x80"):
            raise CheckpointError(f"{path}: legacy (pre-1.6, non-zip) torch pickle; refusing to "
                                  "load it, re-save it with torch.save from torch >= 1.6")
        if head.startswith(b"PK"):
            raise CheckpointError(f"{path}: truncated or damaged zip archive")
        raise CheckpointError(f"{path}: not a torch zip checkpoint")
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise CheckpointError(f"{path}: expected one '<prefix>/data.pkl', found {len(pickles)}")
            reader = _CheckpointReader(path, archive, pickles[0][:-len("data.pkl")], lazy)
            try:
                return _materialise(reader.load(), reader, set())
            except CheckpointError:
                raise
            except Exception as exc:  # malformed pickle: wrong opcodes, arguments, truncation
                raise CheckpointError(f"{path}: bad data.pkl ({type(exc).__name__}: {exc})") from exc
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{path}: damaged zip archive ({exc})") from exc
