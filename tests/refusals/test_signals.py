"""Stop signals and kills: SIGINT (130) and SIGTERM (143) end a run between steps with its last checkpoint
written whole and resumable, end an evaluation between batches writing nothing, end code scoring with its
sandboxed programs (none left running; what was scored kept beside the output), end a run blocked on its input;
a SIGKILL in the middle of a checkpoint write leaves the last whole one, and resuming from it is bit-exact;
Compare.py passes a stop on to the run it waits for and exits as the tools do.
Every signal is sent by conftest.run_and_signal once the program is where the test wants it; one test
stands a stop flag in for the signal, to stop Infer.py's own generations once their programs run."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (DATA, MPIRUN, REPO, holds_open, log_lines, log_records, math_argv, one_error_line, printed,
                      python_program, run_and_signal, snapshot, train, write_samples)

import Infer
import Math
from Data.synthetic import make_splits
from Models.formats.pth import load_pth
from Utils import file_io, sandbox
from Utils.sandbox import processes
from Utils.jittor_env import Stopped

EVERY_STEP = ("--eval_interval", "1")  # validate and save checkpoint-latest after every step
MPI = [pytest.mark.mpi, pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (install OpenMPI to test data "
                                                                   "parallel)")]


def no_temp_files(folder):
    return not [n for n in os.listdir(folder) if n.startswith(file_io.TMP_PREFIX)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, stop, code, logged", [
    (1, signal.SIGINT, 130, 1), (1, signal.SIGTERM, 143, 2),
    pytest.param(2, signal.SIGUSR1, 138, 3, marks=MPI, id="mpirun-2-SIGUSR1")])  # mpirun forwards it to both ranks
def test_a_stop_signal_checkpoints_the_last_step(tiny_base, synthetic_data, tmp_path, ranks, stop, code, logged):
    """Sent once `logged` lines are in log.txt, so that it falls inside the training loop; one process resumes
    from the checkpoint it left and goes on from the next step. Under mpirun the signal is SIGUSR1, which it
    forwards as it is (a SIGTERM it answers with SIGKILL to the ranks one second later, before a step that
    compiles a kernel can end), and it exits with its ranks' status."""
    out = tmp_path / "run"
    command = python_program("Math.py", *math_argv(tiny_base, synthetic_data, out, "--epochs", 50))
    if ranks > 1:
        command = [MPIRUN, "--oversubscribe", "-np", str(ranks), *command]
    done = run_and_signal(command, stop, log_lines(out, logged))
    output = done.stdout + done.stderr
    assert done.returncode == code, output[-3000:]
    assert f"stopped by {stop.name}" in output and "Traceback" not in output and "quick exit" not in output
    steps = [r["step"] for r in log_records(out, "train")]
    assert load_pth(out / "checkpoint-latest.pth")["global_step"] == steps[-1] >= logged
    assert no_temp_files(out)
    if ranks > 1:  # the command the stop message gives repeats the launcher
        assert f"continue with: mpirun -np {ranks} python Math.py --resume auto --output_dir {out}" in output
    if ranks == 1:  # the command the stop message gives, with a flag that may change
        assert f"continue with: python Math.py --resume auto --output_dir {out}" in output
        assert Math.main(["--resume", "auto", "--output_dir", str(out), "--max_steps", str(steps[-1] + 1)]) == 0
        assert [r["step"] for r in log_records(out, "train")] == steps + [steps[-1] + 1]


@pytest.mark.slow
@pytest.mark.parametrize("stop, code, ends", [pytest.param(signal.SIGUSR1, 138, True, marks=MPI),
                                              pytest.param(signal.SIGTERM, 1, False, marks=MPI),
                                              pytest.param(signal.SIGINT, 1, False, marks=MPI)])
def test_mpirun_lets_a_long_step_end_on_sigusr1_only(stop, code, ends):
    """Each rank takes a 3-second step after the signal reaches mpirun, then polls: SIGUSR1 is forwarded as
    it is and every rank stops there; a SIGTERM OpenMPI answers with SIGKILL a second later, mid-step, and a SIGINT
    (Ctrl-C) too: OpenMPI cannot forward SIGINT, it sends its ranks SIGTERM, and mpirun exits 1 (Open MPI 4.1.4)."""
    program = textwrap.dedent("""
        import time
        import Utils.jittor_env as env
        env.block_stop_signals()
        stop = env.StopFlag()
        print("ready", flush=True)
        while not stop.poll():
            time.sleep(0.05)
        time.sleep(3)  # the step in progress
        print("stopped by", stop.name, flush=True)
        raise SystemExit(env.stop_exit_status(stop.name))
    """)
    command = [MPIRUN, "--oversubscribe", "-np", "2", sys.executable, "-c", program]
    done = run_and_signal(command, stop, lambda pid, out: out.count("ready") == 2, timeout=60)
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stdout.count(f"stopped by {stop.name}") == (2 if ends else 0), done.stdout + done.stderr


