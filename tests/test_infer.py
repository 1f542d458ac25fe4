"""Infer.py end to end, the weight pickles and the plots (generation through the KV cache: tests/test_kv_cache.py;
Infer.py's refusals: tests/refusals).

A tiny random base (conftest's tiny_base) with random adapter weights, so that the
experts and the router really change the outputs.
"""
import json
import os
import pickle
import shutil

import numpy as np
import pytest

from browser import CHROMIUM, page_dom
from conftest import DATA, MPIRUN, assert_refused, mpirun
from tiny_models import MOA, randomize_adapters
from matplotlib import image as mpimg

import Infer
from Data.prompts import format_prompt
from Models.Tokenizer import Tokenizer
from Data.synthetic import make_splits
from Models.ModelArgs import ModelArgs
from Models.formats.adapters import export_authors_adapter, read_adapter, save_adapter
from Models.formats.base_model import build_model
from Models.formats.pth_writer import save_pth
from Utils import plots
from Utils.weight_pickles import load_pickle


@pytest.fixture(scope="module")
def base_dir(tiny_base):
    return tiny_base


@pytest.fixture(scope="module")
def tok(base_dir):
    return Tokenizer(os.path.join(base_dir, "tokenizer.model"))


# ---- Infer.py -------------------------------------------------------------------------

def write_json(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def example(question, answer):
    return {"instruction": question, "input": "", "output": f"\nA: The answer is {answer}.", "answer": answer}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, base_dir):
    """A training run as Math.py leaves it: adapter/, args.json, log.txt."""
    run = str(tmp_path_factory.mktemp("output") / "run1")
    # max_seq_len bounds the generation budget (the authors' rule): room for the ~150-token prompts
    args = ModelArgs.from_params_json(base_dir, max_seq_len=256, max_batch_size=4, **MOA["sparse"])
    model = build_model(base_dir, args)
    randomize_adapters(model, seed=7, scale=0.1)
    save_adapter(model, os.path.join(run, "adapter"))
    write_json(os.path.join(run, "args.json"), {"llama_path": base_dir})
    write_json(os.path.join(run, "data", "test.json"), make_splits(20, 0, 12, seed=5)[2])
    with open(os.path.join(run, "log.txt"), "w") as f:
        for step in range(8):
            row = {"step": step, "c_train_loss": 3.0 - 0.2 * step, "lr": 1e-3}
            if step % 3 == 0:
                row["val_loss"] = 3.2 - 0.2 * step
            f.write(json.dumps(row) + "\n")
    return run


CRAFTED = {  # dataset: [(question, answer, generation)]
    "AddSub": [("Ann had 1 pen and got 2 more. How many pens?", "3", "1 + 2 = 3. The answer is 3."),
               ("Bo had 9 cups and broke 3. How many cups?", "6", "9 - 3 = 5."),
               ("Cy had 2 hats and got 5 more. How many hats?", "7", "The answer is 7.0"),
               ("Di had 8 cats, 1,000 dogs. How many pets?", "1008", "The answer is 1,008.")],
    "AQuA": [("Pick the even number. Options: A)3 B)4 C)5", "B", "B) 4 is even."),
             ("Pick the odd number. Options: A)2 B)4 C)5", "C", "Answer: A")],
}


@pytest.fixture(scope="module")
def crafted_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    return [os.path.dirname(write_json(str(root / name / "test.json"), [example(q, a) for q, a, _ in rows]))
            for name, rows in CRAFTED.items()]


def fake_generate(tok):
    answers = {q: g for rows in CRAFTED.values() for q, _, g in rows}

    def fake(model, tokenizer, prompt_lists, max_gen_len, *args, **kwargs):
        texts = [tokenizer.decode(p) for p in prompt_lists]
        return [tokenizer.encode(next(g for q, g in answers.items() if q in t), bos=False, eos=False)
                for t in texts]
    return fake


