"""What a program in the code sandbox may use and what it leaves: memory up to its limit and none beside it,
output, processes, folders, and endings by any signal; each in every isolation level, no process left after."""
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sandbox_runs import CORRECT, LIMITS, SQUARE, observed, run, sandboxed_processes

from Utils import sandbox
from Utils.sandbox import processes

@pytest.mark.slow
def test_memory_hog(sandbox_mode):
    small = sandbox.SandboxLimits(exec_timeout=2.0, exec_memory_mb=256)  # touching a GiB can take a loaded core 1 s
    result = run(sandbox_mode, "chunks = []\nwhile True:\n    chunks.append(bytearray(2 ** 24))\n", limits=small)
    assert (result.status, result.error) == (sandbox.FAILED, "MemoryError")
    assert run(sandbox_mode, "x = bytearray(2 ** 34)\n").error == "MemoryError"  # 16 GiB, over the default 1 GiB


@pytest.mark.slow
def test_no_memory_beside_the_limit(sandbox_mode):
    """SysV shared memory and memfd are not counted by the address-space limit, and SysV IPC objects and POSIX
    message queues outlive the program on the floor: none of them can be made."""
    probe = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef f():\n    made = []\n"
             "    for name, call in [('shmget', lambda: libc.shmget(0, 2 ** 20, 0o1600)),\n"  # IPC_PRIVATE, IPC_CREAT
             "                       ('msgget', lambda: libc.msgget(0, 0o1600)),\n"
             "                       ('semget', lambda: libc.semget(0, 1, 0o1600)),\n"
             "                       ('mq_open', lambda: libc.mq_open(b'/moa-probe', os.O_CREAT | os.O_RDWR, 0o600,\n"
             "                                                        None)),\n"
             "                       ('memfd_create', lambda: os.memfd_create('probe'))]:\n"
             "        try:\n            if call() >= 0:\n                made.append(name)\n"
             "        except OSError:\n            pass\n    return made\n")
    assert run(sandbox_mode, probe, observed([])) == (sandbox.PASSED, "", 0, "")


@pytest.mark.slow
def test_files_and_folders_are_bounded_under_bubblewrap():
    """Empty folders cost a tmpfs none of its size, only the kernel's memory: past MAX_ENTRIES in its tmpfs
    folders the program is ended and scored failed (on the floor its folders are on the machine's disk)."""
    works, why = sandbox.probe("bwrap")
    if not works:
        pytest.skip(f"bubblewrap does not work here: {why}")
    folders = "import os\ni = 0\nwhile True:\n    os.mkdir(f'd{i}')\n    i += 1\n"
    result = run("bwrap", folders, limits=sandbox.SandboxLimits(exec_timeout=5.0))
    assert result[:2] == (sandbox.FAILED, f"more than {processes.MAX_ENTRIES} files and folders in its "
                                          "working directory")


@pytest.mark.slow
def test_printing_gigabytes(sandbox_mode):
    result = run(sandbox_mode, "import sys\nwhile True:\n    sys.stdout.write('x' * 2 ** 20)\n")  # stdout: /dev/null
    assert result.status == sandbox.TIMED_OUT
    result = run(sandbox_mode, "import sys\nfor _ in range(4096):\n    sys.stderr.write('x' * 2 ** 20)\n" + CORRECT)
    assert result.status == sandbox.FAILED and result.error.startswith("BrokenPipeError")
    assert len(result.stderr) <= processes.OUTPUT_CAP


@pytest.mark.slow
def test_fork_bomb(sandbox_mode):
    """At most exec_processes processes at once (the program's uid or user namespace counts them), every one
    killed when the program ends."""
    seen, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            seen[0] = max(seen[0], len(sandboxed_processes()))
            time.sleep(0.02)

    watcher = threading.Thread(target=count)
    watcher.start()
    try:
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        result = run(sandbox_mode, bomb)
    finally:
        stop.set()
        watcher.join()
    assert result.status == sandbox.TIMED_OUT
    # the program's processes, plus the supervisors and the tests' process (and under bubblewrap, bwrap itself)
    assert 1 <= seen[0] <= LIMITS.exec_processes + (5 if sandbox_mode == "bwrap" else 3), seen


@pytest.mark.slow
def test_an_unnamed_signal_is_told_and_the_others_kept(sandbox_mode):
    """A real-time signal (no name in Python's signal.Signals) ends the program: said by its number, and the
    other programs of the run keep their results."""
    ending = CORRECT + "import os\nos.kill(os.getpid(), 40)\n"
    results = sandbox.run_many([sandbox.Job(ending, SQUARE, "f"), sandbox.Job(CORRECT, SQUARE, "f")], LIMITS,
                               sandbox_mode)
    assert results == [(sandbox.CRASHED, "ended before its tests finished (killed by signal 40)", -40, ""),
                       (sandbox.PASSED, "", 0, "")]
    assert sandboxed_processes() == []


@pytest.mark.slow
def test_folders_deeper_than_recursion_are_removed(sandbox_mode):
    """Folders nested 1,500 deep (past the supervisor's recursion limit and PATH_MAX) and one made unreadable:
    the result is the program's, and its working directory is gone (on the floor the supervisor removes it)."""
    deep = CORRECT + ("import os\nos.makedirs('closed/inside')\nos.fchmod(os.open('closed', os.O_RDONLY), 0)\n"
                      "for _ in range(1500):\n    os.mkdir('four')\n    os.chdir('four')\n")
    lookups = sandbox.SandboxLimits(exec_timeout=5.0)  # Landlock checks each folder of a path: seconds on a busy CPU
    assert run(sandbox_mode, deep, limits=lookups) == (sandbox.PASSED, "", 0, "")
    if os.geteuid() == 0:  # as root the floor's folders belong to this scorer's uids
        uids = processes.uid_range()
        assert [p for p in Path(tempfile.gettempdir()).glob("moa-sandbox-*") if owner(p) in uids] == []


def owner(path: Path):
    try:
        return path.stat().st_uid
    except OSError:  # another scorer's folder, gone meanwhile
        return None


def test_a_working_folder_is_removed_listing_each_folder_once(tmp_path, monkeypatch):
    """The floor's removal of a working folder (Utils/sandbox/sandboxed/launch.py): files, links, a folder made
    unreadable, 2,000 sub-folders side by side and 50 nested; each folder that holds something is listed once
    (a folder of many sub-folders costs its entries, not their square), an empty one not at all."""
    from Utils.sandbox.sandboxed import launch
    work = tmp_path / "work"
    (work / "wide").mkdir(parents=True)
    for i in range(2000):
        (work / "wide" / str(i)).mkdir()
    (work / "wide" / "7" / "file").write_text("x")
    (work / "link").symlink_to(tmp_path / "kept")
    (tmp_path / "kept").mkdir()
    deep = work / "/".join(["d"] * 50)
    deep.mkdir(parents=True)
    (work / "wide" / "7").chmod(0)
    listed, listdir = [], os.listdir
    monkeypatch.setattr(launch.os, "listdir", lambda fd: listed.append(fd) or listdir(fd))
    launch.remove_workdir(str(work))
    monkeypatch.undo()
    assert not work.exists() and (tmp_path / "kept").is_dir()
    assert len(listed) == 3 + 49  # work, wide, wide/7; d/ ... 49 deep (the 50th is empty)
