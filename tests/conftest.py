"""What several test files share: Jittor's environment, the files the tests read, tiny bases and
training flags, and helpers for the golden outputs. Test files never import from one another.

Everything the suite reads ships in tests/: the authors' golden outputs (tests/golden/, see its
README) and a few examples of each math data set (tests/data/). Only Meta's LLaMA-3
tokenizer.model is not ours to ship: the tests that need it read ../shared/llama3 (or
$MOA_SHARED/llama3) and skip when it is absent.

Markers (pytest.ini): `slow` for tests that train or run whole programs, `mpi` for those that
start mpirun; `bash test.sh -m "not slow"` is the quick run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import Utils.jittor_env  # noqa: E402,F401  (must precede any jittor import)
import jittor as jt  # noqa: E402

from Data.synthetic import make_splits  # noqa: E402
from Models.formats.authors import args_from_authors  # noqa: E402
from Models.formats.adapters import assign_strict  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Data.tiny_base import write_random_base, write_random_hf_base  # noqa: E402

# Jittor's SIGCHLD handler quick-exits this whole process (status 1, no report) when any
# child dies by a signal; the tests spawn Math.py, Infer.py and mpirun, so a crashing child
# must fail its own test with its return code and output instead.
signal.signal(signal.SIGCHLD, signal.SIG_DFL)

GOLDEN = REPO / "tests" / "golden"
DATA = REPO / "tests" / "data"
SHARED = Path(os.environ.get("MOA_SHARED", REPO.parent / "shared"))
MPIRUN = shutil.which("mpirun")

# Math.py flags of a tiny, fast run on the tiny base; tests append their own (the last one wins).
# Prompts of the tiny BPE run 127-164 tokens, so 256 keeps every answer.
TINY_FLAGS = ["--max_seq_len", "256", "--batch_size", "4", "--lora_rank", "4", "--p_adapter_size", "8",
              "--swi_x", "2", "--warmup_epochs", "0", "--log_interval", "1", "--eval_interval", "0",
              "--lr", "1e-2"]


def math_argv(tiny_base, synthetic_data, out, *extra) -> list:
    """Math.py's arguments for a tiny run on `synthetic_data` into `out`; `extra` flags win."""
    return [str(a) for a in ["--llama_path", tiny_base, "--data_path", synthetic_data["train"],
                             "--val_data_path", synthetic_data["val"], "--output_dir", out, *TINY_FLAGS, *extra]]


def train(tiny_base, synthetic_data, out, *extra) -> int:
    """Math.main in-process on the tiny flags; its exit code."""
    import Math
    return Math.main(math_argv(tiny_base, synthetic_data, out, *extra))


def log_records(out, event=None) -> list:
    """The JSON lines of <out>/log.txt, those of one `event` ("train", "val", "end") when given."""
    with open(os.path.join(out, "log.txt")) as f:
        return [r for r in map(json.loads, f) if event is None or r["event"] == event]


