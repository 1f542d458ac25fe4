"""What a sandboxed process does to itself before any untrusted line runs: resource limits, an
unprivileged uid (as root), no new privileges, a seccomp filter and a Landlock ruleset. Each is
enforced by the kernel and inherited by every process it forks, so nothing the program does later
(ctypes, a signal handler, a forked child) undoes it.

- seccomp (x86_64 and aarch64): no execve (so no /bin/sh, no setuid program), no socket (no
  network: socketpair, a local pair, stays), no ptrace or process_vm_*, no io_uring (it would do
  the refused calls without a system call), no chmod, chown, utime or xattr by path (Landlock leaves
  them to the uid: as a user, the user's own files), no namespaces (unshare, setns, clone with CLONE_NEW*),
  no CLONE_PARENT (a child must stay below its supervisor), no kill with a negative pid (a group
  or, for -1, every process of the uid), no SysV shared memory, message queues or semaphores, no POSIX
  message queues and no memfd (memory the address-space limit does not count, objects that outlive the
  program); clone3 answers ENOSYS so that glibc falls back to clone, whose flags the filter can read.
- Landlock: reads only below the folders it is given (the system's and the interpreter's), writes
  only in the working directory (and /dev/null; under bubblewrap its own /dev/shm), executes
  nothing; /proc, /sys, /etc, /tmp and the project are unreachable by any path, dir_fd included.
  From ABI 6 on, also no signal to a process outside the sandbox; and in every ABI no ptrace of one.
"""
import ctypes
import os
import platform
import resource
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_DUMPABLE = 38, 22, 4
SECCOMP_MODE_FILTER = 2

ARCHES = ("x86_64", "aarch64")  # the architectures the filter is written for: system call numbers in this order
AUDIT_ARCH = (0xC000003E, 0xC00000B7)
X32_BIT = (0x40000000, 0)  # x86_64's x32 calls: refused as a whole
REFUSED = {  # answered EPERM
    "execve": (59, 221), "execveat": (322, 281), "socket": (41, 198), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "pivot_root": (155, 41), "chroot": (161, 51), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "open_by_handle_at": (304, 265), "fsopen": (430, 430), "fsmount": (432, 432),
    "open_tree": (428, 428), "move_mount": (429, 429), "pidfd_getfd": (438, 438),
    # memory outside the address-space limit (RLIMIT_AS counts none of it), and kernel objects that outlive
    # the program on the floor (SysV IPC and POSIX message queues have no working directory to be removed with)
    "shmget": (29, 194), "msgget": (68, 186), "semget": (64, 190), "mq_open": (240, 180),
    "memfd_create": (319, 279),
    # a file's owner, mode, times and attributes by path: Landlock does not cover them (None: no such call)
    "chmod": (90, None), "fchmodat": (268, 53), "fchmodat2": (452, 452), "chown": (92, None),
    "lchown": (94, None), "fchownat": (260, 54), "utime": (132, None), "utimes": (235, None),
    "futimesat": (261, None), "utimensat": (280, 88), "setxattr": (188, 5), "lsetxattr": (189, 6),
    "removexattr": (197, 14), "lremovexattr": (198, 15)}
CLONE, CLONE3, KILL = (56, 220), (435, 435), (62, 129)  # clone's flags and kill's pid are read; clone3: ENOSYS
CLONE_REFUSED = 0x00008000 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
EPERM, ENOSYS = 1, 38

# Landlock (linux/landlock.h): filesystem rights by ABI version, and the calls' numbers (one table
# for every architecture)
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
SCOPE_SIGNAL = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


class ConfineError(OSError):
    """A kernel feature refused (the floor needs seccomp and Landlock)."""


def _check(result, what):
    if result < 0:
        errno = ctypes.get_errno()
        raise ConfineError(errno, f"{what}: {os.strerror(errno)}")
    return result


def set_limits(limits: dict):
    """CPU seconds, address space, processes, one file's size, open files, no core."""
    cpu, memory = limits["cpu_seconds"], limits["memory_mb"] * 2 ** 20
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                         (resource.RLIMIT_NPROC, (limits["processes"],) * 2),
                         (resource.RLIMIT_FSIZE, (limits["file_mb"] * 2 ** 20,) * 2),
                         (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)


