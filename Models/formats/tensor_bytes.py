"""Tensors as the bytes the checkpoint formats store (pth.py, pth_writer.py and safetensors.py): bfloat16 as the top
half of an fp32's bits, and tensors a writer asks for one at a time (TensorSource)."""
import numpy as np

from . import CheckpointError


def bf16_bits_to_float32(bits):
    """bfloat16 bit patterns (uint16) -> float32, exactly: bf16 is the top half of an fp32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(values):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties to even."""
    values = np.asarray(values, dtype=np.float32, order="C")
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40  # rounding could turn a NaN payload into inf
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


class TensorSource:
    """A tensor a writer (save_pth, save_safetensors) asks for only when it writes that tensor's
    record: `make()` returns the array of `shape`, so a checkpoint larger than memory streams to
    disk. `dtype` is torch's name ('bfloat16': make returns the uint16 bits, or floats to round)."""

    def __init__(self, shape, dtype, make):
        self.shape, self.dtype, self.make = tuple(shape), dtype, make
        self.ndim = len(self.shape)


def storage_bytes(source, dtype):
    """The little-endian bytes of one storage, converting floats to bf16 where asked."""
    array = source.make() if isinstance(source, TensorSource) else source
    if tuple(array.shape) != tuple(source.shape):
        raise CheckpointError(f"a TensorSource made shape {list(array.shape)}, not {list(source.shape)}")
    if dtype == "bfloat16" and array.dtype != np.uint16:
        array = float32_to_bf16_bits(array.astype(np.float32))
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1)
