"""Who may write an output folder, and what a run may delete: only what the tools wrote.

Every folder the tools write into carries a manifest, `<folder>/.manifest.json`: the tool and the
names (files or folders, directly in it) it wrote there, recorded before each is first written. A
run deletes or overwrites an entry only when a manifest lists it (an entry an earlier run wrote);
anything else in the folder is the user's and is never touched. File names alone never decide.

Training (Math.py): a folder belongs to one run. A run owns its folder through an exclusive flock
on <output_dir>/.lock, held by rank 0 for the life of the process: the kernel drops it when the
process ends however it ends (kill -9 included), so a dead run never leaves the folder stuck, and a
second live run into the same folder is refused. flock is per host; ranks and runs on other hosts
sharing a network folder are not covered. A new run into a folder whose manifest lists another
run's files is refused unless it continues that run (--resume) or replaces it (--overwrite, which
removes what the manifest lists, and evaluation folders inside that a manifest wholly accounts
for). A name the run would write that no manifest lists is refused either way.

Evaluation (Infer.py): a folder holds one evaluation's complete results. They are written into a
staging folder beside it, which replaces it as a whole once everything is scored; a folder holding
anything its manifest does not list is refused, and so is a mount point (it cannot be renamed). A
symlinked folder is followed: its target is replaced.

Interrupted writes (a kill -9) leave temp files `.tmp<pid>.<name>` and staging folders; the next run
removes those of dead writers by the same rule, never by their name alone (remove_stale_temp).
"""
import contextlib
import fcntl
import json
import os
import re
import shutil
import time
import uuid

from Utils.file_io import TMP_PREFIX, temp_name, write_json

LOCK_NAME = ".lock"
MANIFEST = ".manifest.json"
# What Math.py writes into its output folder: a fresh run refuses a folder holding one of these that no
# manifest lists (someone else's file), whatever --overwrite says.
RUN_FILES = ("args.json", "log.txt", "checkpoint-latest.pth", "checkpoint-best.pth", "adapter", "adapter-best",
             "tensorboard", "data")
INFER = "Infer.py"
BOOKKEEPING = (LOCK_NAME, MANIFEST)
STAGING = "staging"  # a manifest's mark of a staging folder: all it holds is the evaluation's
TEMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"(\d+)\.")  # .tmp<pid>.<name>: the writer's pid


class RunDirError(ValueError):
    """The output folder cannot be used: a file, another run's, in use, or holding what the tools did not write."""


