"""The first code a sandboxed program's interpreter runs (Utils/sandbox.py passes this file's text to
`python -I -S -c`); never imported by the project.

It reads its job from stdin (an unlinked temporary file): the per-run secret, the program, its tests,
the entry point, the builtins the program may redefine for its tests, the resource limits and the
uid to run as. Then, before any line of the program: the original stdout becomes the verdict pipe,
stdin and stdout are pointed at /dev/null (stdout is discarded, as human-eval discards it), the
limits are set, the uid is dropped (root only) and an audit hook is installed that nothing can
remove. The program runs as module `__main__`; the tests run after it in a namespace of the
program's names minus any that shadow a builtin (unless the job lists it: MBPP 126's solution is a
function named sum), with the builtins as they were before the program ran, and
`check(<entry point>)` is called when there is one. Only when check has returned does the harness
write the verdict line `<secret> passed` to the verdict pipe; an exception from the program, its
tests or check gives `<secret> failed <ExceptionType: message>`. Anything else (an exit, a signal,
a limit) leaves no verdict line and the parent scores it from the exit status. What the guard
refuses, and why, is in docs/code.md.
"""
import builtins
import json
import os
import resource
import signal
import sys
from stat import S_ISLNK


def guard(workdir: str):
    """The audit hook: refuses what the program has no business doing (see docs/code.md). It calls only
    what it captured here (builtin functions, unbound str methods, exception classes): the program may
    rebind builtins or patch os.path, but cannot change these."""
    lstat, readlink, getcwd, getpid, is_link = os.lstat, os.readlink, os.getcwd, os.getpid, S_ISLNK
    kind_of, text, raw, number, starts, split, strip = type, str, bytes, int, str.startswith, str.split, str.strip
    Denied, NoFrame, NoAttribute, NoModule, Missing = PermissionError, ValueError, AttributeError, ImportError, OSError
    denied = frozenset((
        "sys.settrace", "sys.setprofile", "sys._settraceallthreads", "sys._setprofileallthreads",
        "sys.monitoring.register_callback", "sys.addaudithook", "sys._current_frames", "sys._current_exceptions",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
        "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.killpg", "os.startfile",
        "socket.__new__", "socket.socketpair", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof",
        "ctypes.string_at", "ctypes.wstring_at", "ctypes.call_function", "ctypes.PyObj_FromPtr"))
    frame_attributes = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame"))  # f_back needs a frame first
    denied_modules = frozenset(("ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_testmultiphase",
                                "_xxsubinterpreters", "_xxinterpchannels", "_posixshmem"))
    path_events = frozenset(("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                             "os.chown", "os.utime", "os.truncate", "os.setxattr", "os.removexattr", "shutil.rmtree",
                             "shutil.move", "shutil.copyfile", "os.mkfifo", "os.mknod"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def resolve(path) -> str:
        """The absolute path, every symbolic link followed (os.path.realpath is Python the program could
        patch); only a str or bytes path: another object's __fspath__ may answer differently each time."""
        if kind_of(path) is raw:
            path = raw.decode(path, "utf-8", "replace")
        elif kind_of(path) is not text:
            raise Denied("sandbox: give a path as str or bytes")
        todo = [p for p in split(path if starts(path, "/") else getcwd() + "/" + path, "/") if p and p != "."]
        done, hops = [], 0
        while todo:
            part = todo.pop(0)
            if part == "..":
                if done:
                    done.pop()
                continue
            here = "/" + "/".join(done + [part])
            try:
                is_symlink = is_link(lstat(here).st_mode)
            except Missing:  # not there (yet): taken as written
                is_symlink = False
            if not is_symlink:
                done.append(part)
                continue
            hops += 1
            if hops > 40:
                raise Denied("sandbox: too many symbolic links")
            target = readlink(here)
            done = [] if starts(target, "/") else done
            todo = [p for p in split(target, "/") if p and p != "."] + todo
        return "/" + "/".join(done)

    home = resolve(workdir)

    def inside(path) -> bool:
        real = resolve(path)
        return real == home or starts(real, home + "/") or real == "/dev/null"

    def hook(event, args):
        if event in denied:
            raise Denied(f"sandbox: {event} is not allowed")
        if event == "sys._getframe" or event == "sys._getframemodulename":
            raise NoFrame("sandbox: frame access is not allowed")  # namedtuple, typing, enum fall back on it
        if event == "object.__getattr__" and args[1] in frame_attributes:
            raise NoAttribute(f"sandbox: .{args[1]} is not allowed")
        if event == "object.__setattr__" and args[1] == "__code__":
            raise Denied("sandbox: replacing a function's code is not allowed")
        if event == "import" and split(args[0], ".")[0] in denied_modules:
            raise NoModule(f"sandbox: module {args[0]} is not allowed")
        if event == "os.kill" and args[0] != getpid():
            raise Denied("sandbox: signalling another process is not allowed")
        if event == "open" and args[0] is not None and kind_of(args[0]) is not number:
            real = resolve(args[0])
            if real == "/proc" or starts(real, "/proc/"):
                raise Denied(f"sandbox: {args[0]} is not readable")
            writes = (kind_of(args[2]) is number and args[2] & write_flags) or \
                (kind_of(args[1]) is text and strip(args[1], "rbt") != "")
            if writes and not inside(args[0]):
                raise Denied(f"sandbox: {args[0]} is outside the working directory")
        if event in path_events:
            for path in args[:2]:
                if kind_of(path) is not number and path is not None and not inside(path):
                    raise Denied(f"sandbox: {path} is outside the working directory")
    return hook


def last_line(error: BaseException) -> str:
    """What a traceback's last line says, one line of at most 300 characters, a plain str."""
    try:
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        text = "".join([text])  # a plain str, whatever __str__ returned
    except BaseException:
        text = "an exception that cannot be printed"
    return text.replace("\r", " ").replace("\n", " ")[:300]


def main():
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the scorer blocks SIGINT/SIGTERM; masks are inherited
    job = json.loads(sys.stdin.buffer.read())
    verdict_fd = os.dup(1)  # the verdict pipe; the program's stdout goes to /dev/null
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    secret, limits = job["secret"], job["limits"]
    write, exit_now, getpid, me = os.write, os._exit, os.getpid, os.getpid()
    gettrace, getprofile = sys.gettrace, sys.getprofile
    cpu = limits["cpu_seconds"]
    memory = limits["memory_mb"] * 2 ** 20
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                         (resource.RLIMIT_NPROC, (limits["processes"],) * 2),
                         (resource.RLIMIT_FSIZE, (limits["file_mb"] * 2 ** 20,) * 2),
                         (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)
    if job["uid"] is not None:  # root: become an unprivileged uid of our own (the limits count per uid)
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    os.chdir(job["workdir"])
    program, tests, entry_point, shadows = job["program"], job["tests"], job["entry_point"], set(job["shadows"])
    del job
    pristine = dict(builtins.__dict__)
    module = type(sys)("__main__")
    sys.modules["__main__"] = module  # the harness is no longer reachable by `import __main__`
    sys.addaudithook(guard(os.getcwd()))
    try:
        exec(compile(program, "<program>", "exec"), module.__dict__)
        builtins.__dict__.clear()
        builtins.__dict__.update(pristine)
        names = {k: v for k, v in module.__dict__.items() if k not in pristine or k in shadows}
        checks = dict(names, __name__="__main__", __builtins__=dict(pristine))
        exec(compile(tests, "<tests>", "exec"), checks)
        if entry_point is not None:
            if entry_point not in names:
                raise NameError(f"the program defines no {entry_point}")
            checks["check"](names[entry_point])
        if gettrace() is not None or getprofile() is not None:
            raise RuntimeError("a trace or profile function was installed")
        verdict = "passed"
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: the tests did not finish
        verdict = "failed\t" + last_line(error)
    if getpid() == me:  # a process the program forked returns here too; only the harness's own may speak
        write(verdict_fd, "".join([secret, "\t", verdict, "\n"]).encode())
    exit_now(0)


main()