@pytest.mark.slow
def test_sigint_stops_an_evaluation_between_batches_and_writes_nothing(tiny_base, tmp_path):
    data = tmp_path / "synthetic" / "test.json"
    data.parent.mkdir()
    data.write_text(json.dumps(make_splits(4, 0, 60, seed=3)[2]))
    out = tmp_path / "eval"
    command = python_program("Infer.py", "--no_adapter", "--llama_path", tiny_base, "--data_path", data,
                             "--output_dir", out, "--max_gen_len", 40, "--batch_size", 1)
    done = run_and_signal(command, signal.SIGINT, printed("[infer]"))  # generation started: between batches
    output = done.stdout + done.stderr
    assert done.returncode == 130, output
    assert "stopped by SIGINT" in output and "Traceback" not in output and "quick exit" not in output
    assert not out.exists() and no_temp_files(tmp_path)


def sandbox_running(pid, stdout):
    """Ready once a sandboxed program of process `pid` runs (its supervisors carry TOKEN_PREFIX and `pid`)."""
    token = f"{processes.TOKEN_PREFIX}{pid}-".encode()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token in f.read():
                    return True
        except OSError:
            pass
    return False


@pytest.mark.slow
@pytest.mark.parametrize("stop, code, blocked", [(signal.SIGINT, 130, False), (signal.SIGUSR1, 138, True)])
def test_a_stop_signal_ends_code_scoring_keeping_what_was_scored(tmp_path, stop, code, blocked, code_sandbox):
    """Ctrl-C (or SIGTERM, SIGUSR1) while --samples programs run: they are ended, nothing is left running, the
    results already in --output_dir stay as they were, the exit status is the signal's, and the rows of the
    programs that finished and every completion are kept in <output_dir>.stopped (its samples file is
    what --samples scores). Sent once the first problem's four quick programs are scored; a user's folder of
    that name (`blocked`) is left alone and the error line says nothing was kept."""
    rows = [("HumanEval/0", "    return 1\n")] * 4 + \
        [(f"HumanEval/{i}", "    import time\n    time.sleep(30)\n") for i in (1, 2) for _ in range(4)]
    samples = write_samples(tmp_path / "samples.jsonl", rows)
    out, kept = tmp_path / "eval", tmp_path / "eval.stopped"
    quick = write_samples(tmp_path / "quick.jsonl", [(f"HumanEval/{i}", "    return 1\n") for i in range(3)])
    humaneval = DATA / "code" / "humaneval"
    earlier = Infer.main(["--data_path", str(humaneval), "--samples", quick, "--output_dir", str(out)])
    assert earlier["datasets"]["humaneval"]["total"] == 3
    if blocked:
        kept.mkdir()
        (kept / "mine.txt").write_text("the user's")
    before, before_kept = snapshot(out), snapshot(kept)
    command = python_program("Infer.py", "--data_path", humaneval, "--samples", samples,
                             "--output_dir", out, "--exec_timeout", 5)
    started = time.monotonic()
    scorer = []
    quick_scored = lambda pid, output: scorer.append(pid) or max(  # noqa: E731 (tqdm's "n/12")
        [int(n) for n in re.findall(r"(\d+)/12\b", output)] or [0]) >= 4
    done = run_and_signal(command, stop, quick_scored, timeout=120, stderr=True)
    assert done.returncode == code, done.stderr[-3000:]
    assert time.monotonic() - started < 40  # not the 102 s that 12 programs of a 17 s wall clock take on 2 workers
    assert not sandbox_running(scorer[0], "") and snapshot(out) == before and no_temp_files(tmp_path)
    if blocked:
        one_error_line(done.stderr, f"stopped by {stop.name}", "left as it was", "scored rows not kept",
                       "eval.stopped")
        assert snapshot(kept) == before_kept
        return
    one_error_line(done.stderr, f"stopped by {stop.name}", "left as it was", f"kept in {kept}")
    scored = [json.loads(line) for line in (kept / "humaneval_predictions.jsonl").read_text().splitlines()]
    assert 4 <= len(scored) < 12
    assert [(r["task_id"], r["sample"], r["status"]) for r in scored[:4]] == [("HumanEval/0", n, "failed")
                                                                            for n in range(4)]
    assert all(r["status"] == "timed out" for r in scored[4:])
    stopped = json.loads((kept / "stopped.json").read_text())
    assert stopped["stopped_by"] == stop.name and stopped["samples"] == samples
    assert stopped["scored"] == {"humaneval": {"scored": len(scored), "total": 12}}
    assert (kept / "samples.jsonl").read_text() == Path(samples).read_text()
    assert not (kept / "scores.json").exists()


