"""Utils/misc.py: distributed setup, print gating, atomic saves, meters, early stopping."""
import math
import os
import pickle
from types import SimpleNamespace

import pytest

from Utils import misc
from Utils.misc import EarlyStopper, MetricLogger, SmoothedValue, save_on_master

def test_init_distributed_single_process():
    args = SimpleNamespace(device="cpu")
    misc.init_distributed_mode(args)
    assert (args.rank, args.world_size, args.distributed, args.gpu) == (0, 1, False, 0)
    assert misc.get_rank() == 0 and misc.get_world_size() == 1 and misc.is_main_process()


def test_init_distributed_records_the_device_used():
    """Math.py's --device defaults to cuda; args.json records the device the run used: cpu without a GPU."""
    import jittor as jt
    args = SimpleNamespace(device="cuda")
    try:
        misc.init_distributed_mode(args)
        assert args.device == ("cuda" if jt.has_cuda else "cpu")
    finally:
        jt.flags.use_cuda = 0
    args = SimpleNamespace(device="cpu")
    misc.init_distributed_mode(args)
    assert args.device == "cpu" and not jt.flags.use_cuda


def test_print_gating(capsys):
    misc.setup_for_distributed(False)
    misc.print_main("hidden")
    print("shown")  # print itself is never patched
    misc.setup_for_distributed(True)
    misc.print_main("master")
    assert capsys.readouterr().out == "shown\nmaster\n"


def test_save_on_master_atomic(tmp_path):
    path = tmp_path / "sub" / "state.pkl"
    assert save_on_master({"a": 1}, path) == path
    assert pickle.loads(path.read_bytes()) == {"a": 1}
    save_on_master(lambda p: open(p, "w").write("text"), tmp_path / "x.txt")
    assert (tmp_path / "x.txt").read_text() == "text"

    def failing_writer(p):
        open(p, "w").write("partial")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        save_on_master(failing_writer, path)
    assert pickle.loads(path.read_bytes()) == {"a": 1}  # old file intact
    assert sorted(os.listdir(path.parent)) == ["state.pkl"]  # no temp file left


def test_save_on_master_temp_keeps_extension(tmp_path):
    seen = []
    save_on_master(lambda p: (seen.append(p), open(p, "w").close()), tmp_path / "ckpt.pth")
    assert seen[0].endswith(".pth") and seen[0] != str(tmp_path / "ckpt.pth")


def test_smoothed_value_stats():
    meter = SmoothedValue(window_size=3)
    assert math.isnan(meter.median) and math.isnan(meter.global_avg)
    for v in [1.0, 2.0, 3.0, 10.0]:
        meter.update(v)
    meter.update(4.0, n=2)
    assert meter.value == 4.0 and meter.max == 10.0
    assert meter.median == 4.0 and meter.avg == pytest.approx(17 / 3)
    assert meter.count == 6 and meter.global_avg == pytest.approx(24 / 6)
    meter.synchronize_between_processes()  # one process: unchanged
    assert meter.count == 6 and meter.total == pytest.approx(24.0)
    assert str(meter) == "4.0000 (4.0000)"


def test_metric_logger(capsys):
    import jittor as jt
    logger = MetricLogger()
    logger.update(loss=2.0, lr=None)
    logger.update(loss=jt.array(4.0))
    assert logger.loss.global_avg == pytest.approx(3.0) and "lr" not in logger.meters
    with pytest.raises(AttributeError):
        logger.nope
    items = list(logger.log_every(range(5), print_freq=2, header="Epoch: [0]"))
    assert items == list(range(5))
    out = capsys.readouterr().out
    assert "Epoch: [0]  [0/5]  eta:" in out and "[4/5]" in out and "loss: 3.0000" in out
    assert "Total time" in out and "[1/5]" not in out
    logger.synchronize_between_processes()
    assert logger.loss.count == 2


def test_progress_eta_leaves_out_the_first_item(capsys, monkeypatch):
    """The ETA counts the items left at the mean time of the items after the first, whose compiling (100 s here,
    2 s each after) would inflate it; at the first item it says nothing."""
    now = [0.0]
    monkeypatch.setattr(misc, "time", SimpleNamespace(time=lambda: now[0]))
    for i in MetricLogger().log_every(range(5), print_freq=1, header="Epoch: [0]"):
        now[0] += 100.0 if i == 0 else 2.0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("eta: ")[1].split()[0] for line in lines[:5]] == ["-", "0:00:06", "0:00:04", "0:00:02",
                                                                          "0:00:00"]


def test_early_stopper_patience_and_min_delta():
    stopper = EarlyStopper(patience=2, min_delta=0.1)
    assert stopper.step(1.0) == (True, False)
    assert stopper.step(0.95) == (False, False)  # better, but not by min_delta
    assert stopper.step(0.8) == (True, False)
    assert stopper.step(0.75) == (False, False)
    assert stopper.step(float("nan")) == (False, True)
    never = EarlyStopper(patience=None)
    assert all(never.step(5.0) == (i == 0, False) for i in range(10))


def test_early_stopper_state_round_trip():
    stopper = EarlyStopper(patience=3)
    for loss in [1.0, 0.5, 0.6]:
        stopper.step(loss)
    restored = EarlyStopper(patience=3)
    restored.load_state_dict(pickle.loads(pickle.dumps(stopper.state_dict())))
    assert (restored.best, restored.bad_rounds) == (0.5, 1)
    assert restored.step(0.7) == stopper.step(0.7) == (False, False)
    assert restored.step(0.7) == stopper.step(0.7) == (False, True)
