"""Distributed helpers (Jittor's MPI) and training-loop bookkeeping.

Multi-process runs are launched with `mpirun -np N python ...`; Jittor detects
MPI by itself and exposes jt.in_mpi, jt.rank, jt.world_size. Rule for every
helper here: Jittor calls (mpi_all_reduce, .item(), .numpy()) run on EVERY
rank; rank-0-only branches only print or write files, or the ranks deadlock.
"""
import datetime
import math
import pickle
import time
from collections import defaultdict, deque

import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt

from Utils.file_io import atomic_write

_is_master = True


def init_distributed_mode(args):
    """Set args.rank, args.world_size, args.gpu (local rank), args.distributed; use CUDA when present.

    GPU choice on multi-GPU hosts: Jittor's NCCL setup binds each rank to GPU
    (local rank % GPU count) when it starts, so nothing is chosen here. Setting
    CUDA_VISIBLE_DEVICES per rank would have to happen before `import jittor`,
    i.e. in the launcher, not here. Pass args.device = "cpu" to stay on the CPU.
    """
    args.rank = jt.rank
    args.world_size = jt.world_size
    args.gpu = jt.mpi.local_rank() if jt.in_mpi else 0
    args.distributed = bool(jt.in_mpi and jt.world_size > 1)
    if jt.has_cuda and getattr(args, "device", "cuda") != "cpu":
        jt.flags.use_cuda = 1
    args.device = "cuda" if jt.flags.use_cuda else "cpu"  # the one used, as args.json records it
    setup_for_distributed(args.rank == 0)
    if args.distributed:
        print(f"| distributed: rank {args.rank} of {args.world_size}, local rank {args.gpu}")


def setup_for_distributed(is_master):
    """Make print_main() print on the master only (print itself is left alone)."""
    global _is_master
    _is_master = is_master


def print_main(*args, **kwargs):
    """print() on the master process only: progress and results, once per run."""
    if _is_master:
        print(*args, **kwargs)


def get_rank():
    return jt.rank if jt.in_mpi else 0


def get_world_size():
    return jt.world_size if jt.in_mpi else 1


def is_main_process():
    return get_rank() == 0


def save_on_master(payload, path):
    """On rank 0, write `path` atomically (see atomic_write); returns path, or None on other ranks.

    `payload` is either a callable `write(tmp_path)` that writes the file (the temp name keeps
    `path`'s extension) or any other object, which is pickled. Fetch Jittor Vars to numpy on ALL
    ranks before calling: this branch runs on rank 0 alone and must not trigger Jittor work.
    """
    if not is_main_process():
        return None
    if callable(payload):
        return atomic_write(path, payload)

    def write(tmp):
        with open(tmp, "wb") as f:
            pickle.dump(payload, f)
    return atomic_write(path, write)


def all_reduce_sum(values):
    """Sum a list of floats over ranks (float64); identity outside MPI. Call on every rank."""
    values = np.asarray(values, dtype=np.float64)
    if not jt.in_mpi or jt.world_size == 1:
        return values
    return jt.array(values).mpi_all_reduce("add").numpy()


def broadcast_object(value, root: int = 0):
    """`value` of rank `root`, pickled and sent to every rank (the others' `value` is ignored); identity outside
    MPI. The ranks share no disk: what one rank reads or holds reaches the others this way. Call on every rank."""
    if not jt.in_mpi or jt.world_size == 1:
        return value
    payload = pickle.dumps(value, protocol=5) if jt.rank == root else b""
    size = int(jt.array(np.array([len(payload)], np.float64)).mpi_broadcast(root).item())
    data = np.frombuffer(payload, np.uint8) if jt.rank == root else np.zeros(size, np.uint8)
    received = jt.array(data).mpi_broadcast(root).numpy()
    return value if jt.rank == root else pickle.loads(received.tobytes())


def from_rank0(read):
    """What `read()` returns on rank 0, on every rank, or the exception it raised there, raised on every rank:
    files of a run's folder, which may lie on rank 0's own disk only. Call on every rank."""
    result, error = None, None
    if is_main_process():
        try:
            result = read()
        except Exception as e:  # noqa: BLE001  (raised on every rank below)
            error = e
    result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


def gather_on_main(local: dict):
    """Rank 0 gets every rank's dict merged, the others None (over MPI: the ranks may share no disk). Call on
    every rank."""
    if not jt.in_mpi or jt.world_size == 1:
        return local
    merged = {}
    for rank in range(jt.world_size):
        merged.update(broadcast_object(local, root=rank))
    return merged if jt.rank == 0 else None


