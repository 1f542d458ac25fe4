#!/usr/bin/env bash
# The test command: setup if needed, then the whole suite (or the pytest arguments given).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$HERE/setup.sh"
cd "$HERE" && exec "${MOA_VENV:-$HOME/.venvs/moa-jittor}/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests}"
