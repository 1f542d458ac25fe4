"""Math.py + engine_finetune.py on a tiny random base (dim 64, 2 layers): schedule, learning,
resume, early stopping, logs, freezing. Runs Math.main in-process; its refusals and signals are in tests/refusals."""
import json
import os
import struct

import jittor as jt
import numpy as np
import pytest
from conftest import DATA, TINY_FLAGS, log_records, train

import engine_finetune
import Math
from engine_finetune import lr_at
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs
from Models.formats.pth import load_pth
from Models.kernels.adamw import AdamW, adamw_update, build_optimizer
from Utils.loss_curves import train_points


def adapter(path):
    return load_pth(os.path.join(path, "adapter.pth") if os.path.isdir(path) else path)


def max_diff(a, b):
    assert set(a) == set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_lr_schedule():
    assert lr_at(0, 100, 10, 1.0, 0.0) == pytest.approx(0.1)
    assert lr_at(4, 100, 10, 1.0, 0.0) == pytest.approx(0.5)
    assert lr_at(9, 100, 10, 1.0, 0.0) == pytest.approx(1.0)
    assert lr_at(10, 100, 10, 1.0, 0.0) == pytest.approx(1.0)
    assert lr_at(55, 100, 10, 1.0, 0.0) == pytest.approx(0.5)
    assert lr_at(55, 100, 10, 1.0, 0.2) == pytest.approx(0.6)
    assert lr_at(100, 100, 10, 1.0, 0.2) == pytest.approx(0.2)
    assert lr_at(0, 100, 0, 3e-4, 0.0) == pytest.approx(3e-4)
    after = [lr_at(s, 100, 10, 1.0, 0.1) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:])) and after[-1] == pytest.approx(0.1)


def test_weight_decay_groups():
    model = LLaMA_adapter(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=61, multiple_of=16,
                                    lora_layers="0-1", p_adapter_layers="0-1", p_adapter_size=8, swi_x=2))
    decay, no_decay = build_optimizer(model, 1e-3, 0.02).param_groups
    assert decay["weight_decay"] == 0.02 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 and not n.endswith(".bias") for n, p in zip(decay["names"], decay["params"]))
    assert all(p.ndim < 2 for p in no_decay["params"]) and any(n.endswith(".bias") for n in no_decay["names"])
    assert set(decay["names"]) | set(no_decay["names"]) == set(model.adapter_parameters())


def test_adamw_counts_updates_not_backward_calls():
    """Two accumulated backward() calls per update; bias correction must use the update count."""
    start = np.arange(6, dtype=np.float32).reshape(2, 3) / 10
    coef = np.array([[1.0, -2.0, 0.5], [3.0, -0.1, 1.0]], dtype=np.float32)
    p = jt.array(start)
    optimizer = AdamW([{"names": ["p"], "params": [p], "weight_decay": 0.1}], lr=0.01)
    ref, m, v = start.astype(np.float64), 0.0, 0.0
    for t in range(1, 4):
        grad = coef * t  # a gradient that changes from update to update
        for _ in range(2):
            optimizer.backward((p * jt.array(grad / 2)).sum())
        optimizer.step()
        m, v = 0.9 * m + 0.1 * grad, 0.95 * v + 0.05 * grad ** 2
        ref = ref * (1 - 0.01 * 0.1) - 0.01 / (1 - 0.9 ** t) * m / (np.sqrt(v) / np.sqrt(1 - 0.95 ** t) + 1e-8)
    np.testing.assert_allclose(p.numpy(), ref, rtol=0, atol=1e-6)
    assert optimizer.updates == 3


