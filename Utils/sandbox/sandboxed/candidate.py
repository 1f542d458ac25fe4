"""The program's process: runs the program, then answers the tests' process (checker.py) until it closes
the requests pipe.

Nothing here is trusted: the program runs in this interpreter and may change anything in it, this code
included. It decides only what values its functions return, which is what a program does anyway.

Messages (wire.py), each answered in order:
- first, unasked: ["ready", {name: value}] with the program's top-level names (functions, classes and
  other objects as handles), or ["raised", type name, message] when the program itself raised;
- asked: ["call", handle, [args], {kwargs}], ["getattr", handle, name], ["setattr", handle, name, value],
  ["iter", handle]; answered ["value", value] or ["raised", type name, message]. An iterator a call returns,
  and iter(object) for "iter", cross drained (wire.py); a top-level name or an attribute that is an iterator
  stays a handle (draining it would consume what the program's own functions read).
"""
import json
import os
import sys

from . import wire

NAME_ITEMS, NAME_BYTES = 10 ** 5, 2 ** 20


def describe(error: BaseException) -> tuple:
    """(type name, message) of an exception, plain strings whatever its __str__ does."""
    try:
        return type(error).__name__, str(error)
    except BaseException:  # noqa: B036 (a __str__ that raises)
        return type(error).__name__, "(an exception that cannot be printed)"


class Objects:
    """The objects the tests' process holds handles to, kept alive for as long as this process runs."""

    def __init__(self):
        self.by_handle, self.handle_by_id = {}, {}

    def handle_of(self, value) -> int:
        key = id(value)
        if key not in self.handle_by_id:
            self.handle_by_id[key] = len(self.by_handle) + 1
            self.by_handle[len(self.by_handle) + 1] = value
        return self.handle_by_id[key]

    def get(self, handle):
        if handle not in self.by_handle:
            raise wire.WireError(f"no object {handle}")
        return self.by_handle[handle]


def top_level_names(module, objects) -> dict:
    """The module's names, data by value and everything else as handles; a large table of the program's
    (over NAME_ITEMS items or NAME_BYTES bytes) stays a handle too: the tests read it through calls, and
    it need not fit in a message."""
    names = {}
    for name, value in list(vars(module).items()):
        if not wire.is_dunder(name):
            try:
                if isinstance(value, (list, tuple, set, frozenset, dict)) and len(value) > NAME_ITEMS:
                    raise wire.WireError(f"{name} holds more than {NAME_ITEMS} items")
                names[name] = wire.encode(value, objects.handle_of)
                if len(json.dumps(names[name])) > NAME_BYTES:
                    raise wire.WireError(f"{name} is larger than {NAME_BYTES} bytes")
            except (wire.WireError, RecursionError):
                names[name] = ["H", objects.handle_of(value)]
    return names


def answer(request, objects):
    """The reply to one request."""
    if type(request) is not list or len(request) < 2 or request[0] not in ("call", "getattr", "setattr", "iter"):
        raise wire.WireError(f"not a request: {str(request)[:80]}")
    target = objects.get(request[1])
    if request[0] == "call":
        args = [wire.decode(arg, objects.get) for arg in request[2]]
        kwargs = {str(name): wire.decode(value, objects.get) for name, value in request[3].items()}
        result = target(*args, **kwargs)
    elif request[0] == "getattr":
        return ["value", wire.encode(getattr(target, request[2]), objects.handle_of)]
    elif request[0] == "iter":
        result = iter(target)
    else:
        result = setattr(target, request[2], wire.decode(request[3], objects.get))
    return ["value", wire.encode(result, objects.handle_of, drain=True)]


def serve(job: dict, requests: int, replies: int):
    """Run the program as module __main__, then answer requests until the requests pipe closes."""
    me, objects = os.getpid(), Objects()
    module = type(sys)("__main__")
    sys.modules["__main__"] = module
    try:
        exec(compile(job["program"], "<program>", "exec"), vars(module))
        first = ["ready", top_level_names(module, objects)]
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: the tests cannot run
        first = ["raised", *describe(error)]
    if os.getpid() != me:  # a process the program forked, ending its part of the program
        os._exit(0)
    wire.send(replies, first)
    while first[0] == "ready":
        try:
            request = wire.receive(requests)
        except EOFError:
            break
        try:
            reply = answer(request, objects)
        except BaseException as error:
            reply = ["raised", *describe(error)]
        if os.getpid() != me:  # a fork inside a call: only the process that was asked answers
            os._exit(0)
        wire.send(replies, reply)
