"""Checkpoint bytes straight into the base's Vars: the read op both base loaders use (meta.py, hf.py).

Each tensor's bytes go from the file into a Jittor Var of the file's dtype through a pread inside a
jt.code op: no numpy copy (bf16 has no numpy dtype to pass through), an fp32 base widens bf16
inside the read, and a Hugging Face q_proj/k_proj gets Meta's row order while it is read (hf.py
says why). Every base parameter first points at its read op, then one sync runs them all, so a
16 GB bf16 checkpoint needs about 16 GB, not the 32 GB of an fp32 copy, and the model's random
initialisation is never run.
"""
import os

import Utils.jittor_env  # noqa: F401
import jittor as jt

from ..kernels.precision import cast_to
from .pth import CheckpointError

READ_HEADER = """
#include <unistd.h>
#include <cstdint>
// nbytes of fd from offset into dst; pread may return less than asked (2 GB cap)
static bool read_fully(int fd, char *dst, int64_t nbytes, int64_t offset) {
    int64_t done = 0;
    while (done < nbytes) {
        ssize_t got = pread(fd, dst + done, nbytes - done, offset + done);
        if (got <= 0) return false;
        done += got;
    }
    return true;
}
"""
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


def fill_base(base: dict, value_of, paths: list, source: str):
    """Point every Var of `base` (name -> Var) at value_of(name, var, fds) (fds: path -> open file
    descriptor of `paths`), cast to the Var's dtype, then run them all in one sync. One sync, because
    any Jittor sync runs every pending Var: syncing tensor by tensor would execute the random
    initialisation of all parameters not yet replaced (a full fp32 model) at the first one."""
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    try:
        for name, var in base.items():
            var.assign(cast_to(value_of(name, var, fds), var.dtype))
        try:
            jt.sync(list(base.values()))
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: reading the tensors failed ({str(exc).splitlines()[0]})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
