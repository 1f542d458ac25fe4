"""Checkpoint bytes straight into the base's Vars: the read op both base loaders use (meta.py, hf.py).

Each tensor's bytes go from the file into a Jittor Var of the file's dtype through a pread inside a
jt.code op: no numpy copy (bf16 has no numpy dtype to pass through), an fp32 base widens bf16
inside the read, and a Hugging Face q_proj/k_proj gets Meta's row order while it is read (hf.py
says why). An int8 or nf4 base's matrices are quantized as they are read, a block of rows at a time
(read_quantized), so the checkpoint's matrices never exist whole in its type. Every base parameter
first points at its read op, then one sync runs them all, so a 16 GB bf16 checkpoint needs about
16 GB, not the 32 GB of an fp32 copy (about 8 GB in int8), and the model's random initialisation is
never run.

Every tensor is checked finite while it is read: each chunk's elements are compared, while the chunk
is still in the cache, against the smallest magnitude that is not finite in the model (NaN and inf
as stored, and fp32 values past bf16's range in a bf16 base, which rounding would make inf). The
count is one integer per tensor, the file's bytes are read once, and a corrupted base is refused
naming the tensor and its file (NonFiniteBase) before the model ever runs. Its cost, measured on a
512 MiB fp32 and a 256 MiB bf16 tensor read from the page cache (2-core EPYC, medians of 7): 20-30 ms
a tensor, +15-30% of such a read; a read from disk is slower than the check by far. A quantized read
counts the NaN and inf among the values it converts.
"""
import os
import re
from typing import NamedTuple

import Utils.jittor_env  # noqa: F401
import jittor as jt

from ..kernels import cpp
from ..kernels.bf16 import cast_to
from ..kernels.nf4 import nf4_shapes
from . import CheckpointError

# The smallest magnitude (the bits of a stored element, sign cleared) that is not finite in the model:
# the stored format's infinity, lower where the model's format is narrower. fp32 rounds to bf16 (to
# nearest even) as inf from 0x7f7f8000 on; float64 casts to fp32 as inf from 2^128 - 2^103 on, and to
# bf16 (through fp32) from the midpoint below fp32's 0x7f7f8000. Jittor's code op takes its data as
# doubles: each bound is exact in one.
NOT_FINITE_FROM = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000, "float64": 0x7FF0000000000000}
NARROWED_NOT_FINITE_FROM = {("float32", "bfloat16"): 0x7F7F8000, ("float64", "float32"): 0x47EFFFFFF0000000,
                            ("float64", "bfloat16"): 0x47EFEFFFF0000000}
ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
CHUNK_BYTES = 1 << 20  # read and checked a chunk at a time, while it is in the cache

READ_HEADER = cpp.source("read_file.h")
QUANTIZED_READ_HEADER = cpp.source("read_quantized.h")
QUANTIZED_READ = cpp.source("read_quantized.cc")
# the C++ type of each stored element type (cpp/read_quantized.h)
STORED_TYPES = {"bfloat16": "BF16Bits", "float16": "HalfBits", "float32": "float"}
QUANTIZED_BLOCK_BYTES = 1 << 20  # fp32 rows each thread converts and quantizes at once (and their raw bytes)
# out0 <- nbytes of fd from offset, in `rows` equal rows, each read CHUNK bytes at a time; out1 <- the
# elements not finite in the model. head_dim > 0: within each head of head_dim rows, row 2i+c is read
# from row c*head_dim/2+i (the halves of a Hugging Face head -> Meta's pairs).
READ_SOURCE = """
const int fd = (int)data["fd"];
const int64_t offset = (int64_t)data["offset"], nbytes = (int64_t)data["nbytes"], item = (int64_t)data["item"];
const int64_t rows = (int64_t)data["rows"], hd = (int64_t)data["head_dim"], row_bytes = nbytes / rows;
const int64_t chunk = (int64_t)data["chunk"];
const uint64_t from = (uint64_t)data["not_finite_from"];
char *dst = (char *)out0_p + (int64_t)data["skip"];
int64_t bad = 0;
for (int64_t r = 0; r < rows; r++) {
    const int64_t j = hd > 0 ? r % hd : 0, source_row = hd > 0 ? r - j + (j % 2) * (hd / 2) + j / 2 : r;
    for (int64_t done = 0; done < row_bytes; done += chunk) {
        const int64_t n = std::min(chunk, row_bytes - done), at = offset + source_row * row_bytes + done;
        char *into = dst + r * row_bytes + done;
        if (!read_fully(fd, into, n, at))
            LOGf << "could not read" << n << "bytes at" << at;
        bad += not_finite(into, n, item, from);
    }
}
out1_p[0] = bad;
"""
# bf16 read into the back half of an fp32 output, widened front to back in place: element i is
# written to bytes [4i, 4i+4), below every bf16 element j > i still to read at 2n + 2j.
WIDEN_SOURCE = """
const int64_t n = nbytes / 2;
const uint16_t *bits = (const uint16_t *)((char *)out0_p + 2 * n);
uint32_t *words = (uint32_t *)out0_p;
for (int64_t i = 0; i < n; i++) words[i] = uint32_t(bits[i]) << 16;
"""
# in0 (a tensor already in memory, its stored bits) -> out0 [1]: its elements not finite in the model
COUNT_SOURCE = 'out0_p[0] = not_finite((const char *)in0_p, in0->size, (int64_t)data["item"], (uint64_t)data["from"]);'


