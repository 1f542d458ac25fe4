"""The one place that prepares Jittor's environment; import it before `jittor`.

Jittor reads its configuration from environment variables at import time, and
three defaults break on an offline CPU machine:
- a stray `nvcc` without a CUDA runtime makes `import jittor` fail, so on a
  machine without an NVIDIA GPU we set `nvcc_path=` (a GPU machine is untouched);
- Jittor downloads oneDNN on import; we expose Debian's `libdnnl` (package
  libdnnl-dev) in the cache folder Jittor looks in, since its env vars
  `mkl_include_path`/`mkl_lib_path` are broken in 1.3.11;
- without oneDNN we fall back to `use_mkl=0` (slower, but never a download);
- on a GPU machine Jittor's CUDA import downloads CUTLASS, cuTT and (where mpicc exists)
  NCCL and wants cuDNN 8: CUTLASS, cuTT and cuDNN are switched off unless set; under mpirun
  NCCL comes from an installed nvidia-nccl wheel where there is one (torch's), else is switched
  off unless downloadable.
Jittor 1.3.11 needs small patches (setup.sh applies them): its op compiler (threads and Python,
compile time, a lock a kernel) and compile progress (scripts/jittor_patches.sh), and CUDA 13 (scripts/jittor_cuda13.sh).
"""
import glob
import hashlib
import os
import platform
import signal
import socket
import sys
import warnings

ONEDNN_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jittor", "mkl", "dnnl_lnx_2.2.0_cpu_gomp")
SYSTEM_DNNL_LIBS = ("/usr/lib/x86_64-linux-gnu/libdnnl.so", "/usr/lib/aarch64-linux-gnu/libdnnl.so", "/usr/lib/libdnnl.so")


def gpu_present():
    """True when an NVIDIA driver exposes a device node."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def ensure_onednn():
    """Make Jittor's expected oneDNN folder point at the system libdnnl; True when usable."""
    lib_dir, inc_dir = os.path.join(ONEDNN_DIR, "lib"), os.path.join(ONEDNN_DIR, "include")
    if os.path.isfile(os.path.join(lib_dir, "libmkldnn.so")) and os.path.isfile(os.path.join(inc_dir, "dnnl.hpp")):
        return True
    system_lib = next((p for p in SYSTEM_DNNL_LIBS if os.path.exists(p)), None)
    if system_lib is None or not os.path.isfile("/usr/include/dnnl.hpp"):
        return False
    os.makedirs(lib_dir, exist_ok=True)
    os.makedirs(inc_dir, exist_ok=True)
    links = [(header, os.path.join(inc_dir, os.path.basename(header)))
             for header in glob.glob("/usr/include/dnnl*.h*") + ["/usr/include/oneapi"] if os.path.exists(header)]
    for target, link in links + [(os.path.realpath(system_lib), os.path.join(lib_dir, "libmkldnn.so"))]:
        try:
            os.symlink(target, link)
        except FileExistsError:
            pass  # made before, or at this moment by another rank of a cold host
    return True


NCCL_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jittor", "nccl")  # where Jittor builds NCCL
NCCL_BUILD = os.path.join(NCCL_DIR, "nccl-2.8.4-1", "build", "lib", "libnccl.so")


def wheel_nccl():
    """(include folder, library folder) of the NCCL in an installed nvidia-nccl-cu* wheel (torch's dependency), the
    library under the name Jittor loads (libnccl.so, a link in Jittor's cache); None without one. Jittor would
    otherwise download NCCL's sources and build them, which a machine without registries cannot."""
    for folder in sys.path:
        nccl = os.path.join(folder or ".", "nvidia", "nccl")
        library = os.path.join(nccl, "lib", "libnccl.so.2")
        if os.path.isfile(library) and os.path.isfile(os.path.join(nccl, "include", "nccl.h")):
            named = os.path.join(NCCL_DIR, "wheel", "lib")
            os.makedirs(named, exist_ok=True)
            link = os.path.join(named, "libnccl.so")
            if os.path.realpath(link) != os.path.realpath(library):
                temporary = f"{link}.{os.getpid()}"
                os.symlink(library, temporary)
                os.replace(temporary, link)  # another rank's link to the same library may stand there already
            return os.path.join(nccl, "include"), named
    return None


def nccl_obtainable() -> bool:
    """Whether Jittor can have NCCL under mpirun: given by path, built before, or downloadable. Jittor downloads and
    builds it whenever MPI and CUDA are both there, and where nothing can be downloaded (a GPU machine without
    registries) the failed download aborted every rank at import."""
    if os.environ.get("nccl_lib_path") or os.path.isfile(NCCL_BUILD):
        return True
    try:
        socket.getaddrinfo("codeload.github.com", 443)
        return True
    except OSError:
        return False


# The signals a process stops on at its next safe point: Ctrl-C, kill (TERM), and SIGUSR1, which mpirun
# forwards to every rank as it is (OpenMPI answers a SIGTERM to mpirun with SIGTERM to its ranks and
# SIGKILL one second later, before a longer step can end; `kill -USR1 <mpirun's pid>` lets it end).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def stop_exit_status(name: str) -> int:
    """The exit status of a process stopped by the stop signal `name`: 128 + its number, as a shell
    reports a process that a signal ended (130 SIGINT, 143 SIGTERM, 138 SIGUSR1)."""
    return 128 + signal.Signals[name]


