"""The supervisor of one sandboxed process: the first code the sandbox's interpreter runs (Utils/sandbox/
starts `python -I -S -c "...launch.main()"`, with the stack limit of a fresh process).

It reads its request from stdin, forks the process that does the work (the program's, candidate.py, or
the tests', checker.py), which confines itself (confine.py) before any line of the program or the tests,
and waits for it, for the wall clock, or for the parent to close the control pipe (the parent ends the
run, or died). Then it kills every process the work started, by any route: under bubblewrap the
supervisor is the PID namespace's init, and kill(-1) reaches every process in it; on the floor it is a
child subreaper, so that every orphan is handed to it, and it kills its children until it has none,
and removes the working directory.
Last, one line on stdout, the report: {"status": the work's wait status, "cpu": its CPU seconds, "how":
"exited", "wall", "stopped" or "entries"}. The work cannot reach the supervisor: another uid (as root) or a
Landlock domain below it, no ptrace, and not dumpable, so not its /proc files either.
"""
import json
import os
import select
import signal
import stat
import sys
import time

from . import candidate, checker, confine

PR_SET_CHILD_SUBREAPER = 36
ENTRIES_EVERY = 0.05  # seconds between looks at the files and folders the work made (a process makes ~10,000)
CONFINE_FAILED = 121  # the work's exit status when it could not confine itself (it then runs nothing)


def children() -> list:
    """The supervisor's live children, from /proc (on the floor: the machine's)."""
    me = str(os.getpid())
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        pass
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    found.append(int(name))
        except (OSError, IndexError):
            pass
    return found


def end_descendants():
    """SIGKILL every process below the supervisor and reap it, until there is none."""
    while True:
        targets = [-1] if os.getpid() == 1 else children()  # -1 from a namespace's init: all of it
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.002)


def remove_workdir(path: str):
    """Remove a working directory and everything in it once its processes are gone: also folders the program
    made unreadable (chmod 0: its uid's files) and folders nested deeper than Python's recursion limit or
    PATH_MAX, so one folder open at a time, by descriptor, going down by name and up by '..'; each folder is
    listed once (a folder of many sub-folders costs its entries, not their square). Links are never followed."""
    fd = open_folder(os.path.dirname(os.path.abspath(path)) or "/", os.path.basename(os.path.abspath(path)))
    if fd is None:
        return
    below, left = [], [names_in(fd)]  # the names from `path` down to fd's folder; each level's names not yet removed
    try:
        while True:
            if left[-1]:
                name = left[-1].pop()
                child = None if remove_entry(fd, name) else open_folder(fd, name)
                if child is not None:
                    os.close(fd)
                    fd = child
                    below.append(name)
                    left.append(names_in(fd))
                continue
            if not below:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            left.pop()
            remove_entry(fd, below.pop())
    except OSError:  # the tree changed under the walk: what is left stays
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_entry(fd: int, name: str) -> bool:
    """Remove `name` in folder `fd` when it is a file, a link or an empty folder; False for a folder to go into."""
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=fd)
            return True
        os.rmdir(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def open_folder(parent, name: str):
    """A descriptor of folder `name` in `parent` (a descriptor or a path), never through a link; a folder the
    program made unreadable is made the owner's again first (by its descriptor: a link in its place is not
    followed). None when it cannot be opened."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    where = {"dir_fd": parent} if isinstance(parent, int) else {}
    path = name if where else os.path.join(parent, name)
    try:
        return os.open(path, flags, **where)
    except PermissionError:
        pass
    except OSError:
        return None
    try:
        handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, **where)
    except OSError:
        return None
    try:
        os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)  # the folder the handle holds, whatever the name is now
        return os.open(path, flags, **where)
    except OSError:
        return None
    finally:
        os.close(handle)


def names_in(fd: int) -> list:
    try:
        return os.listdir(fd)
    except OSError:
        return []


def entries_in(folders) -> int:
    """Files and folders (inodes) in use on the file systems of `folders` (each its own tmpfs)."""
    used = 0
    for folder in folders:
        try:
            fs = os.statvfs(folder)
            used += fs.f_files - fs.f_ffree
        except OSError:
            pass
    return used


def wait_for(work: int, control: int, deadline: float, counted=(), max_entries: int = 0):
    """("exited", wait status, rusage) when the work ends by itself, else ("wall", "stopped" or "entries", ...)
    once it is killed: "entries" when the file systems of `counted` (its tmpfs folders) hold more than
    `max_entries` files and folders, whose kernel memory no size limit counts (looked at every ENTRIES_EVERY s)."""
    poller = select.poll()
    poller.register(control, select.POLLIN)
    try:
        pidfd = os.pidfd_open(work)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look every 10 ms
        pidfd = None
    how = "exited"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            how = "wall"
            break
        wait = min(left, 0.01) if pidfd is None else min(left, ENTRIES_EVERY) if counted else left
        events = dict(poller.poll(1000 * wait))
        if control in events:
            how = "stopped"
            break
        if counted and entries_in(counted) > max_entries:
            how = "entries"
            break
        if pidfd in events or (pidfd is None and os.waitpid(work, os.WNOHANG)[0]):
            break
    if how != "exited":
        os.kill(work, signal.SIGKILL)
    _, status, rusage = os.wait4(work, 0)
    return how, status, rusage


def confine_work(request: dict, fds: dict, verdict):
    """In the forked work process, before any line of the program or the tests: its descriptors, limits,
    filters and uid."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    keep = sorted({0, 1, 2, fds["requests"], fds["replies"]} | ({verdict} if verdict is not None else set()))
    for low, high in zip(keep, keep[1:] + [65536]):
        os.closerange(low + 1, high)
    confine.set_limits(request["limits"])
    confine.no_new_privileges()
    if request["landlock"]:
        confine.landlock(tuple(request["writable"]), tuple(request["readable"]))
    confine.drop_uid(request["uid"])
    if request["seccomp"]:
        confine.seccomp()
    os.chdir(request["workdir"])


def work(request: dict, fds: dict, verdict):
    """The forked work process: confined, then the role's code; it never returns."""
    try:
        confine_work(request, fds, verdict)
    except BaseException as error:  # nothing of the program or the tests runs unconfined
        os.write(2, f"sandbox: {type(error).__name__}: {error}\n".encode(errors="replace"))
        os._exit(CONFINE_FAILED)
    try:
        if request["role"] == "candidate":
            candidate.serve(request["job"], fds["requests"], fds["replies"])
        else:
            checker.check(request["job"], fds["requests"], fds["replies"], verdict)
    except BaseException:  # a fault of ours, not the program's (the roles catch the program's own)
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def main():
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the scorer blocks its stop signals; masks are inherited
    started = time.monotonic()
    request = json.loads(sys.stdin.buffer.read())
    fds = request["fds"]
    confine.set_dumpable(False)
    confine.prctl(PR_SET_CHILD_SUBREAPER, 1)
    verdict = os.dup(1) if request["role"] == "checker" else None
    child = os.fork()
    if child == 0:
        work(request, fds, verdict)
    for fd in (fds["requests"], fds["replies"]) + ((verdict,) if verdict is not None else ()):
        os.close(fd)
    how, status, rusage = wait_for(child, fds["control"], started + request["wall_seconds"], request["counted"],
                                   request["max_entries"])
    end_descendants()
    if request["remove_workdir"]:  # here too, so that a scorer killed meanwhile leaves no folder behind
        remove_workdir(request["workdir"])
    report = {"status": status, "cpu": rusage.ru_utime + rusage.ru_stime, "how": how}
    os.write(1, (json.dumps(report) + "\n").encode())
