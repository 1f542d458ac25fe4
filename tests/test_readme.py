"""The README's Python snippet, run as written: taken from README.md (so the two cannot drift) and run by a fresh
interpreter in a folder that holds what it reads, the shipped demo base under assets/ and a Sparse MoA adapter of
the demo recipe where `bash demo.sh` leaves one (output/math/adapter; drawn at random here, not trained)."""
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from tiny_models import randomize_adapters

from Models.formats.adapters import save_adapter
from Models.formats.base_model import base_args, build_model
from Models.ModelArgs import ModelArgs
from Utils.settings import recipe_values

pytestmark = pytest.mark.slow  # the snippet is a program: it loads a model and generates


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "the README holds one Python snippet"
    return blocks[0]


def test_the_readme_python_snippet_runs_as_written(tmp_path):
    base = str(REPO / "assets" / "tiny-math-base")
    demo = {k: v for k, v in recipe_values("demo").items() if k in ModelArgs.__dataclass_fields__}
    model = build_model(base, base_args(base, **demo))
    randomize_adapters(model, seed=2, scale=0.1)
    save_adapter(model, str(tmp_path / "output" / "math" / "adapter"))
    os.symlink(REPO / "assets", tmp_path / "assets")
    (tmp_path / "snippet.py").write_text(readme_python())
    run = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    printed = run.stdout.splitlines()
    columns = ["Q", "K", "V", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER"]
    assert str(columns) in printed
    means = printed[printed.index(str(columns)) + 1:]
    type_means = [float(x) for x in " ".join(means).split("]")[0].strip("[ ").split()]
    assert len(type_means) == len(columns) and all(0 <= w <= 1 for w in type_means)