class NonFiniteBase(CheckpointError):
    """A base tensor holding NaN or inf (or values the model's precision makes inf): never loaded."""


class Check(NamedTuple):
    """One stored tensor's count of elements not finite in the model ([1] int64, computed by the op
    that reads it), where it lies (file, name in the file) and what was counted."""
    count: jt.Var
    path: str
    name: str
    what: str


class TensorRead(NamedTuple):
    """One tensor as read: its Var (a quantized matrix: its (values, scales) pair) and a Check per stored
    part (a tensor of several shards has several)."""
    value: object
    checks: list


def not_finite_rule(stored: str, dtype: str) -> tuple:
    """(the magnitude bits from which a `stored` element is not finite as `dtype`, what that means);
    (0, '') for integers, which are always finite."""
    stored, dtype = str(stored), str(dtype)  # a Var's dtype is Jittor's NanoString
    if (stored, dtype) in NARROWED_NOT_FINITE_FROM:
        return NARROWED_NOT_FINITE_FROM[stored, dtype], f"NaN, inf, or past the range of the model's {dtype}"
    return NOT_FINITE_FROM.get(stored, 0), "NaN or inf"


def read_var(fd: int, offset: int, nbytes: int, shape: tuple, stored: str, dtype: str, head_dim: int = 0,
             where: tuple = ("", "")) -> TensorRead:
    """The tensor of `shape` stored as `stored` (bfloat16, float16, float32) in bytes [offset, offset +
    nbytes) of fd, read when the Var is executed, and checked finite as `dtype`; `where` is (the file,
    the tensor's name in it). A bf16 tensor read for an fp32 Var (`dtype`) widens in the read; any other
    change of dtype is the caller's cast. head_dim > 0 puts the rows of each head (dim 0) from halves
    into adjacent pairs."""
    widen = stored == "bfloat16" and dtype == "float32"
    rows = shape[0] if head_dim else 1
    start, what = not_finite_rule(stored, dtype)
    value, count = jt.code([shape, (1,)], [dtype if widen else stored, "int64"], [], cpu_header=READ_HEADER,
                           cpu_src=READ_SOURCE + (WIDEN_SOURCE if widen else ""),
                           data={"fd": fd, "offset": offset, "nbytes": nbytes, "skip": nbytes if widen else 0,
                                 "rows": rows, "head_dim": head_dim, "chunk": CHUNK_BYTES,
                                 "item": ITEM_BYTES.get(stored, 1), "not_finite_from": start})
    return TensorRead(value, [Check(count, *where, what)])


def checked_in_memory(value: jt.Var, stored: str, dtype: str, where: tuple) -> TensorRead:
    """A tensor that came through numpy instead of a read op (`value`: its stored bits), checked by the
    same rule."""
    start, what = not_finite_rule(stored, dtype)
    count = jt.code((1,), "int64", [value], cpu_header=READ_HEADER, cpu_src=COUNT_SOURCE,
                    data={"item": ITEM_BYTES.get(stored, 1), "from": start})
    return TensorRead(value, [Check(count, *where, what)])


