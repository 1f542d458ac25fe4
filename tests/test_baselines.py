"""Every baseline method through the whole pipeline on the tiny base: Math.py training (the
load-balancing loss logged), resume, Infer.py scoring with --save_weights (each method's own router
outputs), Compare.py's table (the authors' files of each method: tests/test_golden.py; settings refused:
tests/refusals)."""
import json
import os
import pickle

import numpy as np
import pytest
from conftest import LORA_ONLY_IDLE, NO_TYPE_ROUTER_IDLE, log_records, tiny_flags, train, write_synthetic_splits

import Infer
from Models.formats.adapters import read_adapter_config
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs
from Models.formats.pth import load_pth

LORA_ONLY = ["--lora_layers", "all", "--lora_targets", "Q,V,FFN_DOWN", "--prompt_layers", "0-0",
             "--p_adapter_layers", "0-0"]
ALL_FAMILIES = ["--lora_layers", "all", "--lora_targets", "Q,V,FFN_DOWN", "--prompt_layers", "all",
                "--prompt_len", "2", "--p_adapter_layers", "all"]
METHODS = {  # name: Math.py flags
    "lora": ["--method", "moe", *LORA_ONLY],
    "molora": ["--method", "moe", "--expert_num", "2", *LORA_ONLY],
    "hydralora": ["--method", "moe", "--expert_num", "3", "--hydra_moe", *LORA_ONLY],
    "topk": ["--method", "topk", "--expert_num", "4", "--top_k", "2", "--lb_loss_coeff", "0.01", *LORA_ONLY],
    "adamole": ["--method", "adamole", "--expert_num", "4", "--lb_loss_coeff", "0.01", *LORA_ONLY],
    "instance": ["--method", "instance", *ALL_FAMILIES],
    "unipeft": ["--method", "unipeft", *ALL_FAMILIES],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("baseline_data")
    paths = write_synthetic_splits(folder, 24, 4, seed=3)
    with open(paths["val"]) as f:
        test = json.load(f)
    paths["test"] = str(folder / "test.json")
    with open(paths["test"], "w") as f:
        json.dump(test, f)
    return paths


def train_method(base, data, out, method, *extra):
    """Math.main on the tiny flags with `method`'s flags; its exit code."""
    idle = {"instance": (), "unipeft": NO_TYPE_ROUTER_IDLE}.get(method, LORA_ONLY_IDLE)
    return train(base, data, out, "--max_seq_len", 192, *METHODS[method], *extra, leave_out=idle)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_method_trains_and_is_scored_with_its_router_outputs(method, tiny_base, data, tmp_path):
    assert train_method(tiny_base, data, tmp_path / "run", method, "--max_steps", 3) == 0
    records = log_records(tmp_path / "run", "train")
    assert len(records) == 3 and all(np.isfinite(r["train_loss"]) for r in records)
    if method in ("topk", "adamole"):  # the load-balancing term: at least 1 per module (3 targets x 2 layers)
        assert all(r["aux_loss"] >= 6 * 0.5 for r in records), records
    else:
        assert all("aux_loss" not in r for r in records)
    summary = Infer.main(["--adapter_path", str(tmp_path / "run" / "adapter"), "--data_path", data["test"],
                          "--output_dir", str(tmp_path / "eval"), "--max_gen_len", "4", "--batch_size", "2",
                          "--save_weights"])
    assert [s["total"] for s in summary["datasets"].values()] == [4]
    with open(tmp_path / "eval" / "type_weight.pkl", "rb") as f:
        types = pickle.load(f)
    assert types["method"] == METHODS[method][1]
    experts_file = tmp_path / "eval" / "expert_weight.pkl"
    if method in ("molora", "hydralora", "topk", "adamole"):
        with open(experts_file, "rb") as f:
            experts = pickle.load(f)
        assert experts["layer_types"] == [["Q", "V", "FFN_DOWN"]] * 2
        assert os.path.getsize(tmp_path / "eval" / "expert_weight.png") > 0
        for ex in experts["examples"]:
            for layer in ex["weights"]:
                for family, w in layer.items():
                    n_experts = {"molora": 2, "hydralora": 3}.get(method, 4)
                    assert w.shape == (len(ex["token_ids"]), n_experts), family
                    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
                    if method == "topk":
                        assert np.all((w > 0).sum(1) == 2)
    else:
        assert not experts_file.exists()
    if method in ("instance", "unipeft"):  # one decision per sequence, on every token alike
        columns = {"instance": ["Q", "V", "PROMPT", "FFN_DOWN", "PADAPTER"], "unipeft": ["LORA", "PROMPT", "PADAPTER"]}
        assert types["layer_types"] == [columns[method]] * 2
        for ex in types["examples"]:
            for w in ex["weights"]:
                assert np.all(w == w[:1]) and np.all((w > 0) & (w < 1))
                if method == "unipeft":
                    assert np.array_equal(w[:, 1], w[:, 2])  # the adapter reads the prompt's gate
        assert os.path.getsize(tmp_path / "eval" / "type_weight.png") > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["topk", "unipeft"])
