#!/usr/bin/env bash
# The test command: setup if needed, then pytest with the arguments given: none runs the whole suite
# (pytest.ini's testpaths), `-m "not slow"` the quick run, `tests/test_base.py` one file.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup.sh"
cd "$HERE" && exec "${MOA_VENV:-$HOME/.venvs/moa-jittor}/bin/python" -m pytest -q -p no:cacheprovider "$@"
