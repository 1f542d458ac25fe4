import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import Utils.jittor_env  # noqa: E402,F401  (must precede any jittor import)
import jittor  # noqa: E402,F401

# Jittor's SIGCHLD handler quick-exits this whole process (status 1, no report) when any
# child dies by a signal; the tests spawn Math.py, Infer.py and mpirun, so a crashing child
# must fail its own test with its return code and output instead.
signal.signal(signal.SIGCHLD, signal.SIG_DFL)

SHARED = Path(os.environ.get("MOA_SHARED", REPO.parent / "shared"))


def shared_path(*parts):
    """A path under ../shared, or skip the test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the read-only ../shared folder beside the clone), which is absent")
    return path