def new_run_id() -> str:
    """Sorts by start time; the random tail tells apart runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def check_output_dir(path: str, flag: str = "--output_dir"):
    """The folder or its first existing ancestor must be a writable folder (nothing is created)."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"is under {probe}, which is a file"
        raise RunDirError(f"{flag} {path} {where}, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"{flag} {path}: {probe} is not writable")


# ---- manifests ---------------------------------------------------------------------------

def read_manifest(folder: str) -> dict:
    """{"tool": ..., "written": [names]} of the folder's manifest; {} when it has none."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: unreadable manifest ({e}); remove it only if nothing in {folder} is to be "
                          "kept") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("written"), list)
            and all(isinstance(n, str) and n and "/" not in n for n in manifest["written"])):
        raise RunDirError(f"{path}: not a manifest of the tools (expected {{'tool': ..., 'written': [names]}})")
    return manifest


def record_written(folder: str, tool: str, names):
    """Add `names` (entries directly in `folder`) to its manifest before they are first written."""
    manifest = read_manifest(folder)
    written = manifest.get("written", [])
    new = [n for n in names if n not in written]
    if new or not manifest:  # the tool that made the folder keeps its name
        write_json({"tool": manifest.get("tool", tool), "written": sorted(written + new)},
                   os.path.join(folder, MANIFEST))


def user_entries(folder: str) -> list:
    """The entries of `folder` that no manifest of the tools lists: the user's (temp files aside)."""
    if not os.path.isdir(folder):
        return []
    listed = set(read_manifest(folder).get("written", []))
    return sorted(n for n in os.listdir(folder)
                  if n not in listed and n not in BOOKKEEPING and not n.startswith((TMP_PREFIX, ".part")))


def written_entries(folder: str) -> list:
    """The entries of `folder` its manifest lists and that exist."""
    return [n for n in read_manifest(folder).get("written", []) if os.path.lexists(os.path.join(folder, n))]


def check_claimable(folder: str, names, flag: str = "--output_dir"):
    """Refuse when one of `names`, to be written into `folder`, exists there without a manifest entry."""
    theirs = [n for n in names if n in user_entries(folder)]
    if theirs:
        it = "it" if len(theirs) == 1 else "them"
        raise RunDirError(f"{flag} {folder} holds {', '.join(theirs)}, which no run of the tools wrote (its "
                          f"{MANIFEST} does not list {it}), and this run would write over {it}: move {it} away or "
                          f"choose another {flag}")


def check_tool(folder: str, tool: str, flag: str = "--output_dir"):
    """Refuse a folder whose manifest names another tool: what that tool wrote there (a run, an evaluation's
    results, an export) is never this one's to replace or remove."""
    manifest = read_manifest(folder) if os.path.isdir(folder) else {}
    if manifest and manifest.get("tool") != tool:
        raise RunDirError(f"{flag} {folder} belongs to {manifest.get('tool') or 'a tool of no name'} (by its "
                          f"{MANIFEST}): {tool} writes into a folder of its own; choose another {flag}")


def _inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it, as written or with links resolved."""
    return any(p == f or p.startswith(f.rstrip(os.sep) + os.sep)
               for p in {os.path.abspath(path), os.path.realpath(path)}
               for f in {os.path.abspath(folder), os.path.realpath(folder)})


def check_inputs_outside(doomed, inputs, what: str):
    """Refuse when an input of the run (`inputs`: (flag, path) pairs: data, base, adapter, recipe) is, or lies
    inside, a path to be removed."""
    for path in doomed:
        for flag, kept in inputs:
            if kept and _inside(kept, path):
                raise RunDirError(f"{what} would delete {path}, and this run reads {kept} there ({flag}): move the "
                                  "input or choose another --output_dir")


def removable_entries(folder: str) -> list:
    """Paths a replacing run removes: the entries the folder's manifest lists, and the evaluation folders
    in it whose own manifest accounts for everything they hold."""
    paths = [os.path.join(folder, n) for n in written_entries(folder)]
    for name in sorted(os.listdir(folder)):
        child = os.path.join(folder, name)
        if (child not in paths and os.path.isdir(child) and not os.path.islink(child)
                and read_manifest(child).get("tool") == INFER and not user_entries(child)):
            paths.append(child)
    return paths


def manifest_or_none(folder: str) -> dict:
    """read_manifest, or {} for a folder whose manifest is not the tools' (a sweep then removes nothing there)."""
    try:
        return read_manifest(folder)
    except RunDirError:
        return {}


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def temp_folder_of_the_tools(path: str) -> bool:
    """A temp folder its own manifest claims whole: a staging folder, or an evaluation folder set aside to
    be replaced (everything in it listed)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    manifest = manifest_or_none(path)
    return bool(manifest.get(STAGING)) or (manifest.get("tool") == INFER and not user_entries(path))


def remove_stale_temp(folder: str, recursive: bool = True, owned: bool = False) -> list:
    """Remove what interrupted writes of dead processes left in `folder` (and in its sub-folders), where a
    manifest lists it: `.tmp<pid>.<name>` whose <name> the folder's manifest lists (or which is a temp
    copy of the manifest itself), anything of that form inside an entry a manifest lists (`owned`:
    adapter/, tensorboard/), and a temp folder that its own manifest claims (temp_folder_of_the_tools).
    Anything else, however it is named, is the user's and stays; so does what a live process writes.
    Returns the removed paths."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    listed = set(manifest_or_none(folder).get("written", [])) | {MANIFEST}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        match = TEMP_NAME.match(name)
        if match:
            ours = owned or name[match.end():] in listed or temp_folder_of_the_tools(path)
            if ours and not pid_alive(int(match.group(1))):
                remove(path)
                removed.append(path)
        elif recursive and os.path.isdir(path) and not os.path.islink(path):
            removed += remove_stale_temp(path, True, owned or name in listed)
    return removed


def remove(path: str):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# ---- training folders --------------------------------------------------------------------

def check_owner(path: str, resume, overwrite: bool, tool: str = "Math.py"):
    """Refuse another tool's folder (an evaluation's, however asked), a fresh run into a folder holding another
    run's files (by its manifest), and any run but a resumed one where a name it writes is taken by something no
    manifest lists."""
    check_tool(path, tool)
    found = written_entries(path) if os.path.isdir(path) else []
    if found and not resume and not overwrite:
        resumable = "checkpoint-latest.pth" in found  # without it --resume auto starts afresh
        raise RunDirError(f"--output_dir {path} holds another run's files ({', '.join(found)}): "
                          f"{'continue that run with --resume auto, ' if resumable else ''}replace it with "
                          "--overwrite, or choose another --output_dir")
    if not resume:
        check_claimable(path, RUN_FILES)