class SmoothedValue:
    """A series of values: median/avg over a recent window, global avg over everything."""

    def __init__(self, window_size=20, fmt="{median:.4f} ({global_avg:.4f})"):
        self.window = deque(maxlen=window_size)
        self.count, self.total = 0, 0.0
        self.fmt = fmt

    def update(self, value, n=1):
        self.window.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        """Sum count and total over ranks (the window stays local). Call on every rank."""
        self.count, self.total = all_reduce_sum([self.count, self.total])
        self.count = int(round(self.count))

    @property
    def median(self):
        return float(np.median(self.window)) if self.window else math.nan

    @property
    def avg(self):
        return float(np.mean(self.window)) if self.window else math.nan

    @property
    def global_avg(self):
        return self.total / self.count if self.count else math.nan

    @property
    def max(self):
        return max(self.window) if self.window else math.nan

    @property
    def value(self):
        return self.window[-1] if self.window else math.nan

    def __str__(self):
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg,
                               max=self.max, value=self.value)


class MetricLogger:
    """Named SmoothedValues plus a progress printer for loops.

    Prints show this rank's (rank 0's) smoothed values; call
    synchronize_between_processes() on every rank (e.g. at epoch end) before
    reading global averages that cover all ranks.
    """

    def __init__(self, delimiter="  "):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **metrics):
        for name, value in metrics.items():
            if value is None:
                continue
            if isinstance(value, jt.Var):
                value = value.item()  # a sync; fine because every rank updates
            self.meters[name].update(float(value))

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def __getattr__(self, name):
        meters = self.__dict__.get("meters", {})
        if name in meters:
            return meters[name]
        raise AttributeError(f"'{type(self).__name__}' has no attribute or meter '{name}'")

    def __str__(self):
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def log_every(self, iterable, print_freq, header="", total=None):
        """Yield the items of `iterable`, printing progress every `print_freq` items.

        `total` overrides len(iterable), e.g. when resuming mid-epoch. The ETA is the items left times the
        mean time of the items after the first, which compiles Jittor's kernels (none yet at the first).
        """
        if total is None:
            total = len(iterable) if hasattr(iterable, "__len__") else None
        iter_time, data_time = SmoothedValue(fmt="{avg:.4f}"), SmoothedValue(fmt="{avg:.4f}")
        after_first = SmoothedValue()
        start = end = time.time()
        count = 0
        for i, item in enumerate(iterable):
            data_time.update(time.time() - end)
            yield item
            iter_time.update(time.time() - end)
            if i > 0:
                after_first.update(time.time() - end)
            count = i + 1
            if i % print_freq == 0 or (total is not None and i == total - 1):
                where = f"[{i}/{total}]" if total is not None else f"[{i}]"
                parts = [header, where]
                if total is not None:
                    eta = after_first.global_avg * (total - 1 - i) if i > 0 else None
                    parts.append(f"eta: {'-' if eta is None else datetime.timedelta(seconds=int(eta))}")
                parts += [str(self), f"time: {iter_time}", f"data: {data_time}"]
                print_main(self.delimiter.join(p for p in parts if p))
            end = time.time()
        total_time = time.time() - start
        per_item = total_time / max(count, 1)
        print_main(f"{header} Total time: {datetime.timedelta(seconds=int(total_time))} ({per_item:.4f} s / it)")


class EarlyStopper:
    """Stop after `patience` validations without an improvement of more than `min_delta`.

    patience None or <= 0 never stops (improvement is still reported).
    """

    def __init__(self, patience, min_delta=0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best = math.inf
        self.bad_rounds = 0

    def step(self, val_loss):
        """Record one validation loss; returns (improved, should_stop)."""
        val_loss = float(val_loss)
        improved = val_loss < self.best - self.min_delta  # NaN never improves
        if improved:
            self.best, self.bad_rounds = val_loss, 0
        else:
            self.bad_rounds += 1
        return improved, self.stopped

    @property
    def stopped(self) -> bool:
        """Patience is spent (a run restored in this state ended by its early stop)."""
        return bool(self.patience) and self.patience > 0 and self.bad_rounds >= self.patience

    def state_dict(self):
        return {"best": self.best, "bad_rounds": self.bad_rounds,
                "patience": self.patience, "min_delta": self.min_delta}

    def load_state_dict(self, state):
        """Restore the counters; patience and min_delta stay as constructed (the run's flags)."""
        self.best, self.bad_rounds = float(state["best"]), int(state["bad_rounds"])
