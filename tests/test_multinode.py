"""Training across machines, on hosts emulated here (scripts/emulated_hosts.py): each host a network namespace with
its own host name, address and disk at one path, OpenMPI's daemons started by a launch agent where ssh would log
in, the ranks talking TCP over a bridge. The run's --output_dir lies on each host's own disk: no disk is shared but
the clone, the venv, the base and the data (docs/multinode.md)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import MPIRUN, REPO, log_records, math_argv, write_synthetic_splits

import Math
from Models.formats.pth import load_pth
from scripts import emulated_hosts

WHY_NOT = "mpirun not found (install OpenMPI)" if MPIRUN is None else emulated_hosts.usable()
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)]
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_base):
    return {"base": tiny_base, **write_synthetic_splits(tmp_path_factory.mktemp("multinode"), 48, 10, seed=3)}


@pytest.fixture(scope="module")
def one_rank(setup, tmp_path_factory):
    """one_rank(batch): the adapter (and the run folder's names) that one rank trains in STEPS steps."""
    runs = {}

    def trained(batch: int) -> dict:
        if batch not in runs:
            out = tmp_path_factory.mktemp("one") / "run"
            assert Math.main(argv(setup, out, "--max_steps", STEPS, "--batch_size", batch)) == 0
            runs[batch] = {"adapter": load_pth(out / "adapter" / "adapter.pth"), "names": sorted(os.listdir(out)),
                           "losses": [r["train_loss"] for r in log_records(out, "train")]}
        return runs[batch]
    return trained


def argv(setup, out, *extra) -> list:
    return math_argv(setup["base"], setup, out, "--eval_interval", 2, *extra)


def hosts_command(names, per_host, args) -> list:
    """mpirun over `names`, `per_host` ranks each (shared memory within a host, TCP between hosts)."""
    return [MPIRUN, "-H", ",".join(f"{n}:{per_host}" for n in names), "-np", str(len(names) * per_host),
            "--mca", "btl", "tcp,vader,self", sys.executable, str(REPO / "Math.py"), *map(str, args)]


def on_hosts(hosts, per_host, args, timeout=300) -> subprocess.CompletedProcess:
    process = hosts.popen(hosts.names[0], hosts_command(hosts.names, per_host, args), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def relative_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a) / max(float(np.abs(a[k]).max()) for k in a)


@pytest.mark.parametrize("n_hosts, per_host, batch", [(2, 1, 4), (2, 2, 4), (3, 1, 6)])
def test_hosts_train_the_adapter_one_rank_trains(setup, one_rank, tmp_path, n_hosts, per_host, batch):
    """Rank 0 writes the run on its host's disk, and nothing lands on the others'."""
    disk = tmp_path / "disk"
    names = [f"node{i + 1}" for i in range(n_hosts)]
    one_rank = one_rank(batch)
    with emulated_hosts.Hosts(names, disk=str(disk)) as hosts:
        done = on_hosts(hosts, per_host, argv(setup, disk / "run", "--max_steps", STEPS, "--batch_size", batch))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"rank 1 of {n_hosts * per_host}" in done.stdout
    run = tmp_path / "disk.node1" / "run"
    adapter = load_pth(run / "adapter" / "adapter.pth")
    assert relative_difference(one_rank["adapter"], adapter) <= 1e-4
    assert max(float(np.abs(adapter[k]).max()) for k in adapter if "lora_B" in k) > 1e-3  # it did train
    losses = [r["train_loss"] for r in log_records(run, "train")]
    assert len(losses) == STEPS and np.allclose(losses, one_rank["losses"], rtol=1e-4, atol=0)
    assert sorted(os.listdir(run)) == one_rank["names"]  # one run's files, as one rank writes them
    assert [os.listdir(tmp_path / f"disk.{n}") for n in names[1:]] == [[]] * (n_hosts - 1)


def test_resume_reads_rank0s_disk_only(setup, tmp_path):
    """Stopped after 2 steps and resumed with --resume auto on every host, where only rank 0's disk holds the
    checkpoint (and args.json): the same adapter, bit for bit, as a straight run of the same hosts."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with emulated_hosts.Hosts(["node1", "node2"], disk=str(straight)) as hosts:
        done = on_hosts(hosts, 1, argv(setup, straight, "--max_steps", STEPS))
        assert done.returncode == 0, done.stderr[-3000:]
    with emulated_hosts.Hosts(["node1", "node2"], disk=str(resumed)) as hosts:
        first = on_hosts(hosts, 1, argv(setup, resumed, "--max_steps", 2))
        assert first.returncode == 0, first.stderr[-3000:]
        second = on_hosts(hosts, 1, ["--resume", "auto", "--output_dir", resumed, "--max_steps", STEPS])
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 2" in second.stdout
    a = load_pth(tmp_path / "straight.node1" / "adapter" / "adapter.pth")
    b = load_pth(tmp_path / "resumed.node1" / "adapter" / "adapter.pth")
    assert relative_difference(a, b) == 0.0
    assert [r["step"] for r in log_records(tmp_path / "resumed.node1", "train")] == [1, 2, 3, 4]
    assert os.listdir(tmp_path / "resumed.node2") == []


@pytest.mark.parametrize("stop, code", [(signal.SIGTERM, 1), (signal.SIGUSR1, 138)])
def test_a_stop_to_mpirun_stops_every_rank_on_every_host(setup, tmp_path, stop, code):
    """mpirun's SIGTERM (as Ctrl-C: OpenMPI sends its ranks SIGTERM, then SIGKILL) or SIGUSR1 (forwarded as it
    is: each rank stops at its next step boundary) ends the ranks on both hosts; the checkpoint on rank 0's disk
    is whole: the run resumes from it."""
    disk = tmp_path / "disk"
    run = tmp_path / "disk.node1" / "run"
    with emulated_hosts.Hosts(["node1", "node2"], disk=str(disk)) as hosts:
        process = hosts.popen("node1", hosts_command(hosts.names, 1, argv(setup, disk / "run", "--epochs", 50,
                                                                          "--eval_interval", 1)),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None and not (
                (run / "log.txt").exists() and len(log_records(run, "train")) >= 2):
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[0][-3000:]
        process.send_signal(stop)
        output = process.communicate(timeout=120)[0]
        assert process.returncode == code, output[-3000:]
        assert [hosts.pids(name) for name in hosts.names] == [[], []]  # no rank left on either host
        step = load_pth(run / "checkpoint-latest.pth")["global_step"]
        assert step >= 1
        if stop == signal.SIGUSR1:  # every rank stopped at the same step boundary, rank 0 saved it
            assert "stopped by SIGUSR1" in output and step == log_records(run, "train")[-1]["step"]
            assert not [n for n in os.listdir(run) if n.startswith(".tmp")]
            return
        # a SIGKILL mid-write leaves a temp file beside the checkpoint it was to replace; the resumed run removes it
        resumed = on_hosts(hosts, 1, ["--resume", "auto", "--output_dir", disk / "run", "--max_steps", step + 1])
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in log_records(run, "train")][-2:] == [step, step + 1]
    assert not [n for n in os.listdir(run) if n.startswith(".tmp")]


def test_a_cold_host_says_why_the_job_waits(setup, tmp_path):
    """A host that has never prepared Jittor (a home of its own, empty) compiles it at its ranks' first import,
    minutes with Jittor's log silenced: its first rank says so, once for the host, and the job goes on (stopped
    here once it said so; two ranks of one cold host preparing together took 5 min 54 s, docs/multinode.md)."""
    disk, log = tmp_path / "disk", tmp_path / "stderr"
    with emulated_hosts.Hosts(["node1", "node2"], disk=str(disk), cold=["node2"]) as hosts, open(log, "w") as err:
        process = hosts.popen("node1", hosts_command(hosts.names, 2, argv(setup, disk / "run", "--max_steps", 1)),
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        said = "[moa] host node2: Jittor is not prepared here"
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None and said not in log.read_text():
            time.sleep(0.2)
        time.sleep(2)  # the host's second rank would have said it by now
        still_running = process.poll() is None
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        assert [hosts.pids(name) for name in hosts.names] == [[], []]
    text = log.read_text()
    assert still_running and text.count(said) == 1 and "bash setup.sh" in text, text[-3000:]
    assert "node1: Jittor is not prepared" not in text
