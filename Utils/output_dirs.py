"""Who may write an output folder, and how.

Training (Math.py): a folder belongs to one run.

A run owns its folder through an exclusive flock on <output_dir>/.lock, held by rank 0 for the
life of the process: the kernel drops it when the process ends however it ends (kill -9
included), so a dead run never leaves the folder stuck, and a second live run into the same
folder is refused. flock is per host; ranks and runs on other hosts sharing a network folder are
not covered. A new run into a folder holding another run's files is refused unless it continues
that run (--resume) or replaces it (--overwrite).

Evaluation (Infer.py): a folder holds one evaluation's complete results. They are written into a
staging folder beside it, which replaces it as a whole once everything is scored; a folder holding
anything else is refused.
"""
import fcntl
import fnmatch
import os
import shutil
import time
import uuid

from Utils.misc import TMP_PREFIX, remove_stale_temp, temp_name

LOCK_NAME = ".lock"
# What Math.py writes into its output folder (and Infer.py's default evaluations of its adapter); any
# of them means a run has used the folder, and --overwrite removes them all, so none outlives its run.
RUN_FILES = ("args.json", "log.txt", "checkpoint-latest.pth", "checkpoint-best.pth", "adapter", "adapter-best",
             "tensorboard", "data", "eval", "eval_base")


# What an evaluation folder holds; anything else in it means it is not one.
RESULT_FILES = ("*_predictions.jsonl", "scores.json", "type_weight.pkl", "token_weight.pkl", "*.png")


class RunDirError(ValueError):
    """The output folder cannot be used: a file, another run's, in use, or not an evaluation's."""


def new_run_id() -> str:
    """Sorts by start time; the random tail tells apart runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def check_output_dir(path: str):
    """The folder or its first existing ancestor must be a writable folder (nothing is created)."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"is under {probe}, which is a file"
        raise RunDirError(f"--output_dir {path} {where}, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"--output_dir {path}: {probe} is not writable")


def previous_run_files(path: str) -> list:
    return [name for name in RUN_FILES if os.path.lexists(os.path.join(path, name))]


def check_owner(path: str, resume, overwrite: bool):
    """Refuse a fresh run into a folder that holds another run's files."""
    found = previous_run_files(path)
    if found and not resume and not overwrite:
        raise RunDirError(f"--output_dir {path} holds another run's files ({', '.join(found)}): continue that run "
                          "with --resume auto, replace it with --overwrite, or choose another --output_dir")


class RunDir:
    """The claim on one output folder (rank 0): the lock, held until release() or the process ends."""

    def __init__(self, path: str, run_id: str):
        self.path, self.run_id = path, run_id
        self._fd = None

    def claim(self, resume, overwrite: bool, keep=()):
        """Lock the folder, check it is ours to write, clear another run's files with `overwrite`
        (refused if `keep`, the paths this run reads, lie among them) and the temp files that
        interrupted writes left. Returns the removed temp files."""
        check_output_dir(self.path)
        os.makedirs(self.path, exist_ok=True)
        lock_path = os.path.join(self.path, LOCK_NAME)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"--output_dir {self.path} is in use by another run (pid, run id: {holder}; lock "
                              f"{lock_path}): wait for it to end or choose another --output_dir") from None
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.run_id}\n".encode(), 0)
        check_owner(self.path, resume, overwrite)  # again: the folder may have changed before the lock
        if overwrite and not resume:
            self._remove_previous_run(keep)
        return remove_stale_temp(self.path)

    def _remove_previous_run(self, keep):
        doomed = [os.path.join(self.path, name) for name in previous_run_files(self.path)]
        for path in doomed:
            for kept in keep:
                if kept and os.path.abspath(kept).startswith(os.path.abspath(path) + os.sep):
                    raise RunDirError(f"--overwrite would delete {path}, which holds {kept} that this run reads")
        for path in doomed:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


# ---- evaluation folders ------------------------------------------------------------------

def check_eval_dir(path: str):
    """Refuse a file, a path under a file, or a folder holding anything but an evaluation's results
    (the run's own folder, say)."""
    check_output_dir(path)
    if os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if not n.startswith((TMP_PREFIX, ".part"))
                         and not any(fnmatch.fnmatch(n, pattern) for pattern in RESULT_FILES))
        if foreign:
            raise RunDirError(f"--output_dir {path} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}"
                              ", which are not an evaluation's results; Infer.py replaces its output folder as a "
                              "whole, so choose another --output_dir")


def staging_dir(path: str, pid: int) -> str:
    """The folder beside `path` that process `pid` fills before it replaces `path`."""
    return os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{pid}.{os.path.basename(path)}")


def swap_in(staging: str, path: str):
    """Replace `path` by the finished staging folder, whole."""
    old = None
    if os.path.isdir(path):
        old = os.path.join(os.path.dirname(path), temp_name("old-" + os.path.basename(path)))
        os.rename(path, old)
    os.rename(staging, path)
    if old is not None:
        shutil.rmtree(old)