def test_resume_equals_straight_run(method, tiny_base, data, tmp_path):
    extra = ["--eval_interval", "2"]
    assert train_method(tiny_base, data, tmp_path / "straight", method, "--max_steps", 4, *extra) == 0
    assert train_method(tiny_base, data, tmp_path / "split", method, "--max_steps", 2, *extra) == 0
    assert train_method(tiny_base, data, tmp_path / "split", method, "--max_steps", 4, "--resume", "auto", *extra) == 0
    a, b = (load_pth(tmp_path / run / "adapter" / "adapter.pth") for run in ("straight", "split"))
    assert set(a) == set(b) and max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    for ra, rb in zip(log_records(tmp_path / "straight", "train"), log_records(tmp_path / "split", "train")):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-6
        assert abs(ra.get("aux_loss", 0) - rb.get("aux_loss", 0)) <= 1e-6
    if method == "unipeft":  # trained for 4 steps, yet the gate the authors never read is where it started
        c = load_pth(tmp_path / "split" / "checkpoint-latest.pth")["adapter"]
        gates = [k for k in a if "p_adapter_gate" in k]
        assert gates and all(np.array_equal(a[k], c[k]) for k in gates)
        assert train_method(tiny_base, data, tmp_path / "one", method, "--max_steps", 1) == 0
        start = load_pth(tmp_path / "one" / "adapter" / "adapter.pth")
        assert all(np.array_equal(a[k], start[k]) for k in gates)
        assert not all(np.array_equal(a[k], start[k]) for k in a if "lora_gate" in k)