@pytest.mark.parametrize("count", [4, 150])
def test_adamw_one_op_equals_per_parameter_update(count):
    """The one-op step against Jittor's per-parameter update: three updates of tensors of several
    sizes in two groups (weight decay on one), lr changing between updates; 150 parameters take
    three ops (topk's 252 once made one op of 1009 inputs, which Jittor failed to compile)."""
    rng = np.random.default_rng(0)
    shapes, decays = [(3, 5), (7,), (64, 33), (1,)] * (count // 4) + [(2, 2)] * (count % 4), [0.1, 0.0] * (count // 2)
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    results = []
    for update in (adamw_update.fused, adamw_update.plain):
        params = [jt.array(a) for a in start]
        moments = [(jt.zeros(s), jt.zeros(s)) for s in shapes]
        for t, step_grads in enumerate(grads, 1):
            lr = 0.01 / t
            slots = [(p, jt.array(g), m, v, lr, wd, (0.9, 0.95), 1e-8)
                     for p, g, (m, v), wd in zip(params, step_grads, moments, decays)]
            update(slots, t)
        results.append([p.numpy() for p in params] + [x.numpy() for mv in moments for x in mv])
    assert not np.allclose(results[0][2], start[2])
    for fused, plain in zip(*results):  # an ulp apart where the compiler fuses a multiply-add
        np.testing.assert_allclose(fused, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_loss_decreases_on_synthetic(tiny_base, synthetic_data, tmp_path):
    assert train(tiny_base, synthetic_data, tmp_path, "--max_steps", 12, "--batch_size", 8, "--epochs", 2) == 0
    losses = [r["train_loss"] for r in log_records(tmp_path, "train")]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses


@pytest.mark.slow
def test_loss_decreases_on_math14k(tiny_base, tmp_path):
    path = str(DATA / "math" / "math_14k_validation.json")
    argv = ["--llama_path", tiny_base, "--data_path", path, "--val_fraction", "0.1", "--output_dir", str(tmp_path),
            *TINY_FLAGS, "--max_seq_len", "384", "--max_steps", "12", "--batch_size", "8", "--lr", "3e-2"]
    assert Math.main(argv) == 0
    losses = [r["train_loss"] for r in log_records(tmp_path, "train")]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.8, losses


@pytest.mark.slow
def test_resume_equals_straight_run(tiny_base, synthetic_data, tmp_path):
    extra = ["--accum_iter", "2", "--eval_interval", "2", "--early_stop_patience", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(tiny_base, synthetic_data, straight, "--max_steps", 6, *extra) == 0
    assert train(tiny_base, synthetic_data, split, "--max_steps", 3, *extra) == 0
    ckpt = load_pth(split / "checkpoint-latest.pth")
    assert (ckpt["global_step"], ckpt["epoch"], ckpt["data_iter_step"]) == (3, 0, 6)
    assert ckpt["optimizer"]["updates"] == 3 and set(ckpt["optimizer"]["m"]) == set(ckpt["adapter"])
    assert train(tiny_base, synthetic_data, split, "--max_steps", 6, "--resume", "auto", *extra) == 0
    assert max_diff(adapter(straight / "adapter"), adapter(split / "adapter")) <= 1e-6
    a, b = log_records(straight, "train"), log_records(split, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-6 and ra["lr"] == rb["lr"]
    va, vb = log_records(straight, "val"), log_records(split, "val")
    assert [r["step"] for r in va] == [r["step"] for r in vb] == [2, 4, 6]
    assert all(abs(x["val_loss"] - y["val_loss"]) <= 1e-6 for x, y in zip(va, vb))


@pytest.mark.slow
def test_resume_extends_a_finished_run(tiny_base, synthetic_data, tmp_path, capsys):
    """A finished 1-epoch run (3 steps of 16) resumed with --epochs 2 trains 3 steps more, its records continuing;
    from step 4 on the lr follows the 6-step schedule (a cosine with no warm-up: its midpoint at step 4), the
    steps trained keep theirs. Fewer epochs than the checkpoint's are refused; --max_steps caps the epochs, never
    extends them."""
    out, flags = tmp_path / "run", ["--batch_size", "16", "--eval_interval", "3"]
    assert train(tiny_base, synthetic_data, out, "--epochs", 1, *flags) == 0
    first = log_records(out, "train")
    assert [r["step"] for r in first] == [1, 2, 3] and log_records(out, "end")[-1]["stop_reason"] is None
    finished = load_pth(out / "adapter" / "adapter.pth")
    assert train(tiny_base, synthetic_data, out, "--epochs", 2, "--resume", "auto", *flags) == 0
    records = log_records(out, "train")
    assert [r["step"] for r in records] == list(range(1, 7)) and records[:3] == first
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, 3, 0, 1e-2, 0) for s in range(3)]
                                                       + [lr_at(s, 6, 0, 1e-2, 0) for s in range(3, 6)])
    assert records[3]["lr"] == pytest.approx(5e-3)
    assert json.loads((out / "args.json").read_text())["epochs"] == 2
    assert max_diff(finished, load_pth(out / "adapter" / "adapter.pth")) > 1e-4
    assert train(tiny_base, synthetic_data, out, "--epochs", 1, "--resume", "auto", *flags) == 2
    assert "--epochs 1 is below the 2 of" in capsys.readouterr().err
    assert train(tiny_base, synthetic_data, out, "--epochs", 2, "--max_steps", 7, "--resume", "auto", *flags) == 0
    assert [r["step"] for r in log_records(out, "train")] == list(range(1, 7))  # the 2 epochs end at step 6


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tiny_base, synthetic_data, tmp_path):
    """Exact token-weighted reduction: 2 x 4 rows accumulated == one batch of 8 rows. The two sum in
    other orders (oneDNN's AVX-512 kernels block by shape) and AdamW divides by sqrt(v), so after 3
    steps the adapters differ by 1.0e-5 here (1.4e-5 before the fused output gradient), under 3e-5."""
    assert train(tiny_base, synthetic_data, tmp_path / "big", "--max_steps", 3, "--batch_size", 8) == 0
    assert train(tiny_base, synthetic_data, tmp_path / "acc", "--max_steps", 3, "--batch_size", 4,
                 "--accum_iter", 2) == 0
    assert max_diff(adapter(tmp_path / "big" / "adapter"), adapter(tmp_path / "acc" / "adapter")) <= 3e-5