def read_quantized(parts: list, shape: tuple, stored: str, head_dim: int = 0, where: tuple = ("", ""),
                   storage: str = "int8") -> TensorRead:
    """(values [N,K] int8, scale [N] fp32), or with `storage` uint8 (nf4: nf4.py) (codes [N,K/2], scales
    [N, ceil(K/64)] bf16), of the matrix of `shape` stored as `stored` (bfloat16, float16, float32) in `parts`,
    each (fd, offset, row0, rows, col0, cols): a rectangle of the matrix whose rows lie one after another in fd
    from offset. Read, counted finite and quantized a block of rows at a time when
    the Vars are executed; head_dim > 0 puts the rows of each head from halves into adjacent pairs
    (read_var); `where` is (the file, the tensor's name in it)."""
    N, K = shape
    block = max(1, QUANTIZED_BLOCK_BYTES // (4 * K))
    block = max(head_dim, block // head_dim * head_dim) if head_dim else block
    numbers = cpp.Numbers().declare(N=N, K=K, BLOCK=block)
    numbers.data.update({"parts": len(parts), "head_dim": head_dim})
    for i, part in enumerate(parts):
        keys = (f"{key}{i}" for key in ("fd", "offset", "row0", "rows", "col0", "cols"))
        numbers.data.update(zip(keys, part))
    nf4 = storage == "uint8"
    outputs = nf4_shapes(N, K) if nf4 else [(N, K), (N,)]
    types = f"typedef {STORED_TYPES[stored]} STORED;\n" + ("typedef uint8_t VALUES;\ntypedef uint16_t SCALES;\n" if nf4
                                                            else "typedef int8_t VALUES;\ntypedef float SCALES;\n")
    values, scale, count = jt.code(outputs + [(1,)], [storage, "bfloat16" if nf4 else "float32", "int64"], [],
                                   cpu_header=QUANTIZED_READ_HEADER, data=numbers.data,
                                   cpu_src=numbers.code + types + QUANTIZED_READ)
    return TensorRead((values, scale), [Check(count, *where, "NaN or inf")])


def op_failure(exc: RuntimeError) -> str:
    """What a failed read op's C++ said (Jittor wraps it in a report, after `[Reason]:` and a log prefix),
    else the error's first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"\[Reason\]: (?:\[[^\]]*\] )?(.*)", text)
    return (found.group(1) if found else text.splitlines()[0]).strip()


def fill_base(base: dict, value_of, paths: list, source: str, scales: dict = None):
    """Point every Var of `base` (name -> Var) at value_of(name, var, fds) (a TensorRead; fds: path ->
    open file descriptor of `paths`), cast to the Var's dtype, then run them all in one sync, with the
    counts of elements that are not finite. A quantized matrix's value is its (values, scales) pair
    (read_quantized), the scales going to `scales[name]`. One sync, because any Jittor sync runs every
    pending Var: syncing tensor by tensor would execute the random initialisation of all parameters not
    yet replaced (a full fp32 model) at the first one."""
    scales = scales or {}
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    try:
        checks = []
        for name, var in base.items():
            read = value_of(name, var, fds)
            if name in scales:
                var.assign(read.value[0])
                scales[name].assign(read.value[1])
            else:
                var.assign(cast_to(read.value, var.dtype))
            checks += read.checks
        counts = jt.concat([check.count for check in checks])
        try:
            jt.sync(list(base.values()) + list(scales.values()) + [counts])
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: reading the tensors failed ({op_failure(exc)})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
    bad = [(check, int(n)) for check, n in zip(checks, counts.numpy()) if n > 0]
    if bad:
        (check, n), more = bad[0], len(bad) - 1
        raise NonFiniteBase(f"{check.path}: tensor '{check.name}' holds {n} value(s) that are {check.what}"
                            f"{f' ({more} more tensor(s) do too)' if more else ''}: a corrupted download? "
                            "This base cannot be used")