def launcher() -> str:
    """How this process was launched, as a command line starts: `mpirun -np N ` under OpenMPI (its environment
    names the ranks), else nothing; a resume hint repeats it."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE")
    return f"mpirun -np {size} " if size else ""


def stop_origin(name: str) -> str:
    """What a rank can say of where a stop signal came from: under mpirun a SIGTERM is also a Ctrl-C (SIGINT) to
    mpirun, which OpenMPI cannot forward as it is (its ess_base_forward_signals refuses SIGINT); it sends its ranks
    SIGTERM, SIGKILL a second later, and exits 1."""
    return (" (under mpirun: a Ctrl-C or SIGTERM to mpirun, which kills the ranks a second later and exits 1; "
            "send mpirun SIGUSR1 to stop at a step boundary)") if launcher() and name == "SIGTERM" else ""


def block_stop_signals():
    """Make the stop signals pending flags that only the process's own poll reads
    (StopFlag below), in a training or inference process.

    Call before numpy, OpenMP or Jittor start a thread: each inherits the block, so no
    handler ever interrupts Jittor (a Python handler corrupted its heap in about 1 run in
    15, and Jittor's own SIGINT handler quick-exits with status 1, mid-write). Jittor's
    forked compiler pool is switched off: it would inherit the block too, hang the exit,
    and under mpirun die by SIGKILL, which Jittor's SIGCHLD handler turns into the exit of
    the rank (the entry points turn the threaded op compiler back on).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    os.environ["DISABLE_MULTIPROCESSING"] = "1"


class StopFlag:
    """A stop signal (SIGINT, SIGTERM, SIGUSR1), polled at safe points (between optimizer steps, between generated batches).

    The entry points block them in every thread (Utils.jittor_env.block_stop_signals), so
    they wait as pending until polled here and never interrupt Jittor. Where they are not
    blocked (Math.main called in-process) they keep their default actions.
    """

    def __init__(self):
        self.signal = None  # the first stop signal received

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "SIGTERM"

    def poll(self) -> bool:
        if self.signal is None:
            pending = signal.sigpending() & set(STOP_SIGNALS)
            if pending:
                self.signal = signal.sigtimedwait(pending, 0).si_signo  # consume it
        return self.requested

    def votes(self) -> list:
        """This rank's vote, polled: 1.0 for the stop signal it received, one number for each of STOP_SIGNALS (summed
        over the ranks, they go to agree)."""
        self.poll()
        return [float(self.signal == s) for s in STOP_SIGNALS]

    def agree(self, counts) -> bool:
        """Whether any rank voted to stop (`counts`: the votes summed over the ranks). A rank that received no signal
        yet (mpirun forwards one to each host in turn) takes the first one voted for, so that every rank stops by
        the signal that was sent and says so in its exit status."""
        if self.signal is None:
            self.signal = next((s for s, n in zip(STOP_SIGNALS, counts) if n > 0), None)
        return self.requested


class Stopped(Exception):
    """A stop signal ended the work before it was done; str() is the signal's name. `done`: what was
    finished before it (code scoring: the results of the programs that ran), `kept`: where it was written,
    else `not_kept`: why it could not be."""

    def __init__(self, name: str, done=None):
        super().__init__(name)
        self.done, self.kept, self.not_kept = done, None, None


class StopForwarder:
    """The stop signals of a process that only runs the tools as children (Compare.py): each is caught by a
    Python handler, Jittor's own SIGINT handler replaced ("quick exit", status 1: this process runs no
    Jittor op a handler could interrupt), and passed on to the child running at the time, which stops as
    the tools do (a training run at its next step boundary, checkpoint saved). mpirun is sent SIGUSR1,
    which it forwards to its ranks as it is. Each child runs in a session of its own, so a terminal's
    Ctrl-C reaches it through here only, once. `run` waits for the child; `signal` is the first stop.
    The handlers hold inside `with StopForwarder() as stops:`; the earlier ones come back after it."""

    def __init__(self):
        self.signal, self.child, self.previous = None, None, {}

    def __enter__(self):
        self.previous = {signum: signal.signal(signum, self.received) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def received(self, signum, frame):
        self.signal = self.signal or signum
        self.pass_on()

    def pass_on(self):
        child = self.child
        if child is not None and self.signal is not None:
            mpirun = os.path.basename(str(child.args[0])) == "mpirun"
            child.send_signal(signal.SIGUSR1 if mpirun else self.signal)  # nothing when it has ended

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name

    def run(self, command: list, **popen) -> int:
        """Run `command` (subprocess.Popen's `popen` arguments) to its end, stop signals passed on; its exit
        status. Raises Stopped before starting it when a stop came first."""
        import subprocess
        if self.signal is not None:
            raise Stopped(self.name)
        self.child = subprocess.Popen(command, start_new_session=True, **popen)
        try:
            self.pass_on()  # a stop that came while it started
            return self.child.wait()
        finally:
            self.child = None


def cpu_identity() -> str:
    """What code built with -march=native depends on besides the OS, compiler and Python: the CPU's model and
    instruction sets (/proc/cpuinfo's first model name and flags), as a short hash."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return "cpu" + hashlib.md5("".join(dict.fromkeys(lines)).encode()).hexdigest()[:8]


def jittor_home() -> str:
    """The folder holding Jittor's .cache (jittor_utils.home(): JITTOR_HOME, else the user's home)."""
    return os.environ.get("JITTOR_HOME", os.path.expanduser("~"))


def jittor_prepared() -> bool:
    """Whether Jittor has compiled its core for this machine's kind (setup.sh or an earlier run did): a
    jittor_core library in a cache folder of this OS and CPU (jittor_utils.find_cache_path's key, its host part
    the CPU's identity)."""
    def shorten(text):  # as jittor_utils.find_cache_path: a hash for the tail, the key then filtered and shortened
        return text[:14] + "x" + hashlib.md5(text.encode()).hexdigest()[:2] if len(text) > 14 else text
    key = shorten(platform.platform() + (os.environ.get("jittor_cache_host") or cpu_identity()))
    key = shorten("".join(c for c in key if c.isidentifier() or c.isnumeric() or c.isalpha() or c in ".-+"))
    return bool(glob.glob(os.path.join(jittor_home(), ".cache", "jittor", "*", "*", "*", key, "*", "*", "*",
                                       "jittor_core*.so")))


def say_if_unprepared():
    """Under mpirun, the first rank of a host where Jittor has never compiled says why the job waits: its first
    import compiles Jittor (minutes; the host's other ranks wait for it under Jittor's lock, the other hosts'
    ranks at the first all-reduce), which Jittor's silenced log would otherwise leave unsaid."""
    if os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") == "0" and not jittor_prepared():
        print(f"[moa] host {socket.gethostname()}: Jittor is not prepared here (no compiled cache for this CPU under "
              f"{jittor_home()}/.cache/jittor): compiling it now, a few minutes, while every rank waits; "
              "`bash setup.sh` on each host beforehand saves the wait", file=sys.stderr, flush=True)


def prepare():
    if "jittor" in sys.modules:
        return  # too late to change anything; whoever imported it chose
    if "nvcc_path" not in os.environ and not gpu_present():
        os.environ["nvcc_path"] = ""
    elif gpu_present():
        # Jittor's CUDA import downloads CUTLASS, cuTT and (whenever mpicc exists) NCCL, and
        # needs cuDNN 8; none is used here. conv_opt=1 sets up only cuBLAS and cuRAND.
        for name, value in (("use_cutlass", "0"), ("use_cutt", "0"), ("conv_opt", "1")):
            os.environ.setdefault(name, value)
        found = "OMPI_COMM_WORLD_SIZE" in os.environ and not os.environ.get("nccl_lib_path") and wheel_nccl()
        if found:
            os.environ["nccl_include_path"], os.environ["nccl_lib_path"] = found
        if "OMPI_COMM_WORLD_SIZE" not in os.environ or not nccl_obtainable():
            os.environ.setdefault("use_nccl", "0")  # ranks then reduce through MPI on the host
    if os.environ.get("use_mkl", "1") == "1" and not ensure_onednn():
        print("[moa] oneDNN not found (apt-get install libdnnl-dev); using Jittor's slower "
              "built-in matmul (use_mkl=0)", file=sys.stderr)
        os.environ["use_mkl"] = "0"
    # Jittor logs every start at info level; MOA_JITTOR_LOG=1 brings it back.
    if os.environ.get("MOA_JITTOR_LOG", "0") != "1":
        os.environ.setdefault("log_silent", "1")
    # Under mpirun the ranks share the cores; one full OpenMP team per rank would
    # oversubscribe them, and spinning threads made tiny-model training ~10x slower.
    ranks_here = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if ranks_here and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(ranks_here)))
    # OpenMPI refuses root unless told; harmless elsewhere.
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # Jittor keys its compile cache (~/.cache/jittor/...) by the OS, compiler, Python, CPU model and the host's
    # name: each node of a cluster sharing a home compiled Jittor and every kernel again, minutes each, into a
    # cache of its own. The CPU's identity stands in for the name (scripts/jittor_patches.sh), so machines of one
    # kind share one cache and one compile (Jittor's and our kernels' file locks keep concurrent compiles apart).
    if "jittor_cache_host" not in os.environ:
        os.environ["jittor_cache_host"] = cpu_identity()
    say_if_unprepared()


# Jittor's kernels are built with -Ofast, whose start-up code sets the CPU to treat subnormal floats as zero in the
# whole process: numpy's finfo then finds none and warns, once per float type, on every Infer.py run (matplotlib
# asks). The kernels chose that mode; the warning leaves nothing to do.
warnings.filterwarnings("ignore", message="The value of the smallest subnormal", category=UserWarning)
prepare()
