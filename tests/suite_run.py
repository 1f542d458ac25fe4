"""How the suite runs, as a pytest plugin (tests/conftest.py loads it): the cores among test.sh's workers, and
the time summary at the end, where a run's time went per test file (test.sh adds pytest's slowest tests)."""
import contextlib
import fcntl
import os
from pathlib import Path

import Utils.jittor_env  # noqa: F401  (must precede any jittor import)
import jittor as jt
import pytest

JIT_DIR = os.path.join(jt.flags.cache_path, "jit")
FILE_TIMES = {}  # test file: [seconds, tests, kernels added meanwhile]
KERNELS_AT_START = pytest.StashKey[int]()  # in Jittor's cache when the session, or a test, began


def cached_kernels() -> int:
    """The kernels in Jittor's cache: each new shape of an op that a test (or a program it starts) runs compiles
    one more .so, so the count that a file adds says how much of its time went to compiling."""
    try:
        return sum(name.endswith(".so") for name in os.listdir(JIT_DIR))
    except OSError:
        return 0


def pytest_sessionstart(session):
    session.config.stash[KERNELS_AT_START] = cached_kernels()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with cores_for(item):
        item.stash[KERNELS_AT_START] = cached_kernels()
        yield


@contextlib.contextmanager
def cores_for(item):
    """Among test.sh's workers, an `mpi` test (its fixtures included) runs alone: its ranks wait for each other by
    spinning, so a rank that shares its core with another worker's test holds the other rank spinning (the demo's
    training took twice as long beside one busy process). Other tests share the cores."""
    if not hasattr(item.config, "workerinput"):  # one process: nothing to share
        yield
        return
    # each worker's --basetemp is a folder of the run's own (pytest keeps the last three runs' and removes older)
    with open(Path(item.config.option.basetemp).parent / "cores.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("mpi") else fcntl.LOCK_SH)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "teardown":  # the last report of a test, the one a worker sends with these properties
        report.user_properties.append(("kernels_added", cached_kernels() - item.stash[KERNELS_AT_START]))


def pytest_runtest_logreport(report):  # in the one process that reports, with or without workers
    entry = FILE_TIMES.setdefault(report.location[0], [0.0, 0, 0])
    entry[0] += report.duration  # setup (a fixture's first user pays for it, as in --durations), call, teardown
    if report.when == "teardown":
        entry[1] += 1
        entry[2] += dict(report.user_properties).get("kernels_added", 0)


@pytest.hookimpl(trylast=True)  # after pytest's slowest tests: the last lines before the verdict
def pytest_terminal_summary(terminalreporter, config):
    if not FILE_TIMES:
        return
    total = sum(seconds for seconds, _, _ in FILE_TIMES.values())
    write = terminalreporter.write_line
    terminalreporter.section("time per test file")
    write("(test time summed over test.sh's workers; kernels: added to Jittor's cache while a file's tests ran, by "
          "them or any process sharing the cache, such as the other worker; a warm cache compiles none)")
    for path, (seconds, tests, kernels) in sorted(FILE_TIMES.items(), key=lambda item: -item[1][0]):
        write(f"{seconds:8.1f}s {100 * seconds / max(total, 1e-9):5.1f}% {tests:4d} tests {kernels:5d} kernels  {path}")
    write(f"{total:8.1f}s in {sum(t for _, t, _ in FILE_TIMES.values())} tests, "
          f"{cached_kernels() - config.stash[KERNELS_AT_START]} kernels compiled")
