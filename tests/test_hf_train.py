"""The tools on Hugging Face bases (tiny random folders from Data/tiny_base.write_random_hf_base): Sparse and
Soft MoA trained by Math.py over 2 MPI ranks on a Qwen3 base, resumed bit for bit, scored by Infer.py with
--save_weights; every baseline trained and scored on it, and a Compare.py row; the authors' adapter files of an HF
LLaMA base both ways; an adapter refused on another architecture; a crafted weight file refused by Math.py.
The Qwen3 base's embedding table has a quarter more rows than its tokenizer has tokens, as a real one's has more:
every evaluation samples at temperature 1 over the whole nucleus, where those rows would be drawn, and none is."""
import json
import pickle
import shutil

import numpy as np
import pytest
from conftest import (LORA_ONLY_IDLE, MPIRUN, NO_TYPE_ROUTER_IDLE, log_records, math_argv, mpirun, tiny_flags,
                      train, write_synthetic_splits)

import Compare
import Infer
from Models.formats.pth import load_pth
from scripts import authors_adapter
from Utils.settings import METHOD_PRESETS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """48 training and 4 validation problems; the validation file doubles as the (never trained on) test set."""
    return write_synthetic_splits(tmp_path_factory.mktemp("hf_data"), 48, 4, seed=4)


def infer(adapter, data, out, *extra):
    """Infer.main sampling 3 tokens per example; its summary, after checking no generation reached an id the
    tokenizer lacks."""
    summary = Infer.main(["--adapter_path", str(adapter), "--data_path", data["val"], "--output_dir", str(out),
                          "--max_gen_len", "3", "--batch_size", "2", "--temperature", "1", "--top_p", "1", *extra])
    assert not any("undecodable" in s for s in summary["datasets"].values()), summary
    return summary


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (install OpenMPI to test data parallel)")
@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_qwen3_moa_on_two_ranks_resumes_exactly_and_is_scored(variant, tiny_qwen3, data, tmp_path):
    prompts = ["--prompt_len", 2] if variant == "soft" else []  # Sparse MoA has no prompts (Math.py refuses it)
    run = lambda out, *extra: mpirun(2, math_argv(tiny_qwen3, data, out, "--variant", variant, *prompts,  # noqa: E731
                                              "--eval_interval", 2, *extra))
    for done in (run(tmp_path / "straight", "--max_steps", 4), run(tmp_path / "split", "--max_steps", 2),
                 run(tmp_path / "split", "--max_steps", 4, "--resume", "auto")):
        assert done.returncode == 0, done.stdout + done.stderr
    a, b = (load_pth(tmp_path / r / "adapter" / "adapter.pth") for r in ("straight", "split"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit
    assert ("prompt" in " ".join(a)) == (variant == "soft")
    assert max(float(np.abs(a[k]).max()) for k in a if "lora_B" in k) > 1e-3  # it did train
    losses = [[r["train_loss"] for r in log_records(tmp_path / run, "train")] for run in ("straight", "split")]
    assert losses[0] == losses[1]
    summary = infer(tmp_path / "split" / "adapter", data, tmp_path / "eval", "--save_weights")
    assert [s["total"] for s in summary["datasets"].values()] == [4]
    with open(tmp_path / "eval" / "type_weight.pkl", "rb") as f:
        types = pickle.load(f)
    families = ["Q", "K", "V", *(["PROMPT"] if variant == "soft" else []), "O", "FFN_UP", "FFN_GATE", "FFN_DOWN",
                "PADAPTER"]
    assert types["layer_types"] == [families] * 2
    assert all(w.shape[1] == len(families) for ex in types["examples"] for w in ex["weights"])


def test_every_baseline_trains_and_is_scored_on_a_qwen3_base(tiny_qwen3, data, tmp_path):
    """The paper's baselines (Compare.py's presets; MoA's two variants are the test above), with 2 experts
    where the preset has more, then one Compare.py row."""
    for method, preset in METHOD_PRESETS.items():
        if preset["method"] == "moa":
            continue
        out = tmp_path / method
        fewer = ["--expert_num", 2] if preset.get("expert_num", 1) > 1 else []
        idle = {"instance": (), "unipeft": NO_TYPE_ROUTER_IDLE}.get(preset["method"], LORA_ONLY_IDLE)
        assert train(tiny_qwen3, data, out, "--max_steps", 1, *Compare.preset_flags(preset), *fewer,
                     leave_out=idle) == 0
        assert np.isfinite(log_records(out, "train")[0]["train_loss"]), method
        summary = infer(out / "adapter", data, out / "eval", "--max_examples", "2")
        assert [s["total"] for s in summary["datasets"].values()] == [2], method
    compare = ["--methods", "lora", "--ranks", "1", "--max_steps", "1", "--max_examples", "2", "--llama_path",
               tiny_qwen3, "--data_path", data["train"], "--test_data", data["val"], "--output_dir",
               str(tmp_path / "compare"), "--", *tiny_flags(LORA_ONLY_IDLE), "--val_data_path", data["val"]]
    assert Compare.main(compare) == 0
    rows = {row["method"]: row for row in json.loads((tmp_path / "compare" / "compare.json").read_text())["rows"]}
    assert list(rows) == ["lora", "base"] and rows["lora"]["steps"] == 1


def test_authors_files_of_an_hf_llama_adapter_and_refusals(tiny_hf_llama, tiny_qwen3, data, tmp_path, capsys):
    assert train(tiny_hf_llama, data, tmp_path / "run", "--max_steps", 1) == 0
    ours = load_pth(tmp_path / "run" / "adapter" / "adapter.pth")
    authors_adapter.main(["export", str(tmp_path / "run" / "adapter"), str(tmp_path / "theirs" / "adapter.pth")])
    authors_adapter.main(["import", str(tmp_path / "theirs" / "adapter.pth"), str(tmp_path / "back"), "--llama_path",
                     tiny_hf_llama])
    back = load_pth(tmp_path / "back" / "adapter.pth")
    assert set(back) == set(ours) and all(np.array_equal(back[k], ours[k]) for k in ours)
    # the LLaMA adapter onto the Qwen3 base: one line naming both architectures, exit 2
    with pytest.raises(SystemExit) as stop:
        infer(tmp_path / "run" / "adapter", data, tmp_path / "eval", "--llama_path", tiny_qwen3)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"adapter trained on another base than {tiny_qwen3}: architecture: adapter 'llama', base 'qwen3';" in err
    # a crafted weight file: one line naming it, exit 2, nothing written
    crafted = tmp_path / "crafted"
    shutil.copytree(tiny_qwen3, crafted)
    (crafted / "model.safetensors").write_bytes((10_000).to_bytes(8, "little") + b"{}")
    assert train(str(crafted), data, tmp_path / "bad", "--max_steps", 1) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {crafted / 'model.safetensors'}: the header length 10000 reaches past the end")
    assert err.count("\n") == 1 and not (tmp_path / "bad").exists()
