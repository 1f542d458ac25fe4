"""The messages between the tests' process (checker.py) and the program's (candidate.py): length-prefixed
JSON over two pipes, and values as data.

A value crosses as data when it is None, a bool, int, float, complex, str, bytes, bytearray or range, or a
list, tuple, set, frozenset or dict of such values (a subclass, such as Counter, namedtuple or an
IntEnum, crosses as its base type). An iterator that a call returns (a generator, map, filter, zip, any
object with __next__) is drained where it lives, at most ITER_ITEMS items, and crosses as an iterator over
a list of them: iterable once and equal only to itself, as the iterator was (HumanEval 33 and 37 test
`tuple(candidate(...))`). Anything else stays where it is and crosses as a handle, a number the other side
can name it by; the other side may ask to iterate it, which drains iter(it) the same way. `decode` builds
only those types, so whatever the program's process sends, the tests' process gets plain data and
handles: never an object whose methods the program wrote.
"""
import binascii
import collections.abc
import itertools
import json
import os
import struct

MESSAGE_CAP = 64 * 2 ** 20  # bytes in one message; a longer one is refused
DEPTH_CAP = 200  # nesting of one value
EXACT = 2 ** 53  # ints beyond this cross as hexadecimal text (JSON readers round them; Python limits their digits)
ITER_ITEMS = 10 ** 6  # items drained from one iterator; one that yields more (itertools.count()) is refused


class WireError(ValueError):
    """A message that is not what the protocol allows."""


def send(fd: int, message):
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MESSAGE_CAP:
        raise WireError(f"a message of {len(data)} bytes (at most {MESSAGE_CAP})")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd: int):
    """The next message; EOFError when the other side closed its end before a whole one."""
    size = struct.unpack(">I", read_exactly(fd, 4))[0]
    if size > MESSAGE_CAP:
        raise WireError(f"a message of {size} bytes announced (at most {MESSAGE_CAP})")
    try:
        return json.loads(read_exactly(fd, size))
    except (ValueError, RecursionError) as e:  # not JSON, too deep, an int with too many digits
        raise WireError(f"a message that is not JSON ({type(e).__name__})") from None


def read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 2 ** 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def is_dunder(name: str) -> bool:
    """A name the interpreter owns (__builtins__, __name__, ...): never crosses as one of the program's names."""
    return name.startswith("__") and name.endswith("__")


def drained(iterator) -> list:
    """The items of `iterator`, at most ITER_ITEMS; more is a WireError."""
    items = list(itertools.islice(iterator, ITER_ITEMS + 1))
    if len(items) > ITER_ITEMS:
        raise WireError(f"an iterator of more than {ITER_ITEMS} items")
    return items


def encode(value, handle_of, depth=0, drain=False):
    """JSON-ready `value`: data as data, with `drain` an iterator (within it too) as ["G", its items], anything
    else as ["H", handle_of(value)]."""
    if depth > DEPTH_CAP:
        raise WireError(f"a value nested more than {DEPTH_CAP} deep")
    if value is None or value is True or value is False:
        return value
    inner = lambda items: [encode(item, handle_of, depth + 1, drain) for item in items]  # noqa: E731
    if isinstance(value, int):
        number = int(value)
        return number if -EXACT < number < EXACT else ["I", format(number, "x")]
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return ["C", value.real, value.imag]
    if isinstance(value, (bytes, bytearray)):
        return ["Y" if isinstance(value, bytearray) else "B", binascii.b2a_base64(value, newline=False).decode()]
    for kind, tag in ((list, "L"), (tuple, "T"), (set, "S"), (frozenset, "F")):
        if isinstance(value, kind):
            return [tag, *inner(kind.__iter__(value))]
    if isinstance(value, dict):
        return ["D", *[inner(pair) for pair in dict.items(value)]]
    if isinstance(value, range):
        return ["R", *inner((value.start, value.stop, value.step))]
    if drain and isinstance(value, collections.abc.Iterator):
        return ["G", *inner(drained(value))]
    return ["H", handle_of(value)]


def decode(data, handle, depth=0):
    """The value `data` encodes, built from the types above only; handle(number) makes a handle's object.
    Anything else is a WireError."""
    if depth > DEPTH_CAP:
        raise WireError(f"a value nested more than {DEPTH_CAP} deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise WireError(f"not a value: {str(data)[:80]}")
    tag, rest = data[0], data[1:]
    inner = lambda items: [decode(item, handle, depth + 1) for item in items]  # noqa: E731
    try:
        if tag in ("L", "T", "S", "F"):
            return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](inner(rest))
        if tag == "G":
            return iter(inner(rest))  # a list's iterator: this interpreter's own type
        if tag == "R" and len(rest) == 3:
            bounds = inner(rest)
            if all(type(bound) is int for bound in bounds):
                return range(*bounds)
        if tag == "D" and all(type(pair) is list and len(pair) == 2 for pair in rest):
            return dict(inner(pair) for pair in rest)
        if tag == "I" and len(rest) == 1 and type(rest[0]) is str:
            return int(rest[0], 16)
        if tag == "C" and len(rest) == 2 and all(type(part) in (int, float) for part in rest):
            return complex(*rest)
        if tag in ("B", "Y") and len(rest) == 1 and type(rest[0]) is str:
            raw = binascii.a2b_base64(rest[0])
            return bytearray(raw) if tag == "Y" else raw
        if tag == "H" and len(rest) == 1 and type(rest[0]) is int:
            return handle(rest[0])
    except (TypeError, ValueError, binascii.Error) as e:  # an unhashable key or member, a malformed number
        raise WireError(f"a malformed {tag!r} value ({e})") from None
    raise WireError(f"not a value: {str(data)[:80]}")