@pytest.mark.slow
def test_compare_command_table_and_rerun(tiny_base, data, tmp_path, capsys):
    import Compare
    argv = ["--methods", "lora", "topk", "--ranks", "1", "--max_steps", "3", "--max_examples", "3",
            "--llama_path", tiny_base, "--data_path", data["train"], "--test_data", data["test"],
            "--output_dir", str(tmp_path), "--", *tiny_flags(LORA_ONLY_IDLE), "--val_data_path", data["val"],
            "--batch_size", "4", "--max_seq_len", "192"]  # no parallel adapter nor type router in either method
    assert Compare.main(argv) == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert list(rows) == ["lora", "topk", "base"]
    counts = {m: LLaMA_adapter(ModelArgs.from_params_json(tiny_base, **{
        k: v for k, v in read_adapter_config(str(tmp_path / m / "adapter")).items()})).parameter_counts()["total"]
        for m in ("lora", "topk")}
    for method in ("lora", "topk"):
        assert rows[method]["steps"] == 3 and rows[method]["train_tokens_per_s"] > 0
        assert rows[method]["trainable_params"] == counts[method]
        assert set(rows[method]["accuracy"]) == set(rows["base"]["accuracy"]) and len(rows["base"]["accuracy"]) == 1
    assert counts["topk"] > 4 * counts["lora"]  # 8 experts and their routers
    table = (tmp_path / "compare.md").read_text()
    assert table.splitlines()[0].startswith("| method | trainable params |") and "| topk | " in table
    assert table in capsys.readouterr().out + "\n"
    logs = {m: (tmp_path / m / "compare.log").read_text() for m in ("lora", "topk")}
    assert Compare.main(argv) == 0  # the same command again: every row reused, nothing rerun
    assert "reused" in capsys.readouterr().out
    assert all((tmp_path / m / "compare.log").read_text() == logs[m] for m in logs)
    # evaluated again with another budget: the finished trainings resume with no step, their tokens/s kept
    assert Compare.main([*argv[:argv.index("--max_examples") + 1], "2", *argv[argv.index("--max_examples") + 2:]]) == 0
    rows = {row["method"]: row for row in json.loads((tmp_path / "compare.json").read_text())["rows"]}
    assert all(rows[m]["steps"] == 3 and rows[m]["train_tokens_per_s"] > 0 for m in ("lora", "topk"))


# Compare.py's runs as stand-ins: lora's training fails as Math.py does (an error line, exit 2) after an earlier
# failure's line in the same log; topk trains 30 steps of a 40-step budget (its recipe's epochs ended) and scores
STAND_IN_TRAIN = """
import json, os, sys
run, steps = sys.argv[1], int(sys.argv[2])
if steps < 0:
    print("loading the base", flush=True)
    print("error: --data_path x.json: no such file", file=sys.stderr)
    sys.exit(2)
with open(os.path.join(run, "log.txt"), "a") as f:
    f.write(json.dumps({"event": "end", "step": steps, "trainable_params": 1234, "train_tokens_per_s": 99.0}) + "\\n")
"""
STAND_IN_SCORE = """
import json, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], "scores.json"), "w") as f:
    json.dump({"datasets": {"AddSub": {"accuracy": float(sys.argv[2])}}, "average": float(sys.argv[2])}, f)
"""


def test_compare_marks_a_failed_method_and_runs_the_others(tmp_path, capsys, monkeypatch):
    import sys
    import Compare

    def commands(args, method, trained=None):
        run = str(tmp_path / method)
        score = [sys.executable, "-c", STAND_IN_SCORE, os.path.join(run, "eval")]
        if method == "base":
            assert trained == "topk"  # the base row reads a run that trained
            return {"infer": score + ["0.25"]}
        return {"math": [sys.executable, "-c", STAND_IN_TRAIN, run, "-1" if method == "lora" else "30"],
                "infer": score + ["0.5"]}
    monkeypatch.setattr(Compare, "commands", commands)
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "compare.log").write_text("error: an earlier run's line\n")
    argv = ["--methods", "lora", "topk", "--ranks", "1", "--max_steps", "40", "--output_dir", str(tmp_path)]
    assert Compare.main(argv) == 5
    rows = {row["method"]: row for row in json.loads((tmp_path / "compare.json").read_text())["rows"]}
    assert rows["lora"] == {"method": "lora", "failed": "error: --data_path x.json: no such file"}
    assert rows["topk"]["steps"] == 30 and rows["topk"]["average"] == 0.5 and rows["base"]["average"] == 0.25
    table = (tmp_path / "compare.md").read_text()
    assert "| lora | - | failed | failed: error: --data_path x.json: no such file | - |" in table
    assert "| topk | 1,234 | 50.0 | 50.0 | 99 |" in table
    assert "steps trained (from each run's log.txt): topk 30 (budget: --max_steps 40" in table
    assert "failed: lora" in table and "40 steps per method" not in table
    err = capsys.readouterr().err
    assert "error: lora: Math.py failed (exit 2" in err and "an earlier run's line" not in err