def test_a_stop_while_generated_code_is_scored_keeps_the_generations(tiny_base, tmp_path, monkeypatch, code_sandbox):
    """Infer.py generating for a code set, stopped once its programs run (a stop flag that fires then):
    the generations are not lost: <output_dir>.stopped holds them as a samples file, which --samples
    scores into --output_dir with the run's --max_examples."""
    class StopOnceScoring:
        name, scoring = "SIGINT", False

        def poll(self):
            return self.scoring
    stop, run_many = StopOnceScoring(), sandbox.run_many

    def scoring(*args, **kwargs):
        stop.scoring = True
        return run_many(*args, **kwargs)
    monkeypatch.setattr(sandbox, "run_many", scoring)
    humaneval, out = str(DATA / "code" / "humaneval"), tmp_path / "eval"
    args = Infer.get_args_parser().parse_args(["--llama_path", tiny_base, "--no_adapter", "--data_path", humaneval,
                                               "--max_examples", "3", "--max_gen_len", "6", "--output_dir", str(out)])
    with pytest.raises(Stopped) as stopped:
        Infer.run(args, stop)
    kept = tmp_path / "eval.stopped"
    assert stopped.value.kept == str(kept) and not out.exists()
    samples = [json.loads(line) for line in (kept / "samples.jsonl").read_text().splitlines()]
    assert [s["task_id"] for s in samples] == [f"HumanEval/{i}" for i in range(3)]
    assert all(s["completion"] for s in samples)
    assert json.loads((kept / "stopped.json").read_text())["scored"]["humaneval"]["total"] == 3
    monkeypatch.setattr(sandbox, "run_many", run_many)
    rescored = Infer.main(["--samples", str(kept / "samples.jsonl"), "--data_path", humaneval, "--max_examples", "3",
                           "--output_dir", str(out)])
    assert rescored["datasets"]["humaneval"]["total"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("program, stop, code", [("Math.py", signal.SIGINT, 130), ("Math.py", signal.SIGTERM, 143),
                                                 ("Infer.py", signal.SIGTERM, 143)])
def test_a_stop_signal_ends_a_run_blocked_on_its_input(tiny_base, synthetic_data, tmp_path, program, stop, code):
    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)  # a writer that never comes
    out = tmp_path / "out"
    args = (math_argv(tiny_base, {**synthetic_data, "train": str(fifo)}, out) if program == "Math.py" else
            ["--no_adapter", "--llama_path", tiny_base, "--data_path", str(fifo), "--output_dir", str(out)])
    done = run_and_signal(python_program(program, *args), stop, holds_open(fifo), timeout=120)
    assert done.returncode == code, done.stderr
    one_error_line(done.stderr, f"stopped by {signal.Signals(stop).name}", "nothing was written")
    assert not out.exists()


# Compare.py whose training run is a stand-in that stops as Math.py does: at its next poll, with the signal's status
STAND_IN = """
import sys, time
sys.path.insert(0, sys.argv[1])
import Utils.jittor_env as env
env.block_stop_signals()
stop, start = env.StopFlag(), time.time()
print("signals", "blocked", flush=True)  # the log also holds this source: the marker is the joined output
while not stop.poll() and time.time() < start + 60:
    time.sleep(0.05)
time.sleep(1)  # the step in progress
print("stand-in stopped by", stop.name, flush=True)
raise SystemExit(env.stop_exit_status(stop.name))
"""
COMPARE_WITH_A_STAND_IN = """
import sys
sys.path.insert(0, sys.argv[1])
import Compare
stand_in = [sys.executable, "-c", sys.argv[3], sys.argv[1]]
Compare.commands = lambda args, method, *trained: {"math": stand_in, "infer": ["false"]}
sys.exit(Compare.main(["--methods", "lora", "--output_dir", sys.argv[2]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_compare_passes_a_stop_on_to_its_run_and_waits_for_it(tmp_path, stop, code):
    log = tmp_path / "lora" / "compare.log"
    command = [sys.executable, "-c", COMPARE_WITH_A_STAND_IN, str(REPO), str(tmp_path), STAND_IN]
    done = run_and_signal(command, stop, lambda pid, out: log.exists() and "signals blocked" in log.read_text(),
                          timeout=120)
    name = signal.Signals(stop).name
    assert done.returncode == code, done.stdout + done.stderr
    one_error_line(done.stderr, f"stopped by {name}", f"lora: Math.py stopped with exit {code}", str(log))
    assert f"stand-in stopped by {name}" in log.read_text()  # it got the signal, and Compare.py waited for it
    assert "quick exit" not in done.stdout + done.stderr


# scripts/export_hf.py whose weights file takes 3 s to write: the stop signal comes while the export is unfinished
SLOW_EXPORT = """
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import Utils.jittor_env as env
env.block_stop_signals()  # as `python scripts/export_hf.py` does before anything starts a thread
import export_hf
save = export_hf.save_safetensors
def slow_save(content, path):
    save(content, path)
    print("weights written", flush=True)
    time.sleep(3)