class RunDir:
    """The claim on one output folder (rank 0): the lock, held until release() or the process ends, and
    the manifest of what the run writes."""

    def __init__(self, path: str, run_id: str, tool: str = "Math.py"):
        self.path, self.run_id, self.tool = path, run_id, tool
        self._fd = None

    def claim(self, resume, overwrite: bool, keep=()):
        """Lock the folder, check it is ours to write, remove what an earlier run wrote with `overwrite`
        (refused if `keep`, the paths this run reads, lie among it) and the temp files that interrupted
        writes left. Returns the removed temp files."""
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
        check_owner(self.path, resume, overwrite, self.tool)  # again: the folder may have changed before the lock
        if overwrite and not resume:
            doomed = removable_entries(self.path)
            check_inputs_outside(doomed, keep, "--overwrite")
            for path in doomed:
                remove(path)
            write_json({"tool": self.tool, "written": []}, os.path.join(self.path, MANIFEST))
        return remove_stale_temp(self.path)

    def record(self, *names):
        """Entries about to be written into the folder, for its manifest (the next replacing run's list)."""
        record_written(self.path, self.tool, names)

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


# ---- evaluation folders ------------------------------------------------------------------

def eval_dir(path: str, inputs=()) -> str:
    """The folder an evaluation replaces for --output_dir `path` (a symlink's target), after refusing a file,
    a path under a file, a mount point, a folder holding anything its manifest does not list, one whose
    parent cannot take the staging folder, and one that holds an input of the run."""
    check_output_dir(path)
    target = os.path.realpath(path)
    if os.path.ismount(target):
        raise RunDirError(f"--output_dir {path} is a mount point, which Infer.py cannot replace as a whole (it "
                          "fills a folder beside it and renames that into place): choose a folder inside it")
    check_output_dir(os.path.dirname(target))  # the staging folder goes beside the target
    foreign = evaluation_foreign(target)
    if foreign:
        raise RunDirError(f"--output_dir {path} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}"
                          f", which are not an evaluation's results (its {MANIFEST} does not list them); "
                          "Infer.py replaces its output folder as a whole, so choose another --output_dir")
    check_inputs_outside([target], inputs, f"--output_dir {path}")
    return target


def evaluation_foreign(folder: str) -> list:
    """What in `folder` is not an evaluation's results: everything, where another tool's manifest
    (a training run's folder) or none lists it."""
    foreign = user_entries(folder)
    if os.path.isdir(folder) and read_manifest(folder).get("tool", INFER) != INFER:
        foreign = sorted(set(foreign) | set(written_entries(folder)))
    return foreign


def staging_dir(path: str, pid: int) -> str:
    """The folder beside `path` that process `pid` fills before it replaces `path`."""
    return os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{pid}.{os.path.basename(path)}")


def make_staging(staging: str, tool: str = INFER):
    """Create the staging folder with a manifest that claims all of it, so that a later run may remove it
    once its writer is dead (remove_stale_temp)."""
    os.makedirs(staging, exist_ok=True)
    if not os.path.isfile(os.path.join(staging, MANIFEST)):
        write_json({"tool": tool, "written": [], STAGING: True}, os.path.join(staging, MANIFEST))


@contextlib.contextmanager
def replacing(path: str):
    """A staging folder beside `path` for this process to fill: when the block ends without an error it
    replaces `path` (swap_in); it is removed however the block ends."""
    staging = staging_dir(path, os.getpid())
    make_staging(staging)
    try:
        yield staging
        swap_in(staging, path)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)


def swap_in(staging: str, path: str):
    """Replace `path` by the finished staging folder, whole, its manifest listing everything in it."""
    record_written(staging, INFER, [n for n in os.listdir(staging) if n not in BOOKKEEPING])
    old = None
    if os.path.isdir(path):
        foreign = evaluation_foreign(path)  # again: something may have been put there since the start
        if foreign:
            raise RunDirError(f"{path} now holds {', '.join(foreign[:3])}, which no evaluation wrote: not replaced")
        old = os.path.join(os.path.dirname(path), temp_name("old-" + os.path.basename(path)))
        os.rename(path, old)
    os.rename(staging, path)
    if old is not None:
        shutil.rmtree(old)
