"""Checkpoint bytes straight into the base's Vars: the read ops both base loaders use (meta.py, hf.py).

Each tensor's bytes go from the file into a Jittor Var of the file's dtype through a pread inside a
jt.code op: no numpy copy (bf16 has no numpy dtype to pass through), an fp32 base widens bf16
inside the read, and a Hugging Face q_proj/k_proj gets Meta's row order while it is read (hf.py
says why). An int8 base's matrices are quantized as they are read, a block of rows at a time
(read_quantized), so the checkpoint's matrices never exist whole in its type. Every base parameter
first points at its read op, then one sync runs them all, so a 16 GB bf16 checkpoint needs about
16 GB, not the 32 GB of an fp32 copy (about 8 GB in int8), and the model's random initialisation is
never run.
"""
import os
import re

import Utils.jittor_env  # noqa: F401
import jittor as jt

from ..kernels import cpp
from ..kernels.precision import cast_to
from .pth import CheckpointError

READ_HEADER = cpp.source("read_file.h")
QUANTIZED_READ_HEADER = cpp.source("read_quantized.h")
QUANTIZED_READ = cpp.source("read_quantized.cc")
# the C++ type of each stored element type (cpp/read_quantized.h)
STORED_TYPES = {"bfloat16": "BF16Bits", "float16": "HalfBits", "float32": "float"}
QUANTIZED_BLOCK_BYTES = 2 << 20  # fp32 rows each thread converts and quantizes at once
# out0 <- nbytes of fd from offset, in `rows` equal rows. head_dim > 0: within each head of head_dim
# rows, row 2i+c is read from row c*head_dim/2+i (the halves of a Hugging Face head -> Meta's pairs).
READ_SOURCE = """
const int fd = (int)data["fd"];
const int64_t offset = (int64_t)data["offset"], nbytes = (int64_t)data["nbytes"];
const int64_t rows = (int64_t)data["rows"], hd = (int64_t)data["head_dim"], row_bytes = nbytes / rows;
char *dst = (char *)out0_p + (int64_t)data["skip"];
for (int64_t r = 0; r < rows; r++) {
    const int64_t j = hd > 0 ? r % hd : 0, from = hd > 0 ? r - j + (j % 2) * (hd / 2) + j / 2 : r;
    if (!read_fully(fd, dst + r * row_bytes, row_bytes, offset + from * row_bytes))
        LOGf << "could not read" << row_bytes << "bytes at" << offset + from * row_bytes;
}
"""
# bf16 read into the back half of an fp32 output, widened front to back in place: element i is
# written to bytes [4i, 4i+4), below every bf16 element j > i still to read at 2n + 2j.
WIDEN_SOURCE = """
const int64_t n = nbytes / 2;
const uint16_t *bits = (const uint16_t *)((char *)out0_p + 2 * n);
uint32_t *words = (uint32_t *)out0_p;
for (int64_t i = 0; i < n; i++) words[i] = uint32_t(bits[i]) << 16;
"""


def read_var(fd: int, offset: int, nbytes: int, shape: tuple, stored: str, dtype: str, head_dim: int = 0) -> jt.Var:
    """The tensor of `shape` stored as `stored` (bfloat16, float16, float32) in bytes [offset, offset +
    nbytes) of fd, read when the Var is executed: a bf16 tensor read for an fp32 Var (`dtype`) widens in
    the read; any other change of dtype is the caller's cast. head_dim > 0 puts the rows of each head
    (dim 0) from halves into adjacent pairs."""
    widen = stored == "bfloat16" and dtype == "float32"
    rows = shape[0] if head_dim else 1
    return jt.code(shape, dtype if widen else stored, [], cpu_header=READ_HEADER,
                   cpu_src=READ_SOURCE + (WIDEN_SOURCE if widen else ""),
                   data={"fd": fd, "offset": offset, "nbytes": nbytes, "skip": nbytes if widen else 0,
                         "rows": rows, "head_dim": head_dim})


def read_quantized(parts: list, shape: tuple, stored: str, head_dim: int = 0) -> tuple:
    """(values [N,K] int8, scale [N] fp32) of the matrix of `shape` stored as `stored` (bfloat16, float16,
    float32) in `parts`, each (fd, offset, row0, rows, col0, cols): a rectangle of the matrix whose rows lie
    one after another in fd from offset. Read and quantized row by row when the Vars are executed;
    head_dim > 0 puts the rows of each head from halves into adjacent pairs (read_var)."""
    N, K = shape
    block = max(1, QUANTIZED_BLOCK_BYTES // (4 * K))
    block = max(head_dim, block // head_dim * head_dim) if head_dim else block
    data = {"parts": len(parts), "head_dim": head_dim}
    for i, part in enumerate(parts):
        data.update({f"{key}{i}": value for key, value in zip(("fd", "offset", "row0", "rows", "col0", "cols"), part)})
    sizes = f"const int64_t N = {N}, K = {K}, BLOCK = {block}; typedef {STORED_TYPES[stored]} STORED;\n"
    return tuple(jt.code([(N, K), (N,)], ["int8", "float32"], [], cpu_header=QUANTIZED_READ_HEADER,
                         cpu_src=sizes + QUANTIZED_READ, data=data))


def op_failure(exc: RuntimeError) -> str:
    """What a failed read op's C++ said (Jittor wraps it in a report, after `[Reason]:` and a log prefix),
    else the error's first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"\[Reason\]: (?:\[[^\]]*\] )?(.*)", text)
    return (found.group(1) if found else text.splitlines()[0]).strip()


def fill_base(base: dict, value_of, paths: list, source: str, scales: dict = None):
    """Point every Var of `base` (name -> Var) at value_of(name, var, fds) (fds: path -> open file
    descriptor of `paths`), cast to the Var's dtype, then run them all in one sync. An int8 matrix's value
    is its (values, row scales) pair (read_quantized), the scales going to `scales[name]`. One sync,
    because any Jittor sync runs every pending Var: syncing tensor by tensor would execute the random
    initialisation of all parameters not yet replaced (a full fp32 model) at the first one."""
    scales = scales or {}
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    try:
        for name, var in base.items():
            value = value_of(name, var, fds)
            if name in scales:
                var.assign(value[0])
                scales[name].assign(value[1])
            else:
                var.assign(cast_to(value, var.dtype))
        try:
            jt.sync(list(base.values()) + list(scales.values()))
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: reading the tensors failed ({op_failure(exc)})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
