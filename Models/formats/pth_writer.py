"""PyTorch zip checkpoints (the torch.save format since 1.6) written without torch: `save_pth`, the
reader's counterpart (pth.py). Tensors go storage by storage; a TensorSource makes its array only when its
record is written, so a checkpoint larger than memory streams to disk."""
import collections
import os
import struct
import zipfile

import numpy as np

from Utils.file_io import atomic_write

from . import CheckpointError
from .pth import TORCH_STORAGES
from .tensor_bytes import TensorSource, storage_bytes

_STORAGE_NAMES = {dtype: name for name, dtype in TORCH_STORAGES.items()}
_ARCHIVE = "archive"  # the record prefix torch.save uses for file objects
_ALIGNMENT = 64  # torch starts every record's data on this boundary so storages can be mmapped


class _PickleWriter:
    """Writes data.pkl opcode by opcode. torch is not importable here, so pickle.Pickler could
    not name torch's rebuild function; hand-picked opcodes also keep to what
    torch.load(weights_only=True) accepts."""

    def __init__(self, path, bf16):
        self.path, self.bf16 = path, bf16
        self.out = bytearray(b"\x80\x02")  # PROTO 2, as torch.save writes
        self.storages = []  # contiguous little-endian arrays; the index is the record key

    def text(self, value):
        data = value.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data

    def emit(self, obj, where):
        if obj is None or isinstance(obj, bool):
            self.out += {None: b"N", True: b"\x88", False: b"\x89"}[obj]
        elif isinstance(obj, np.generic):
            self.emit(obj.item(), where)
        elif isinstance(obj, int):
            if -2**31 <= obj < 2**31:
                self.out += b"J" + struct.pack("<i", obj)
            else:
                data = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
                self.out += b"\x8a" + bytes([len(data)]) + data
        elif isinstance(obj, float):
            self.out += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            self.text(obj)
        elif isinstance(obj, (np.ndarray, TensorSource)):
            self.tensor(obj, where)
        elif isinstance(obj, (tuple, list)):
            self.out += b"(" if isinstance(obj, tuple) else b"]("
            for i, value in enumerate(obj):
                self.emit(value, f"{where}[{i}]")
            self.out += b"t" if isinstance(obj, tuple) else b"e"
        elif isinstance(obj, dict):
            is_ordered = isinstance(obj, collections.OrderedDict)
            self.out += b"ccollections\nOrderedDict\n)R(" if is_ordered else b"}("
            for key, value in obj.items():
                self.emit(key, where)
                self.emit(value, f"{where}.{key}" if where else str(key))
            self.out += b"u"
        else:
            raise CheckpointError(f"{self.path}: cannot save {type(obj).__name__} at '{where}'")

    def tensor(self, array, where):
        """torch._utils._rebuild_tensor_v2(storage, 0, shape, contiguous strides, False, {})."""
        dtype = array.dtype if isinstance(array, TensorSource) else array.dtype.name
        if self.bf16 and dtype.startswith("float"):
            dtype = "bfloat16"
        if dtype not in _STORAGE_NAMES:
            raise CheckpointError(f"{self.path}: cannot save {dtype} array at '{where}'")
        strides = [int(np.prod(array.shape[i + 1:])) for i in range(array.ndim)]
        self.out += b"ctorch._utils\n_rebuild_tensor_v2\n(("
        self.text("storage")
        self.out += f"ctorch\n{_STORAGE_NAMES[dtype]}\n".encode()
        self.text(str(len(self.storages)))
        self.text("cpu")
        self.emit(int(np.prod(array.shape)), where)
        self.out += b"tQ"  # the persistent id tuple, then BINPERSID
        self.storages.append((array, dtype))
        for item in [0, tuple(int(n) for n in array.shape), tuple(strides), False]:
            self.emit(item, where)
        self.out += b"ccollections\nOrderedDict\n)RtR"  # empty backward hooks, args tuple, call


def _write_record(archive, file, name, data):
    """One stored (uncompressed) record whose data starts on an _ALIGNMENT boundary."""
    data = memoryview(data).cast("B")
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.file_size = len(data)
    zip64 = len(data) * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule; adds a 20-byte extra
    start = file.tell() + 30 + len(name.encode()) + 4 + (20 if zip64 else 0)
    padding = -start % _ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding  # torch's padding field
    with archive.open(info, "w", force_zip64=zip64) as record:
        record.write(data)


def save_pth(obj, path, bf16=False):
    """Write containers of numpy arrays (or TensorSources) as a torch zip checkpoint, atomically.

    bf16=True stores floating arrays as bfloat16 (round to nearest even; float64 goes
    through float32 first; a uint16 TensorSource with bf16 is taken as bf16 bits). Other
    arrays keep their dtype. Storages are converted and written one at a time."""
    path = os.fspath(path)
    writer = _PickleWriter(path, bf16)
    writer.emit(obj, "")
    records = [("data.pkl", bytes(writer.out + b".")), (".format_version", b"1"),
               (".storage_alignment", str(_ALIGNMENT).encode()), ("byteorder", b"little")]
    storages = [(f"data/{key}", source) for key, source in enumerate(writer.storages)]

    def write(tmp):
        with open(tmp, "wb") as file:
            with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as archive:
                for name, data in records:
                    _write_record(archive, file, f"{_ARCHIVE}/{name}", data)
                for name, (source, dtype) in storages:
                    _write_record(archive, file, f"{_ARCHIVE}/{name}", storage_bytes(source, dtype))
                _write_record(archive, file, f"{_ARCHIVE}/version", b"3\n")
    atomic_write(path, write)