def test_infer_scores_per_dataset_and_average(monkeypatch, tok, run_dir, crafted_dirs, tmp_path):
    monkeypatch.setattr(Infer, "generate", fake_generate(tok))
    out = str(tmp_path / "eval")
    argv = ["--adapter_path", os.path.join(run_dir, "adapter"), "--data_path", *crafted_dirs, "--output_dir", out,
            "--batch_size", "4", "--max_gen_len", "8"]
    for _ in range(2):  # the second run overwrites the predictions, never appends
        Infer.main(argv)
    with open(os.path.join(out, "scores.json")) as f:
        scores = json.load(f)
    assert scores["datasets"]["AddSub"]["accuracy"] == pytest.approx(0.75)
    assert scores["datasets"]["AQuA"]["accuracy"] == pytest.approx(0.5)
    assert scores["datasets"]["AQuA"]["rule"] == "AQuA"
    assert scores["average"] == pytest.approx(0.625)
    assert scores["budget_seq_len"] == 256  # the adapter's max_seq_len, as the authors' inference reads it
    for name, rows in CRAFTED.items():
        with open(os.path.join(out, f"{name}_predictions.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        assert [r["generation"] for r in lines] == [g for _, _, g in rows]  # input order
        assert [r["index"] for r in lines] == list(range(len(rows)))


def test_scores_record_the_precision_and_a_warning_where_training_differs(monkeypatch, tok, run_dir, crafted_dirs,
                                                                          tmp_path, capsys):
    """scores.json records the precision the model ran in and the one the adapter trained in; --precision
    other than training's is one warning line, printed before generating and recorded."""
    monkeypatch.setattr(Infer, "generate", fake_generate(tok))
    adapter = os.path.join(run_dir, "adapter")
    argv = ["--adapter_path", adapter, "--data_path", crafted_dirs[0], "--output_dir", str(tmp_path / "eval")]
    Infer.main(argv)
    assert "warning:" not in capsys.readouterr().err
    with open(tmp_path / "eval" / "scores.json") as f:
        scores = json.load(f)
    assert (scores["precision"], scores["kv_cache"], scores["adapter_precision"], scores["warnings"]) == \
        ("fp32", "base", "fp32", [])
    summary = Infer.main(argv + ["--precision", "bf16"])
    line = f"evaluated in bf16, the adapter trained in fp32 ({adapter}/adapter_params.json)"
    assert [w for w in capsys.readouterr().err.splitlines() if w.startswith("warning:")] == \
        [f"warning: {summary['warnings'][0]}"] and summary["warnings"][0].startswith(line)
    with open(tmp_path / "eval" / "scores.json") as f:
        assert json.load(f)["precision"] == "bf16" and summary["adapter_precision"] == "fp32"


def test_infer_authors_adapter_reads_their_params(monkeypatch, tok, run_dir, base_dir, crafted_dirs, tmp_path, capsys):
    monkeypatch.setattr(Infer, "generate", fake_generate(tok))
    authors = str(tmp_path / "authors" / "adapter.pth")
    export_authors_adapter(os.path.join(run_dir, "adapter"), authors)  # + their adapter_params.json
    common = ["--adapter_path", authors, "--llama_path", base_dir, "--data_path", crafted_dirs[0],
              "--output_dir", str(tmp_path / "eval")]
    summary = Infer.main(common)
    assert summary["datasets"]["AddSub"]["accuracy"] == pytest.approx(0.75)  # no MoA flag needed
    assert (summary["precision"], summary["adapter_precision"], summary["warnings"]) == ("fp32", None, [])
    os.remove(os.path.join(os.path.dirname(authors), "adapter_params.json"))
    assert_refused(capsys, lambda: Infer.main(common), "needs the MoA flags")  # it also names the unexpected tensors
    flags = ["--variant", "sparse", "--lora_layers", "0-2", "--p_adapter_layers", "0-2",
             "--lora_targets", "Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN"]
    assert Infer.main(common + flags)["datasets"]["AddSub"]["accuracy"] == pytest.approx(0.75)


def test_a_run_folder_or_its_checkpoint_is_not_an_adapter(run_dir, base_dir, crafted_dirs, tmp_path, capsys):
    """The error names where the run's adapter is."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    save_pth({"adapter": read_adapter(str(run / "adapter")), "optimizer": {"m": np.zeros(2, np.float32)}, "epoch": 0},
             run / "checkpoint-latest.pth")
    for given, needles in [(run / "checkpoint-latest.pth", ["a training checkpoint"]), (run, ["no adapter"])]:
        common = ["--adapter_path", str(given), "--llama_path", base_dir, "--data_path", crafted_dirs[0],
                  "--output_dir", str(tmp_path / "eval")]
        assert_refused(capsys, lambda: Infer.main(common), *needles, f"its adapter is {run / 'adapter'}")


@pytest.fixture(scope="module")
def weights_run(run_dir):
    """Infer with its defaults (newest run, the test split it recorded) and --save_weights."""
    summary = Infer.main(["--output_root", os.path.dirname(run_dir), "--max_examples", "5", "--batch_size", "4",
                          "--max_gen_len", "8", "--save_weights"])
    return summary, os.path.join(run_dir, "eval")


@pytest.mark.slow
def test_weight_pickles_structure(weights_run, tok):
    summary, out = weights_run
    assert summary["datasets"]["synthetic"]["total"] == 5
    with open(os.path.join(out, "type_weight.pkl"), "rb") as f:
        types = pickle.load(f)
    with open(os.path.join(out, "token_weight.pkl"), "rb") as f:
        gammas = pickle.load(f)
    with open(os.path.join(os.path.dirname(out), "data", "test.json")) as f:
        tests = json.load(f)[:5]
    assert types["kind"] == "type_weight" and gammas["kind"] == "token_weight" and types["variant"] == "sparse"
    assert types["layer_types"] == [["Q", "K", "V", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER"]] * 2
    assert len(types["examples"]) == len(gammas["examples"]) == 5
    for ex, gex, test in zip(types["examples"], gammas["examples"], tests):
        prompt = tok.encode(format_prompt(test), bos=True, eos=False)
        n = len(ex["token_ids"])
        assert ex["token_ids"][:ex["n_prompt"]] == prompt and 0 < n - ex["n_prompt"] <= 8
        assert len(ex["tokens"]) == n and ex["tokens"][0] == "<|begin_of_text|>"
        assert tok.decode(ex["token_ids"][ex["n_prompt"]:]) == ex["generation"]
        for layer, names in enumerate(types["layer_types"]):
            assert isinstance(ex["weights"][layer], np.ndarray) and ex["weights"][layer].shape == (n, len(names))
            assert gex["weights"][layer].shape == (n, 1)
            assert np.all((gex["weights"][layer] > 0) & (gex["weights"][layer] < 0.5))  # max_threshold 0.5


@pytest.mark.slow
def test_pngs_exist_not_blank_with_expert_names(weights_run, tmp_path):
    _, out = weights_run
    for name in ("type_weight", "token_weight", "token_types", "router_stats", "loss_curves"):
        pixels = mpimg.imread(os.path.join(out, f"{name}.png"))
        assert pixels.ndim == 3 and pixels.var() > 0, name
    types = load_pickle(os.path.join(out, "type_weight.pkl"))
    gammas = load_pickle(os.path.join(out, "token_weight.pkl"))
    names = types["layer_types"][0]
    fig = plots.plot_type_weight(types, str(tmp_path / "t.png"))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == names
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["layer 0", "layer 1"]
    fig = plots.plot_router_stats(types, str(tmp_path / "r.png"))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == names
    fig = plots.plot_token_weight(gammas, str(tmp_path / "g.png"), examples=(0,))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[-len(gammas["examples"][0]["tokens"][-3:]):] == [plots.token_label(t) for t in
                                                                   gammas["examples"][0]["tokens"][-3:]]
    fig = plots.plot_loss_curves(os.path.join(os.path.dirname(out), "log.txt"), str(tmp_path / "l.png"))
    assert {line.get_label() for line in fig.axes[0].get_lines()} == {"train loss (8 points)", "val loss (3 points)"}


@pytest.mark.slow
def test_router_report_of_the_run(weights_run):
    """Infer.py --save_weights writes router_report.html, listed in the folder's manifest with its other outputs; its
    tokens are the pickles', its correctness the predictions'; opened in Chromium it draws without an error."""
    _, out = weights_run
    with open(os.path.join(out, ".manifest.json")) as f:
        assert {"router_report.html", "token_types.png", "type_weight.pkl"} <= set(json.load(f)["written"])
    with open(os.path.join(out, "router_report.html")) as f:
        html = f.read()
    data = json.loads(html.split('id="report-data">')[1].split("</script>")[0])
    types = load_pickle(os.path.join(out, "type_weight.pkl"))
    with open(os.path.join(out, "synthetic_predictions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    run = data["runs"][0]
    assert [ex["tokens"] for ex in run["examples"]] == [ex["tokens"] for ex in types["examples"][:3]]  # --plot_examples
    assert [ex["correct"] for ex in run["examples"]] == [r["correct"] for r in rows[:3]]
    assert run["method"] == "sparse MoA" and len(run["mean"]) == 2 and data["scales"]["gamma"][1] <= 0.5
    if CHROMIUM:
        rendered, errors, _ = page_dom(os.path.join(out, "router_report.html"), "#layer=1")
        assert (rendered, errors) == ("layer 1 by gamma", "")


# ---- bad input: one clear message, exit code 2 ----------------------------------------

def test_base_alone_is_scored_on_the_runs_test_split(monkeypatch, tok, run_dir, tmp_path):
    """--no_adapter --adapter_path RUN/adapter (as demo.sh scores the base): the run's recorded split."""
    monkeypatch.setattr(Infer, "generate", lambda model, tokenizer, prompts, *a, **k: [[] for _ in prompts])
    summary = Infer.main(["--no_adapter", "--adapter_path", os.path.join(run_dir, "adapter"), "--max_examples", "3",
                          "--output_dir", str(tmp_path / "eval_base")])
    assert summary["adapter"] is None and summary["datasets"]["synthetic"]["total"] == 3
    assert summary["datasets"]["synthetic"]["path"] == os.path.join(run_dir, "data", "test.json")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="needs OpenMPI's mpirun")
def test_mpirun_two_ranks_equal_one(tmp_path, run_dir, crafted_dirs):
    """Rank r takes examples r::2; rank 0 merges them back into input order: the same files as one process."""
    common = ["--adapter_path", os.path.join(run_dir, "adapter"), "--data_path", *crafted_dirs,
              "--max_gen_len", "8", "--batch_size", "2"]
    Infer.main(common + ["--output_dir", str(tmp_path / "one")])
    proc = mpirun(2, [*common, "--output_dir", str(tmp_path / "two")], program="Infer.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in CRAFTED:
        one = (tmp_path / "one" / f"{name}_predictions.jsonl").read_text()
        assert one == (tmp_path / "two" / f"{name}_predictions.jsonl").read_text()
    assert not list((tmp_path / "two").glob(".part*"))  # part files cleaned up


COMMONSENSE = ("boolq", "piqa", "social_i_qa", "winogrande", "ARC-Challenge", "ARC-Easy", "openbookqa")


@pytest.mark.slow
def test_infer_commonsense_tiny_run(base_dir, tmp_path):
    """The tiny base over the commonsense sets: accuracy per set by its own rule, and the average."""
    root = str(DATA / "commonsense")
    summary = Infer.main(["--no_adapter", "--llama_path", base_dir, "--data_path", root, "--max_examples", "2",
                          "--max_gen_len", "3", "--batch_size", "2", "--output_dir", str(tmp_path)])
    sets = summary["datasets"]
    assert sorted(sets) == sorted(COMMONSENSE)  # HellaSwag's test set is not available
    assert all(s["total"] == 2 and s["rule"] == name and 0 <= s["accuracy"] <= 1 for name, s in sets.items())
    assert summary["average"] == pytest.approx(np.mean([s["accuracy"] for s in sets.values()]))
    with open(tmp_path / "scores.json") as f:
        assert json.load(f)["datasets"]["boolq"]["total"] == 2