def drop_uid(uid):
    """As root: become `uid` (no groups); every capability goes with root."""
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def prctl(option: int, value: int):
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option}, {value})")


def set_dumpable(on: bool):
    """Off: no process of the same uid may ptrace this one or open its /proc files (its descriptors)."""
    prctl(PR_SET_DUMPABLE, int(on))


def no_new_privileges():
    """Neither this process nor its children gain privileges by exec (setuid files); Landlock and seccomp
    filters need it."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def landlock_abi() -> int:
    """Landlock's ABI version here, 0 when the kernel has none."""
    version = _libc.syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(0, version)


def seccomp_supported() -> bool:
    return platform.machine() in ARCHES


def landlock(writable: tuple, readable: tuple):
    """Restrict this process and its children: read below `readable`, everything but execute below
    `writable` (the working directory; under bubblewrap also its private /dev/shm)."""
    abi = landlock_abi()
    if abi < 1:
        raise ConfineError(0, "Landlock is not available in this kernel")
    handled = FS_RIGHTS_BY_ABI[max(v for v in FS_RIGHTS_BY_ABI if v <= abi)]
    scoped = SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", handled, 0, scoped)[:24 if abi >= 6 else 8]
    ruleset = _check(_libc.syscall(LANDLOCK_CREATE_RULESET, attr, len(attr), 0), "landlock_create_ruleset")
    try:
        reading = FS_READ_FILE | FS_READ_DIR
        rules = [(p, reading) for p in readable] + [(p, handled & ~FS_EXECUTE) for p in writable]
        for path, rights in rules + [("/dev/null", FS_READ_FILE | FS_WRITE_FILE)]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= FS_READ_FILE | FS_WRITE_FILE | (1 << 14)  # a file takes file rights only
                rule = struct.pack("=Qi", rights, fd)
                _check(_libc.syscall(LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _check(_libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def seccomp_program() -> bytes:
    """The BPF filter (struct sock_filter[]) for this machine's architecture."""
    which = ARCHES.index(platform.machine())
    arch, x32, clone, clone3, kill = (table[which] for table in (AUDIT_ARCH, X32_BIT, CLONE, CLONE3, KILL))
    LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, nosys, dead = 0x7FFF0000, 0x00050000 | EPERM, 0x00050000 | ENOSYS, 0x80000000
    code = []  # (op, jump if true: label or 0, jump if false: label or 0, k)
    code += [(LD_ABS, 0, 0, 4), (JEQ, 0, "dead", arch), (LD_ABS, 0, 0, 0)]  # another ABI (i386 on x86_64): killed
    if x32:
        code.append((JGE, "deny", 0, x32))
    code += [(JEQ, "deny", 0, numbers[which]) for numbers in REFUSED.values() if numbers[which] is not None]
    code += [(JEQ, "nosys", 0, clone3), (JEQ, "clone", 0, clone), (JEQ, "kill", 0, kill), (RET, 0, 0, allow),
             ("clone",), (LD_ABS, 0, 0, 16), (JSET, "deny", 0, CLONE_REFUSED), (RET, 0, 0, allow),
             ("kill",), (LD_ABS, 0, 0, 16), (JSET, "deny", 0, 0x80000000), (RET, 0, 0, allow),
             ("deny",), (RET, 0, 0, deny), ("nosys",), (RET, 0, 0, nosys), ("dead",), (RET, 0, 0, dead)]
    labels, at = {}, 0
    for item in code:
        if len(item) == 1:
            labels[item[0]] = at
        else:
            at += 1
    out, at = [], 0
    for item in code:
        if len(item) == 1:
            continue
        op, yes, no, k = item
        jump = [labels[j] - at - 1 if j else 0 for j in (yes, no)]
        out.append(struct.pack("HBBI", op, jump[0], jump[1], k))
        at += 1
    return b"".join(out)


def seccomp():
    """Install the filter (after no_new_privileges)."""
    program = seccomp_program()
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxP", len(program) // 8, ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")
