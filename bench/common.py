"""What the benchmarks of both sides share: the shapes, the timing schedule, the optimizer's
description, the one-line error, where the authors' code is found and the process's peak GPU memory.
It imports neither Jittor nor torch, so bench.py (our venv), peft_bench.py and authors_bench.py (the
reference venv) and side_by_side.py (no framework) all read it.
"""
import ctypes
import os
import sys
import threading

CONFIGS = {  # small and medium as ../shared/ref/ref_bench.py builds the authors' model
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64),
    "medium": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=8192, multiple_of=128),
    # LLaMA-3.1-8B's params.json (bench/scale.py's llama31-8b); --n_layers picks a depth that fits
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3,
               multiple_of=1024, norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True),
}
TRAIN_BATCH, TRAIN_SEQ = 8, 256
WARMUP_STEPS, TIMED_STEPS = 2, 5  # training: the median of the timed steps
DECODE_BATCH, PROMPT_LEN, NEW_TOKENS = 4, 32, 64
DECODE_RUNS = 3  # decoding: the median of these, after one warm-up run
LR, WEIGHT_DECAY = 1e-4, 0.05  # Math.py's optimizer with ref_bench.py's decay


def describe_optimizer(name: str, groups) -> str:
    """One token naming what an optimizer updates and how: `groups` holds one
    (elements, lr, (beta1, beta2), eps, weight_decay) per parameter group; both sides print it
    and side_by_side.py compares the two."""
    return name + "".join(f":{n}@lr{lr:g},b{b1:g},{b2:g},eps{eps:g},wd{wd:g}"
                          for n, lr, (b1, b2), eps, wd in groups)


def fail(message: str):
    """The project's error contract for these scripts: one `error:` line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/carry_authors.sh writes here what the authors' side reads where ../shared and their
# repository are absent (a GPU machine): the reference harness and their sources as a tar.gz
CARRIED_REF = os.path.join(REPO, ".gpu", "ref")
CARRIED_AUTHORS = os.path.join(CARRIED_REF, "authors.tar.gz")


def reference_dir():
    """The folder with ../shared/ref's moa_ref_loader.py and ref_bench.py: $MOA_SHARED/ref (the
    shared folder beside the repository), else the carried copy; None where neither is."""
    shared = os.environ.get("MOA_SHARED", os.path.join(os.path.dirname(REPO), "shared"))
    for folder in (os.path.join(shared, "ref"), CARRIED_REF):
        if os.path.isfile(os.path.join(folder, "ref_bench.py")):
            return folder
    return None


def authors_source():
    """Where the authors' files are read: $MOA_MIRROR (a bare git dir), else the carried
    tar.gz; None where neither is."""
    mirror = os.environ.get("MOA_MIRROR")
    if mirror and os.path.isdir(mirror):
        return mirror
    return CARRIED_AUTHORS if os.path.isfile(CARRIED_AUTHORS) else None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _NvmlProcess(ctypes.Structure):  # nvmlProcessInfo_t of the _v2 and _v3 process lists
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class GpuMemoryPeak:
    """This process's peak GPU memory as the driver counts it, sampled in a background thread.

    Both sides are measured the same way, CUDA context, library workspaces and each framework's
    caching allocator included (torch.cuda.max_memory_reserved sees only torch's allocator; Jittor
    has no such figure). The driver's library (NVML) is called through ctypes, so no framework is
    needed. It lists processes by pid; inside a container it may list the host's pids, and then the
    figure is the devices' used memory above what they held when sampling began (a lent GPU machine
    runs one benchmark at a time). Start it before the framework opens the device, so that the
    context counts. On a machine without NVML or a GPU it measures nothing (peak() is None)."""

    PERIOD_S = 0.02  # both allocators keep what they reserved, so a peak lasts long enough to be seen
    MAX_PROCESSES = 64

    def __init__(self):
        self.process_peak = self.device_peak = self.device_base = 0
        self.handles, self._stop = [], threading.Event()
        try:
            self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if self.nvml.nvmlInit_v2() != 0:
                return
            count = ctypes.c_uint()
            self.nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if self.nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
                    self.handles.append(handle)
            lists = [getattr(self.nvml, name, None) for name in ("nvmlDeviceGetComputeRunningProcesses_v3",
                                                                  "nvmlDeviceGetComputeRunningProcesses_v2")]
            self.process_list = next(f for f in lists if f is not None)
        except (OSError, AttributeError, StopIteration):
            self.handles = []

    def _sample(self):
        used, mine = 0, 0
        for handle in self.handles:
            memory = _NvmlMemory()
            if self.nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                used += memory.used
            count, infos = ctypes.c_uint(self.MAX_PROCESSES), (_NvmlProcess * self.MAX_PROCESSES)()
            if self.process_list(handle, ctypes.byref(count), infos) == 0:
                mine += sum(p.usedGpuMemory for p in infos[:count.value]
                            if p.pid == os.getpid() and p.usedGpuMemory < 1 << 62)  # ~0: not available
        self.process_peak, self.device_peak = max(self.process_peak, mine), max(self.device_peak, used)
        return used

    def _loop(self):
        while not self._stop.wait(self.PERIOD_S):
            self._sample()

    def start(self):
        if self.handles:
            self.device_base = self._sample()
            threading.Thread(target=self._loop, daemon=True, name="gpu-memory-peak").start()
        return self

    def peak(self):
        """(MB, 'process' or 'device'), or None where no GPU memory was seen."""
        if not self.handles:
            return None
        self._stop.set()
        self._sample()
        if self.process_peak:
            return self.process_peak / 2 ** 20, "process"
        delta = self.device_peak - self.device_base
        return (delta / 2 ** 20, "device") if delta > 0 else None

    def keys(self) -> str:
        """' peak_gpu_mb=... peak_gpu_from=...' for a key=value line, or '' where nothing was seen."""
        seen = self.peak()
        return f" peak_gpu_mb={seen[0]:.0f} peak_gpu_from={seen[1]}" if seen else ""