@pytest.mark.slow
def test_early_stopping_keeps_the_best(tiny_base, synthetic_data, tmp_path, monkeypatch):
    scripted = iter([5.0, 4.0, 4.5, 4.6, 4.7, 4.8])
    monkeypatch.setattr(engine_finetune, "evaluate", lambda model, dataset: next(scripted))
    assert train(tiny_base, synthetic_data, tmp_path, "--eval_interval", 1, "--early_stop_patience", 2,
                 "--epochs", 5) == 0
    vals = log_records(tmp_path, "val")
    assert [r["val_loss"] for r in vals] == [5.0, 4.0, 4.5, 4.6]  # stopped after 2 bad rounds
    assert len(log_records(tmp_path, "train")) == 4
    best = load_pth(tmp_path / "checkpoint-best.pth")
    assert best["global_step"] == 2 and best["early_stopper"]["best"] == 4.0
    assert max_diff(best["adapter"], adapter(tmp_path / "adapter-best")) == 0.0
    assert max_diff(adapter(tmp_path / "adapter"), best["adapter"]) > 1e-4  # final != best
    with open(tmp_path / "adapter-best" / "adapter_params.json") as f:
        assert json.load(f)["lora_rank"] == 4
    # resumed, a run that stopped early stays stopped: no step more, the same adapter
    final = adapter(tmp_path / "adapter")
    assert train(tiny_base, synthetic_data, tmp_path, "--eval_interval", 1, "--early_stop_patience", 2,
                 "--epochs", 5, "--resume", "auto") == 0
    assert len(log_records(tmp_path, "train")) == 4 and log_records(tmp_path, "end")[-1]["stop_reason"] == "early_stop"
    assert max_diff(adapter(tmp_path / "adapter"), final) == 0.0


