"""Meta checkpoint directories: params.json plus consolidated.NN.pth shards -> the frozen base.

Every .pth goes through Models.formats.pth.load_pth, an allow-list unpickler that never runs
code named by the file. Meta's names are our attribute names under `llama.`.

The base is loaded tensor by tensor: the shards are opened lazily (shapes only), then
each tensor's bytes go from the file straight into a Jittor Var of the file's dtype
(a pread inside a jt.code op: no numpy copy, and bf16 has no numpy dtype to pass
through), are cast only if the base stores another precision, and replace the
parameter before the next one is read. A 16 GB bf16 file thus needs about 16 GB, not
the 32 GB of an fp32 copy; the model's random initialisation is replaced before it runs.
"""
import glob
import os

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .adapters import IGNORED_META_KEYS, check_strict
from ..LLaMA_Adapter import LLaMA_adapter
from ..ModelArgs import ModelArgs
from ..kernels.precision import cast_to
from ..Tokenizer import Tokenizer
from .pth import CheckpointError, StoredTensor, load_pth

READ_HEADER = "#include <unistd.h>\n#include <cstdint>\n"
# out0 <- nbytes of file descriptor fd from offset; pread may return less than asked (2 GB cap)
READ_SOURCE = """
const int fd = (int)data["fd"];
const int64_t offset = (int64_t)data["offset"], nbytes = (int64_t)data["nbytes"];
char *dst = (char *)out0_p + (int64_t)data["skip"];
int64_t done = 0;
while (done < nbytes) {
    ssize_t got = pread(fd, dst + done, nbytes - done, offset + done);
    if (got <= 0) break;
    done += got;
}
if (done != nbytes) LOGf << "read" << done << "of" << nbytes << "bytes";
"""
# bf16 read into the back half of an fp32 output, widened front to back in place: element i is
# written to bytes [4i, 4i+4), below every bf16 element j > i still to read at 2n + 2j.
WIDEN_SOURCE = """
const int64_t n = nbytes / 2;
const uint16_t *bits = (const uint16_t *)((char *)out0_p + 2 * n);
uint32_t *words = (uint32_t *)out0_p;
for (int64_t i = 0; i < n; i++) words[i] = uint32_t(bits[i]) << 16;
"""
# bf16 bits that came through numpy as uint16 -> a bfloat16 Var, same bytes
REINTERPRET_SOURCE = "std::memcpy(out0_p, in0_p, in0->size);"


def tensor_var(tensor: StoredTensor, fd: int, dtype: str) -> jt.Var:
    """One stored tensor as a Var of `dtype`, read when the Var is executed. bf16 widens to fp32
    inside the read, so the fp32 base needs no bf16 copy beside it."""
    where = tensor.file_range()
    if where is not None:
        offset, nbytes = where
        widen = tensor.dtype == "bfloat16" and dtype == "float32"
        return jt.code(tensor.shape, dtype if widen else tensor.dtype, [], cpu_header=READ_HEADER,
                       cpu_src=READ_SOURCE + (WIDEN_SOURCE if widen else ""),
                       data={"fd": fd, "offset": offset, "nbytes": nbytes, "skip": nbytes if widen else 0})
    array = jt.array(tensor.numpy())  # non-contiguous or big-endian: rare, through numpy
    if tensor.dtype != "bfloat16":
        return array
    return jt.code(tensor.shape, "bfloat16", [array], cpu_header="#include <cstring>\n", cpu_src=REINTERPRET_SOURCE)


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


def load_base(model: LLaMA_adapter, ckpt_dir: str):
    """Fill the frozen base from Meta's consolidated.NN.pth shards (names without 'llama.'), one tensor at a time."""
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "consolidated.*.pth")))
    if not paths:
        raise FileNotFoundError(f"{ckpt_dir}: no consolidated.NN.pth checkpoint file")
    shards = open_shards(paths)
    base = {name[len("llama."):]: var for name, var in model.base_parameters().items()}
    source = paths[0] if len(paths) == 1 else f"{ckpt_dir} ({len(paths)} shards)"
    plan = join_plan(shards, {k: v.shape for k, v in base.items()}, source)
    check_strict(base, {name: joined_shape(*entry) for name, entry in plan.items()}, source, "base")
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    try:
        # Every parameter first points at its read op, then one sync runs them all: any Jittor
        # sync also runs every pending Var, so syncing tensor by tensor would execute the random
        # initialisation of all parameters not yet replaced (a full fp32 model) at the first one.
        for name, var in base.items():
            parts, dim = plan[name]
            values = [tensor_var(part, fds[part.storage.reader.path], var.dtype) for part in parts]
            value = values[0] if dim is None else jt.concat(values, dim)
            var.assign(cast_to(value, var.dtype))
        try:
            jt.sync(list(base.values()))
        except RuntimeError as exc:
            raise CheckpointError(f"{source}: reading the tensors failed ({str(exc).splitlines()[0]})") from exc
    finally:
        for fd in fds.values():
            os.close(fd)
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
