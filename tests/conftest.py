import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import Utils.jittor_env  # noqa: E402,F401  (must precede any jittor import)

SHARED = Path(os.environ.get("MOA_SHARED", REPO.parent / "shared"))


def shared_path(*parts):
    """A path under ../shared, or skip the test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the read-only ../shared folder beside the clone), which is absent")
    return path
