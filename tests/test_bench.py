"""The bench scripts' plumbing that needs no framework: side_by_side.py's GPU pairs and their refusals, the
authors' side reading their sources from the carried archive where the mirror is absent (a GPU machine), the
peak GPU memory's choice between the process's figure and the device's, every script's bad arguments refused in
one line, no ratios beside the authors' for different work, and scale.py's refusal of a checkpoint its disk
cannot hold."""
import ctypes
import importlib
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, assert_refused, one_error_line, python_program


@pytest.fixture
def bench(monkeypatch):
    """A bench script as a module (they import bench/common.py by name)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    return importlib.import_module


def test_gpu_pair_runs_the_authors_runner_and_ours_at_the_same_depth(bench):
    side_by_side = bench("side_by_side")
    theirs, ours = side_by_side.pair_commands("authors", "python3", "bf16", "8b", "soft", "cuda", 4)
    assert theirs[1].endswith("bench/authors_bench.py")
    assert theirs[2:] == ["--device", "cuda", "--variant", "soft", "--config", "8b", "--precision", "bf16",
                          "--n_layers", "4"]
    assert ours[1].endswith("bench/bench.py")
    assert ours[2:] == ["--config", "8b", "--precision", "bf16", "--n_layers", "4", "--variant", "soft"]
    theirs, ours = side_by_side.pair_commands("authors", "python3", "fp32", "medium", "sparse", "cuda", 4)
    assert "--n_layers" not in theirs + ours  # the depth is the 8b shape's only


@pytest.mark.parametrize("argv, needles", [
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--device", "cuda", "--against", "peft"], ["--against peft", "CPU only"]),
    (["--configs", "8b"], ["--device cuda"]),
    (["--device", "cuda", "--n_layers", "4"], ["--n_layers 4", "8b"]),
    (["--device", "cuda", "--configs", "8b", "--n_layers", "0"], ["--n_layers 0"])])
def test_side_by_side_refuses_a_device_it_cannot_pair(bench, monkeypatch, capsys, argv, needles):
    side_by_side = bench("side_by_side")
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", *argv])
    with pytest.raises(SystemExit) as info:
        side_by_side.parse_options()
    assert info.value.code == 2
    one_error_line(capsys.readouterr().err, *needles)


def test_authors_runner_refuses_bad_arguments_before_torch(bench, monkeypatch, capsys):
    authors_bench = bench("authors_bench")
    for argv, needles in ((["--n_layers", "0"], ["--n_layers 0"]), (["--config", "70b"], ["--config", "70b"])):
        monkeypatch.setattr(sys, "argv", ["authors_bench.py", *argv])
        with pytest.raises(SystemExit) as info:
            authors_bench.parse_options()
        assert info.value.code == 2
        one_error_line(capsys.readouterr().err, *needles)


@pytest.mark.skipif(shutil.which("git") is None, reason="git makes the archive as scripts/carry_authors.sh does")
def test_the_carried_archive_stands_in_for_the_mirror(bench, tmp_path):
    authors_bench = bench("authors_bench")
    source = tmp_path / "repo"
    (source / "LLaMA3_sparse_moa" / "llama").mkdir(parents=True)
    (source / "LLaMA3_sparse_moa" / "llama" / "llama.py").write_text("dim = 8\n")
    (source / "README.md").write_text("not carried\n")
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    archive = tmp_path / "authors.tar.gz"
    subprocess.run(git + ["archive", "--format=tar.gz", "-o", str(archive), "HEAD", "LLaMA3_sparse_moa/llama"],
                   check=True)
    loader = SimpleNamespace()  # moa_ref_loader's two readers of the mirror, replaced
    authors_bench.read_from_archive(loader, str(archive))
    assert loader.git_show("LLaMA3_sparse_moa/llama/llama.py") == "dim = 8\n"
    assert loader.mirror_commit() == commit
    with pytest.raises(FileNotFoundError, match="README.md is not in"):
        loader.git_show("README.md")


def test_gpu_memory_peak_is_the_process_figure_where_the_driver_lists_our_pid(bench):
    """NVML answered by fakes: inside a container the driver may list the host's pids, and then the peak is
    the device's used memory above where it started; where it lists ours, ours (a value of ~0 is NVML's
    'not available')."""
    device = {"used": 1000 << 20, "processes": []}

    def memory_info(handle, memory):
        memory._obj.used = device["used"]
        return 0

    def process_list(handle, count, infos):
        for info, (pid, used) in zip(infos, device["processes"]):
            info.pid, info.usedGpuMemory = pid, used
        count._obj.value = len(device["processes"])
        return 0
    peak = bench("common").GpuMemoryPeak()
    peak.handles, peak.nvml, peak.process_list = [None], SimpleNamespace(nvmlDeviceGetMemoryInfo=memory_info), \
        process_list
    peak.device_base = peak._sample()
    device.update(used=3500 << 20, processes=[(os.getpid() + 1, 2500 << 20)])  # another pid: the host's view
    peak._sample()
    device.update(used=1200 << 20, processes=[])
    assert peak.peak() == (2500.0, "device") and peak.keys() == " peak_gpu_mb=2500 peak_gpu_from=device"
    device["processes"] = [(os.getpid(), 2000 << 20), (os.getpid(), ctypes.c_ulonglong(-1).value)]
    assert peak.peak() == (2000.0, "process")


def test_the_scale_benchs_random_checkpoint_is_removed_or_kept_and_reused(bench, tmp_path, monkeypatch):
    """bench/scale.py's random checkpoint (32B: 65.5 GB, every tensor in bf16) goes into a temporary folder that the
    run removes at its end; with --checkpoint_dir into that folder, kept, and reused by a run of the same --arch and
    --n_layers (another depth writes it again; a folder of other files is refused)."""
    scale = bench("scale")
    assert round(scale.checkpoint_bytes("qwen3-32b", 64) / 1e9, 1) == 65.5
    writes, folders = [], []

    def write(folder, arch, n_layers):
        writes.append((arch, n_layers))
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{}")
    monkeypatch.setattr(scale, "write_random_checkpoint", write)
    monkeypatch.setattr(scale, "measure", lambda opts, work: folders.append(scale.random_checkpoint(opts, work)))
    kept = tmp_path / "kept"
    for flags in ([], ["--checkpoint_dir", kept], ["--checkpoint_dir", kept],
                  ["--checkpoint_dir", kept, "--n_layers", 3]):
        monkeypatch.setattr(sys, "argv", [str(a) for a in ["scale.py", "--arch", "qwen3-32b", "--n_layers", 2,
                                                           "--tmp_dir", tmp_path, *flags]])
        scale.main()
    assert writes == [("qwen3-32b", 2), ("qwen3-32b", 2), ("qwen3-32b", 3)]
    assert not os.path.exists(folders[0]) and folders[1:] == [str(kept)] * 3
    assert sorted(os.listdir(tmp_path)) == ["kept"]  # the temporary folder removed
    assert scale.written_checkpoint(kept) == {"arch": "qwen3-32b", "n_layers": 3}
    os.remove(kept / scale.WRITTEN)
    monkeypatch.setattr(sys, "argv", ["scale.py", "--checkpoint_dir", str(kept)])
    with pytest.raises(SystemExit) as stop:
        scale.main()
    assert stop.value.code == 2


@pytest.mark.slow
def test_bench_scripts_refuse_bad_arguments_in_one_line(tmp_path):
    cases = [(["bench/scale.py", "--n_layers", "0"], ["--n_layers 0"]),
             (["bench/scale.py", "--variants", "sparse,dense"], ["--variants", "dense"]),
             (["bench/scale.py", "--llama_path", str(tmp_path)], ["--llama_path", "neither params.json", "nor config.json"]),
             (["bench/scale.py", "--tmp_dir", str(tmp_path / "none")], ["--tmp_dir"]),
             (["bench/quantization.py", "--bases", str(tmp_path)], ["--bases", "neither params.json"]),
             (["bench/quantization.py", "--problems", "0"], ["--problems 0 must be at least 1"]),
             (["bench/bench.py", "--lora_rank", "0"], ["--lora_rank must be at least 1"]),
             (["bench/bench.py", "--max_threshold", "nan"], ["--max_threshold must be a finite number"]),
             (["bench/bench.py", "--config", "huge"], ["--config", "invalid choice"]),
             (["bench/bench.py", "--preset", "dora"], ["--preset", "invalid choice"]),
             (["bench/bench.py", "--recompute_rounds", "-1"], ["--recompute_rounds -1 must be at least 0"]),
             (["bench/scale.py", "--checkpoint_dir", str(tmp_path), "--llama_path", str(tmp_path)],
              ["--checkpoint_dir", "not with --llama_path"]),
             (["bench/side_by_side.py", "--configs", "huge"], ["--configs"]),
             (["bench/side_by_side.py", "--against", "peft"], ["REFVENV"]),
             (["bench/side_by_side.py", "--against", "peft", "--variants", "soft"], ["--variants", "plain LoRA"]),
             (["bench/peft_bench.py", "--lora_targets", "Q,W"], ["--lora_targets", "Q,W"]),
             (["bench/peft_bench.py", "--lora_rank", "0"], ["--lora_rank must be at least 1"]),
             (["bench/decode_host.py", "--batch", "0"], ["--batch 0 must be at least 1"]),
             (["bench/decode_host.py", "--steps", "500"], ["--steps 500 must be at most"]),
             (["bench/loss_memory.py", "--dim", "0"], ["--dim 0 must be at least 1"]),
             (["bench/decode_in_turn.py", "--precisions", "int8"], ["--precisions int8: at least two"]),
             (["bench/decode_in_turn.py", "--precisions", "nf4", "nf4"], ["--precisions nf4 nf4", "each once"]),
             (["bench/decode_in_turn.py", "--rounds", "0"], ["--rounds 0 must be at least 1"]),
             (["bench/decode_in_turn.py", "--llama_path", str(tmp_path)], ["--llama_path", "neither params.json"])]
    for argv, needles in cases:
        done = subprocess.run(python_program(*argv), cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "REFVENV": ""})
        assert done.returncode == 2, (argv, done.stderr)
        one_error_line(done.stderr, *needles)


def test_side_by_side_gives_no_ratios_for_different_work(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the bench scripts import bench/common.py by name
    from common import describe_optimizer
    from side_by_side import SAME_WORK, same_work
    ours = {"trainable_params": "118784", "base_params": "5048576", "train_tokens": "2048", "loss_tokens": "2040",
            "decode_tokens": "256", "optimizer": describe_optimizer("AdamW", [(118784, 1e-4, (0.9, 0.95), 1e-8, 0.05)]),
            "lora_rank": "8", "lora_alpha": "8", "lora_targets": "Q,K,V,O,FFN_UP,FFN_DOWN"}
    assert set(ours) == set(SAME_WORK)
    assert same_work(dict(ours), ours)[0] == []
    no_decay = describe_optimizer("AdamW", [(118784, 1e-4, (0.9, 0.95), 1e-8, 0.0)])
    differs, line = same_work({**ours, "optimizer": no_decay, "loss_tokens": "2048"}, ours)
    assert differs == ["loss_tokens", "optimizer"]
    assert line.startswith("DIFFERENT WORK") and "loss_tokens=2048|ours:2040" in line


def test_the_scale_bench_refuses_a_random_checkpoint_its_disk_cannot_hold(tmp_path, monkeypatch, capsys):
    """bench/scale.py says the disk its random checkpoint takes before writing a byte of it; where the folder's disk
    has less free (df) it refuses in one line, exit 4, naming the folder, the need and what is free, and leaves no
    folder behind (the 32B shape: 65.5 GB of tensors)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the bench scripts import bench/common.py by name
    import scale
    monkeypatch.setattr(scale.shutil, "disk_usage", lambda path: SimpleNamespace(free=40 * 10**9))
    monkeypatch.setattr(sys, "argv", ["scale.py", "--arch", "qwen3-32b", "--tmp_dir", str(tmp_path)])
    assert_refused(capsys, scale.main, f"{tmp_path}/moa-scale-", "the random qwen3-32b checkpoint needs 65.6 GB of "
                   "disk", "40.0 GB free there", "--checkpoint_dir or --tmp_dir on a larger disk", code=4)
    assert os.listdir(tmp_path) == []