def read_tensorboard_tags(folder):
    """Scalar tags in tensorboard event files (TFRecord framing, Event protos from tensorboardX)."""
    from tensorboardX.proto import event_pb2
    tags = set()
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            blob = f.read()
        pos = 0
        while pos < len(blob):
            (length,) = struct.unpack("<Q", blob[pos:pos + 8])
            event = event_pb2.Event.FromString(blob[pos + 12:pos + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            pos += 12 + length + 4
    return tags


@pytest.mark.slow
def test_throughput_leaves_out_the_steps_that_compile():
    """Compare.py's tokens/s: a step that meets a batch shape for the first time (on any rank) compiles, and is
    left out; here 100 s and 90 s of compiling beside 1 s and 2 s steps."""
    timed = engine_finetune.Throughput()
    for shapes, tokens, seconds in [([(4, 128)], 512, 100.0), ([(4, 128)], 512, 1.0),
                                    ([(4, 192), (4, 128)], 1280, 90.0), ([(4, 192)], 768, 2.0)]:
        timed.add(shapes, tokens, seconds, compiled=timed.new(shapes))
    assert (timed.steps, timed.tokens, timed.tokens_per_s) == (2, 512 + 768, (512 + 768) / 3.0)
    assert engine_finetune.Throughput().tokens_per_s is None


def test_logs_tensorboard_and_run_files(tiny_base, synthetic_data, tmp_path, capsys):
    assert train(tiny_base, synthetic_data, tmp_path, "--max_steps", 3, "--eval_interval", 2, "--log_interval", 2) == 0
    out = capsys.readouterr().out
    # one line of settings, not every one (they are in args.json); the progress counts the 3 steps that ran, of 12
    settings = next(line for line in out.splitlines() if line.startswith("settings: recipe demo, then --"))
    assert "--lora_rank 4" in settings and "--max_steps 3" in settings and '"lora_rank":' not in out
    assert "Epoch: [0]  [0/3]  eta: -" in out and "[2/3]" in out and "/12]" not in out
    with open(tmp_path / "log.txt") as f:
        records = [json.loads(line) for line in f]
    assert {r["event"] for r in records} == {"train", "val", "step_losses", "end"}  # end: the run's totals
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2]
    # every step's loss, step 3's on a line of its own before the last checkpoint: the loss curve draws all three
    assert [(r["step"], len(r["step_losses"])) for r in records if "step_losses" in r] == [(1, 1), (2, 1), (3, 1)]
    assert [x for x, _ in train_points(records)] == [1, 2, 3]
    assert records[0]["step_losses"] == [round(records[0]["train_loss"], 6)]
    end = records[-1]
    assert end["event"] == "end" and end["step"] == 3 and end["train_tokens_per_s"] > 0 and end["timed_steps"] <= 2
    assert end["trainable_params"] == sum(v.size for v in load_pth(tmp_path / "adapter" / "adapter.pth").values())
    assert {"c_train_loss", "val_loss", "lr"} <= read_tensorboard_tags(tmp_path / "tensorboard")
    with open(tmp_path / "args.json") as f:
        saved = json.load(f)
    assert saved["llama_path"] == tiny_base and saved["lr"] == 1e-2 and saved["recipe"] == "demo"
    assert saved["lora_rank"] == 4 and saved["lora_alpha"] == 16.0  # the flag over the recipe
    with open(tmp_path / "adapter" / "adapter_params.json") as f:
        assert json.load(f)["variant"] == "sparse"


@pytest.mark.slow
def test_only_adapters_change(tiny_base, synthetic_data, tmp_path, monkeypatch):
    captured = {}
    prepare = Math.prepare

    def spy(*args):
        result = prepare(*args)
        captured["model"] = model = result[0]
        captured["before"] = {n: p.numpy().copy() for n, p in model.named_parameters()}
        return result
    monkeypatch.setattr(Math, "prepare", spy)
    assert train(tiny_base, synthetic_data, tmp_path, "--max_steps", 2) == 0
    model, before = captured["model"], captured["before"]
    adapters = set(model.adapter_parameters())
    changed = {n for n, p in model.named_parameters() if not np.array_equal(p.numpy(), before[n])}
    assert changed and changed <= adapters
    assert {n for n in adapters if "lora_B" in n or "p_adapter" in n} <= changed
    for name, p in model.base_parameters().items():
        assert p.numpy().tobytes() == before[name].tobytes(), name


@pytest.mark.slow
def test_init_adapter(tiny_base, synthetic_data, tmp_path, capsys):
    assert train(tiny_base, synthetic_data, tmp_path / "a", "--max_steps", 2) == 0
    # lr 1e-30 leaves every weight where it started: the init adapter itself
    assert train(tiny_base, synthetic_data, tmp_path / "b", "--max_steps", 1, "--lr", "1e-30",
                 "--init_adapter", tmp_path / "a" / "adapter") == 0
    assert max_diff(adapter(tmp_path / "a" / "adapter"), adapter(tmp_path / "b" / "adapter")) == 0.0
    assert train(tiny_base, synthetic_data, tmp_path / "c", "--max_steps", 1, "--lora_rank", 8,
                 "--init_adapter", tmp_path / "a" / "adapter") == 2
    err = capsys.readouterr().err
    assert "lora_rank: adapter has 4, model has 8" in err and "Traceback" not in err