export_hf.save_safetensors = slow_save
export_hf.main(sys.argv[2:])
"""


@pytest.mark.slow
def test_a_stop_signal_during_an_export_leaves_the_folder_as_it_was(tiny_qwen3, tmp_path):
    """The issue's case: SIGTERM mid-export left the new config.json beside the old weights (an adapter of the same
    shape then loads under the other's settings) and a temp file no later export removed. The export is staged
    beside the folder and moved in whole: stopped before, the folder is the earlier export, nothing left over."""
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import base_args, build_model
    for name, alpha in (("first", 4.0), ("second", 16.0)):
        args = base_args(tiny_qwen3, max_seq_len=32, lora_rank=4, lora_alpha=alpha, lora_layers="0-2",
                         p_adapter_layers="0-0")
        save_adapter(build_model(tiny_qwen3, args), str(tmp_path / name))
    out = tmp_path / "export"
    done = subprocess.run(python_program("scripts/export_hf.py", tmp_path / "first", out, "--base", tiny_qwen3),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first = snapshot(out)
    command = [sys.executable, "-c", SLOW_EXPORT, str(REPO), str(tmp_path / "second"), str(out), "--base", tiny_qwen3]
    done = run_and_signal(command, signal.SIGTERM, printed("weights written"), timeout=120)
    assert done.returncode == 143, done.stdout + done.stderr
    one_error_line(done.stderr, "stopped by SIGTERM", "before the export was written", str(out))
    assert snapshot(out) == first and json.loads(first["config.json"])["moa"]["lora_alpha"] == 4.0
    assert [n for n in os.listdir(tmp_path) if n.startswith(file_io.TMP_PREFIX)] == [] and no_temp_files(out)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_then_resume_is_bit_exact(tiny_base, synthetic_data, tmp_path, capsys):
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert train(tiny_base, synthetic_data, straight, "--max_steps", 3, *EVERY_STEP) == 0
    # the real Math.py, SIGKILLed halfway through writing its second checkpoint-latest.pth
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        import Utils.jittor_env
        Utils.jittor_env.block_stop_signals()
        import Models.formats.pth_writer as torch_write
        import Math
        real, saves = torch_write.atomic_write, []
        def dying(path, write):
            if path.endswith("checkpoint-latest.pth"):
                saves.append(path)
                if len(saves) == 2:
                    tmp = os.path.join(os.path.dirname(path), Math.file_io.temp_name(os.path.basename(path)))
                    write(tmp)
                    os.truncate(tmp, os.path.getsize(tmp) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(path, write)
        torch_write.atomic_write = dying
        sys.exit(Math.main(sys.argv[1:]))
        """)
    proc = subprocess.run([sys.executable, "-c", script, *math_argv(tiny_base, synthetic_data, killed, "--max_steps", 3,
                                                                    *EVERY_STEP)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [n for n in os.listdir(killed) if n.startswith(file_io.TMP_PREFIX)]
    assert len(leftovers) == 1 and leftovers[0].endswith("checkpoint-latest.pth")
    assert load_pth(os.path.join(killed, "checkpoint-latest.pth"))["global_step"] == 1  # the last whole one

    # resumed with no flag but the folder: the rest from its args.json; a flag that changes the model is refused
    # in one short line naming it, the folder untouched
    before = sorted(os.listdir(killed))
    assert Math.main(["--resume", "auto", "--output_dir", killed, "--lora_rank", "8"]) == 2
    err = capsys.readouterr().err
    one_error_line(err, "cannot resume", "lora_rank: checkpoint has 4, this run has 8 (--lora_rank)")
    assert len(err) < 300 and sorted(os.listdir(killed)) == before
    assert Math.main(["--resume", "auto", "--output_dir", killed]) == 0
    assert not [n for n in os.listdir(killed) if n.startswith(file_io.TMP_PREFIX)]  # removed at the start
    a = load_pth(os.path.join(straight, "adapter", "adapter.pth"))
    b = load_pth(os.path.join(killed, "adapter", "adapter.pth"))
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    ca, cb = (load_pth(os.path.join(d, "checkpoint-latest.pth")) for d in (straight, killed))
    assert ca["global_step"] == cb["global_step"] == 3
    # its log.txt as the checkpoint left it, then the resumed steps: each step once
    assert [r["step"] for r in log_records(killed, "train")] == [r["step"] for r in log_records(straight, "train")]
    assert all(ca["optimizer"]["m"][k].tobytes() == cb["optimizer"]["m"][k].tobytes() for k in a)
