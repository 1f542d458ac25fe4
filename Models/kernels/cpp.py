"""The kernels' C++ (Models/kernels/cpp/) and CUDA (Models/kernels/cuda/) as the text jt.code compiles, and
the names of an op's operands.

cpp/*.h are headers several ops share, each guarded and including what it uses; cpp/*.cc are op
bodies: the statements jt.code runs, where in<i>_p and out<i>_p are the op's inputs and outputs,
and the names one call gives values to are declared in Python ahead of them. cuda/*.cuh and
cuda/*.cu are the same for a GPU: the .cu bodies are host code that launches the .cuh's kernels. `source(name)` is a
file with every `#include "x"` replaced by x's text, each file once: jt.code receives the whole
source, and Jittor keys its compile cache on that text, so editing a header recompiles exactly the
ops that include it. For the same reason a call's sizes and scalars are not written into the source
but passed as jt.code's `data`, read when the op runs (`Numbers`): one compiled op then serves every
shape, where sizes in the text would compile it anew for each. What changes the code itself (types,
which pointers exist) stays in the text. An op run at every step of every layer (the decode layer's) takes
its texts as `included` lines instead: Jittor builds an op's key from its whole text at every run.
"""
import hashlib
import os
import re
from pathlib import Path

CPP = Path(__file__).with_name("cpp")
CUDA = Path(__file__).with_name("cuda")
INCLUDE = re.compile(r'^[ \t]*#include "([^"]+)"[ \t]*\n', re.M)


def source(name: str) -> str:
    """cpp/<name> or cuda/<name> with its includes resolved (each found in cuda/, else cpp/), for jt.code's
    headers (a .h, .cuh) and sources (a .cc, .cu)."""
    return resolve(name, set())


def resolve(name: str, seen: set) -> str:
    if name in seen:
        return ""
    seen.add(name)
    text = (CUDA / name if (CUDA / name).exists() else CPP / name).read_text()
    return INCLUDE.sub(lambda match: resolve(match.group(1), seen), text)


def included(text: str) -> str:
    """`# include "<file>"` of a file holding `text` in Jittor's cache folder (moa_sources/, named by the text's
    hash), for jt.code's header or source. Jittor makes an op's key from its whole header and source every time
    the op runs (CodeOp::jit_prepare, the source a character at a time): about 30 us a run for the decode layer's
    55 KB, 2 ops a layer at every step. The line keeps the key short, and it still names the text: another text
    is another file, another key and another compiled op. The space after '#': Jittor puts its definitions of
    the op's names (in0_type, ...) after the last "#include" of the op's text, which must not be the source's,
    inside the op's function, after the code that uses them."""
    import jittor as jt  # the cache folder is Jittor's; the texts above need no Jittor
    path = Path(jt.flags.cache_path) / "moa_sources" / f"{hashlib.sha1(text.encode()).hexdigest()[:24]}.h"
    if not path.exists():  # several processes may write it at once: each writes a whole file and renames it
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)
    return f'# include "{path}"\n'


INCLUDED = re.compile(r'^# include "([^"]*/moa_sources/[0-9a-f]+\.h)"\n', re.M)


def expanded(text: str) -> str:
    """`text` with `included` lines replaced by the texts they include."""
    return INCLUDED.sub(lambda match: Path(match.group(1)).read_text(), text)


def constant(header: str, name: str) -> int:
    """The integer `static const int64_t <name> = <n>;` that cpp/<header> declares."""
    found = re.search(rf"static const int64_t {name} = (\d+);", (CPP / header).read_text())
    return int(found.group(1))


class Numbers:
    """A jt.code call's sizes and scalars (`data`, the call's data=) and the C++ declaring them (`code`):
    names the source reads from values given when the op runs."""

    def __init__(self):
        self.data, self.code = {}, ""

    def declare(self, ctype: str = "int64_t", **values) -> "Numbers":
        """Adds `const <ctype> name = data["name"], ...;` to `code` for each of `values` (ints, floats or bools)."""
        self.code += self.declaration(ctype, **values)
        return self

    def declaration(self, ctype: str = "int64_t", **values) -> str:
        names = (f"{name} = {self.value(name, value, ctype)}" for name, value in values.items())
        return f"const {ctype} " + ", ".join(names) + ";\n"

    def value(self, name: str, value, ctype: str = "int64_t") -> str:
        """The C++ expression reading `value`, recorded as `name`."""
        self.data[name] = float(value)
        return f'({ctype})data["{name}"]'


class CodeInputs:
    """A jt.code op's inputs in order (`vars`), as its C++ names them: `pointer(var)` is var's in<i>_p,
    `add(name, var)` declares `name` as it in `code`. A None var is a nullptr and takes no input. `declare`
    adds names read from the op's `numbers`, its data. `storages`: those of the base matrices among the inputs
    (cpp/storage.h's names), which `header` tells the op's C++."""

    def __init__(self):
        self.vars, self.code, self.numbers = [], "", Numbers()
        self.storages = set()

    def header(self, text: str) -> str:
        """The op's header `text` after MOA_STORAGES, the storages of its base matrices: cpp/base_matrix.h
        compiles their products only (bf16's and int8's kernels are most of an op's compile time)."""
        storages = " | ".join(f"1 << {name}" for name in sorted(self.storages)) or "0"
        return f"#define MOA_STORAGES ({storages})\n" + text

    def declare(self, ctype: str = "int64_t", **values):
        self.code += self.numbers.declaration(ctype, **values)

    def pointer(self, var) -> str:
        if var is None:
            return "nullptr"
        self.vars.append(var)
        return f"in{len(self.vars) - 1}_p"

    def add(self, name: str, var, ctype: str = "const float *"):
        pointer = self.pointer(var)
        self.code += f"{ctype}{name} = {pointer if var is None else f'(const {ctype.split()[1]} *){pointer}'};\n"


class CodeOutputs:
    """A jt.code op's outputs in order (`shapes`): `pointer(shape)` is the next one's out<i>_p."""

    def __init__(self):
        self.shapes = []

    def pointer(self, shape) -> str:
        self.shapes.append(tuple(shape))
        return f"out{len(self.shapes) - 1}_p"
