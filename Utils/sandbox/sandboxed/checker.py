"""The tests' process: runs a problem's tests against the program, which runs in another process
(candidate.py), and writes the verdict. Only data crosses between them (wire.py): the tests compare
values this interpreter built, with its own builtins and modules, so nothing the program does to its
own interpreter reaches the verdict.

The tests' namespace: the program's top-level names (its functions and other objects as handles: a call
runs in the program's process, and its result comes back as data; names that shadow a builtin only
when the problem's own solution defines them; no dunder name, such as __builtins__), then the problem's
given code (HumanEval's prompt: its helpers, such as poly or encode_cyclic, run here as the data set
wrote them), the entry point bound to
the program's, then the tests, then check(entry point). A handle is equal only to itself and is always
true; its attributes, calls and items (iterating it) are the program's.

Verdict, one line on the verdict descriptor: "passed" when check returned (or the tests ran to their
end), "failed\t<last line of the error>" when they raised, "gone\t<why>" when the program's process
closed its end first (the parent then says how it ended).
"""
import builtins
import os

from . import wire


LIST_ITERATOR = type(iter([]))


class ProgramError(Exception):
    """An exception of the program's whose type is not a builtin one; str() is "Type: message"."""


class ProgramGone(Exception):
    """The program's process closed its end of the pipes."""


class Link:
    """The pipes to the program's process; every request waits for its answer. The first fault (the
    process gone, a message outside the protocol) is kept: every later request raises it again, and the
    verdict is taken from it even when the tests caught it."""

    def __init__(self, requests: int, replies: int):
        self.requests, self.replies = requests, replies
        self.remotes, self.fault = {}, None

    def remote(self, handle: int) -> "Remote":
        if handle not in self.remotes:
            self.remotes[handle] = Remote(self, handle)
        return self.remotes[handle]

    def encode(self, value):
        def handle_of(other):
            if type(other) is not Remote:
                raise TypeError(f"the tests pass a {type(other).__name__} to the program, which only data "
                                "and its own objects can reach")
            return other._handle
        return wire.encode(value, handle_of, drain=True)

    def read(self, kind: str = "value"):
        """The next reply, a "value" (decoded) or the first message, "ready" (the program's names, as sent), or
        the program's exception raised here."""
        if self.fault is not None:
            raise self.fault
        try:
            reply = wire.receive(self.replies)
            if type(reply) is list and len(reply) == 2 and reply[0] == kind:
                return wire.decode(reply[1], self.remote) if kind == "value" else reply[1]
            if not (type(reply) is list and len(reply) == 3 and reply[0] == "raised" and
                    all(type(part) is str for part in reply[1:])):
                raise wire.WireError(f"not a reply: {str(reply)[:80]}")
        except EOFError:
            self.fault = ProgramGone("the program's process ended")
        except wire.WireError as e:
            self.fault = wire.WireError(f"the program's process broke the protocol: {e}")
        if self.fault is not None:
            raise self.fault
        raise program_error(reply[1], reply[2])

    def ask(self, *request):
        if self.fault is None:
            try:
                wire.send(self.requests, list(request))
            except BrokenPipeError:
                self.fault = ProgramGone("the program's process ended")
        return self.read()


def program_error(name: str, message: str) -> BaseException:
    """The program's exception as one of this interpreter's: the builtin type of that name, else ProgramError."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, BaseException) and kind.__module__ == "builtins":
        try:
            return kind(message) if message else kind()
        except Exception:  # a builtin exception whose constructor wants other arguments
            pass
    return ProgramError(f"{name}: {message}" if message else name)


class Remote:
    """An object of the program's: calls and attributes are asked of the program's process."""
    __slots__ = ("_link", "_handle")

    def __init__(self, link: Link, handle: int):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_handle", handle)

    def __call__(self, *args, **kwargs):
        return self._link.ask("call", self._handle, [self._link.encode(a) for a in args],
                              {name: self._link.encode(value) for name, value in kwargs.items()})

    def __getattr__(self, name):
        return self._link.ask("getattr", self._handle, name)

    def __setattr__(self, name, value):
        self._link.ask("setattr", self._handle, name, self._link.encode(value))

    def __iter__(self):
        """The items of iter(the object), drained in the program's process (wire.py): an iterator of data."""
        items = self._link.ask("iter", self._handle)
        if type(items) is not LIST_ITERATOR:  # the program's process answers what it likes
            raise TypeError("the program's object gave no items to iterate")
        return items

    def __repr__(self):
        return f"<the program's object {self._handle}>"


def last_line(error: BaseException) -> str:
    """What a traceback's last line says, one line of at most 300 characters."""
    if isinstance(error, ProgramError):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return " ".join(text.splitlines())[:300]  # every line break Python knows: the verdict is one line


def run_tests(job: dict, link: Link):
    """Bind the program's names, run the given code and the tests, call check; raises what they raise."""
    names = link.read("ready")
    if type(names) is not dict:
        raise wire.WireError("the program's names are not a mapping")
    shadows = set(job["shadows"])
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for name, value in names.items():
        # a dunder (__builtins__ above all: the tests' builtins would be the program's) is the interpreter's
        if name.isidentifier() and not wire.is_dunder(name) and (not hasattr(builtins, name) or name in shadows):
            namespace[name] = wire.decode(value, link.remote)
    entry_point = job["entry_point"]
    if entry_point is not None and entry_point not in names:
        raise NameError(f"the program defines no {entry_point}")
    exec(compile(job["given"], "<given>", "exec"), namespace)
    if entry_point is not None:
        namespace[entry_point] = wire.decode(names[entry_point], link.remote)
    exec(compile(job["tests"], "<tests>", "exec"), namespace)
    if entry_point is not None:
        namespace["check"](namespace[entry_point])


def check(job: dict, requests: int, replies: int, verdict: int):
    """Run the tests and write the verdict line to `verdict`."""
    link = Link(requests, replies)
    try:
        run_tests(job, link)
        line = "passed"
    except BaseException as error:  # SystemExit and KeyboardInterrupt from the program's calls included
        line = f"failed\t{last_line(error)}"
    if isinstance(link.fault, ProgramGone):
        line = f"gone\t{link.fault}"
    elif link.fault is not None:
        line = f"failed\t{last_line(link.fault)}"
    os.write(verdict, (line + "\n").encode(errors="replace"))