def one_error_line(err, *needles):
    """stderr holds exactly one `error:` line, no traceback, and the line names every needle."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


def shared_path(*parts):
    """A path under ../shared (only Meta's tokenizer.model is read there), or skip the test."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the read-only ../shared folder beside the clone), which is absent")
    return path


# ---- fixtures

@pytest.fixture(scope="session")
def tiny_meta():
    """The authors' tiny base in Meta's format: params.json, consolidated.00.pth (bf16), base_logits.npz."""
    return GOLDEN / "tiny_meta"


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A random tiny base with its own BPE tokenizer (seeded: the same files every run); read-only."""
    return write_random_base(str(tmp_path_factory.mktemp("tiny_base")), dim=64, n_layers=2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A random tiny Qwen3ForCausalLM folder (head_dim 32 != 64/4, q/k norms, tied embeddings) with a
    tokenizer.json of its own, written by our safetensors writer (seeded); read-only."""
    return write_random_hf_base(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory):
    """A random tiny LlamaForCausalLM folder (untied, scaled RoPE, a BOS) with a tokenizer.json; read-only."""
    return write_random_hf_base(str(tmp_path_factory.mktemp("tiny_hf_llama")), "llama", tied=False)


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """48 training and 8 validation problems of the synthetic math set (seed 1): {"train": path, "val": path};
    read-only."""
    return write_synthetic_splits(tmp_path_factory.mktemp("synthetic_data"), 48, 8, seed=1)


# ---- helpers

def write_synthetic_splits(folder, n_train, n_val, seed) -> dict:
    """train.json and val.json of the synthetic math set in `folder`: {"train": path, "val": path}."""
    paths = {}
    for name, split in zip(("train", "val"), make_splits(n_train, n_val, 0, seed=seed)):
        paths[name] = str(Path(folder) / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(split, f)
    return paths


def mpirun(n, args, timeout=300):
    """`mpirun -np n python Math.py args`; OMPI_ALLOW_RUN_AS_ROOT comes from Utils.jittor_env (imported
    above) through the environment."""
    command = [MPIRUN, "--oversubscribe", "-np", str(n), sys.executable, str(REPO / "Math.py"), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def randomize_adapters(model, seed, scale):
    """Every adapter parameter drawn from scale * N(0, 1), so experts and router really act."""
    rng = np.random.default_rng(seed)
    for var in model.adapter_parameters().values():
        var.assign(jt.array((scale * rng.standard_normal(var.shape)).astype(np.float32)))


def kv_logits(llama, tokens: np.ndarray, prefill: int) -> np.ndarray:
    """Prefill, then one token at a time; row j = last-position logits of step j."""
    llama.reset_cache()
    rows = [llama(jt.array(tokens[:, :prefill]), start_pos=0)[:, -1].numpy()]
    for pos in range(prefill, tokens.shape[1]):
        rows.append(llama(jt.array(tokens[:, pos:pos + 1]), start_pos=pos)[:, -1].numpy())
    return np.stack(rows, 1)


# sparse_s0, soft_s0 (one expert per type) and soft_e2_s3 (two experts per type)
GOLDEN_FILES = ("sparse_s0", "soft_s0", "soft_e2_s3")
# the authors' baseline methods (tests/golden/baselines/README.md)
BASELINE_FILES = ("soft_moe_lora_s0", "soft_moe_molora_e2_s0", "soft_moe_hydra_e3_s1", "soft_moe_ppmoe_e2_s0",
                  "sparse_moe_topk2_e4_s0", "sparse_moe_adamole_e4_s0", "instance_s0", "unipeft_s0")


def load_golden(stem: str):
    """(npz, meta dict, ModelArgs in fp32) of tests/golden/<stem>.npz, e.g. "sparse_s0" or
    "baselines/instance_s0"; meta["variant"] names the authors' folder (authors_options)."""
    data = np.load(GOLDEN / f"{stem}.npz", allow_pickle=False)
    meta = json.loads(str(data["meta"]))
    return data, meta, args_from_authors(meta["model_args"], meta["variant"], precision="fp32")  # parity in fp32


def golden_model(stem: str, **overrides):
    """(model with the golden file's parameters, npz, meta); `overrides` change ModelArgs fields."""
    data, meta, args = load_golden(stem)
    if overrides:
        args = type(args)(**{**args.to_dict(), **overrides})
    model = LLaMA_adapter(args)
    assign_strict(dict(model.named_parameters()), golden_params(data), f"{stem}.npz", "golden")
    return model, data, meta


def golden_forward(model, data, records=None):
    """(loss, logits) on the golden batch, the loss masked where the authors' ignore_index=0 drops it."""
    tokens = jt.array(data["tokens"].astype(np.int32))
    mask = jt.array((data["labels"] != 0).astype(np.float32))
    return model(tokens, mask, records=records)


def assert_golden_gradients(model, loss, data, meta):
    """Every trainable tensor's gradient of `loss` against the golden file's (1e-3 relative); those
    the authors' code gives no gradient (meta["grad_none"]) exactly zero."""
    adapter = model.adapter_parameters()
    assert sorted(adapter) == sorted(meta["trainable"])
    for name, grad in zip(adapter, jt.grad(loss, list(adapter.values()))):
        ref, got = data[f"grad/{name}"], grad.numpy()
        if name in meta["grad_none"]:
            assert np.all(got == 0), f"{name}: the authors' code gives it no gradient"
        else:
            assert max_abs(got, ref) / np.abs(ref).max() <= 1e-3, name


def authors_round_trip(model, data, meta, folder, method=None):
    """Our adapter -> the authors' adapter.pth + adapter_params.json (their names, values and their
    folder's fields) -> ours again, loaded into a fresh model with the golden values. Returns the
    path of their adapter.pth."""
    from Models.formats.authors import AUTHORS_PARAMS
    from Models.formats.adapters import export_authors_adapter, import_authors_adapter, load_adapter, save_adapter
    from Models.formats.pth import load_pth
    params = golden_params(data)
    save_adapter(model, str(folder / "ours"))
    theirs_path = str(folder / "theirs" / "adapter.pth")
    export_authors_adapter(str(folder / "ours"), theirs_path)
    theirs = load_pth(theirs_path)
    assert sorted(theirs) == sorted(meta["adapter_only_names"])
    assert all(np.array_equal(theirs[n], params[n]) for n in theirs)
    with open(folder / "theirs" / "adapter_params.json") as f:
        assert json.load(f) == {k: meta["model_args"][k] for k in AUTHORS_PARAMS[meta["variant"]]}
    import_authors_adapter(theirs_path, str(folder / "back"), model.args, method)
    fresh = LLaMA_adapter(model.args)
    load_adapter(fresh, str(folder / "back"))
    assert all(np.array_equal(var.numpy(), params[n]) for n, var in fresh.adapter_parameters().items())
    return theirs_path


def golden_params(data) -> dict:
    return {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")}


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


LOAD_PEAK_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import Utils.jittor_env
import numpy as np
from Models.formats import hf, meta
from Models.formats.base_model import base_args, base_layout, build_model
from Models.LLaMA_Adapter import LLaMA_adapter

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

warm, big, precision = sys.argv[2:5]
build_model(warm, base_args(warm, max_seq_len=8, precision=precision))  # compiles the ops
model = LLaMA_adapter(base_args(big, max_seq_len=8, precision=precision))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS")
(meta if base_layout(big) == "meta" else hf).load_base(model, big)
nbytes = sum(int(np.prod(p.shape)) * (2 if p.dtype == "bfloat16" else 4) for p in model.base_parameters().values())
print(json.dumps({"increase": status("VmHWM") - before, "model_bytes": nbytes}))
"""


def load_peak(warm, big, precision) -> dict:
    """{"increase", "model_bytes"}: how much loading the base folder `big` raises the peak RSS (VmHWM) of a
    fresh process that compiled the read ops on the small base `warm` first, and the loaded base's bytes."""
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK_PROBE, str(REPO), str(warm), str(big), precision],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
