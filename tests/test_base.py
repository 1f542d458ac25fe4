"""The LLaMA-3 base: Meta checkpoint loading, RoPE, bad input (parity with the authors' logits: tests/test_golden.py)."""
import json
import shutil
import zipfile

import numpy as np
import pytest

from load_memory import load_peak
import jittor as jt
from Models.formats.base_model import build_model
from Models.formats.meta import load_base
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs, parse_layer_span
from Models.formats import CheckpointError
from Models.formats.pth import load_pth
from Models.formats.pth_writer import save_pth
from Models.rope import rope_frequencies

RUNTIME = dict(max_seq_len=32, max_batch_size=4, precision="fp32")  # parity is checked in fp32


def test_kv_cache_rejected_in_training_mode(tiny_meta):
    model = build_model(str(tiny_meta), ModelArgs.from_params_json(str(tiny_meta), **RUNTIME))
    model.train()
    with pytest.raises(RuntimeError, match="eval mode"):
        model.llama(jt.array(np.ones((1, 4), np.int32)), start_pos=0)


def test_scaled_rope_frequencies():
    plain = rope_frequencies(128, 500000.0).astype(np.float64)
    scaled = rope_frequencies(128, 500000.0, ModelArgs(use_scaled_rope=True).rope_scaling).astype(np.float64)
    wavelen = 2 * np.pi / plain
    high = wavelen < 8192 / 4  # high frequencies: untouched
    low = wavelen > 8192 / 1  # low frequencies: divided by the factor 8
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()
    np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    smooth = (8192 / wavelen[middle] - 1) / (4 - 1)
    np.testing.assert_allclose(scaled[middle], (1 - smooth) * plain[middle] / 8 + smooth * plain[middle], rtol=1e-5)
    assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


@pytest.mark.parametrize("precision", ["fp32", "int8", "nf4"])
def test_sharded_checkpoint_joins(tiny_meta, tmp_path, precision):
    """Two model-parallel shards (column- and row-split) load to the same weights as one; in int8 and nf4 a row
    split over both shards is quantized whole."""
    full = load_pth(tiny_meta / "consolidated.00.pth")
    column = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")
    shards = [{}, {}]
    for name, value in full.items():
        if "norm" in name:
            shards[0][name] = shards[1][name] = value
        else:
            axis = 0 if any(f"{c}." in name for c in column) else 1
            for i, half in enumerate(np.array_split(value, 2, axis=axis)):
                shards[i][name] = half
    shutil.copy(tiny_meta / "params.json", tmp_path / "params.json")
    for i, shard in enumerate(shards):
        save_pth(shard, tmp_path / f"consolidated.0{i}.pth", bf16=True)
    runtime = {**RUNTIME, "precision": precision}
    joined = build_model(str(tmp_path), ModelArgs.from_params_json(str(tmp_path), **runtime))
    single = build_model(str(tiny_meta), ModelArgs.from_params_json(str(tiny_meta), **runtime))
    for name, var in single.base_parameters().items():
        assert np.array_equal(var.float32().numpy(), joined.base_parameters()[name].float32().numpy()), name


@pytest.fixture
def meta_copy(tiny_meta, tmp_path):
    shutil.copy(tiny_meta / "params.json", tmp_path / "params.json")
    shutil.copy(tiny_meta / "consolidated.00.pth", tmp_path / "consolidated.00.pth")
    return tmp_path


def test_missing_params_json(meta_copy):
    (meta_copy / "params.json").unlink()
    with pytest.raises(FileNotFoundError, match="params.json"):
        build_model(str(meta_copy), ModelArgs.from_params_json(str(meta_copy), **RUNTIME))


def test_params_json_wrong_type(meta_copy):
    params = json.loads((meta_copy / "params.json").read_text())
    params["n_heads"] = "four"
    (meta_copy / "params.json").write_text(json.dumps(params))
    with pytest.raises(ValueError, match=r"params.json.*n_heads"):
        build_model(str(meta_copy), ModelArgs.from_params_json(str(meta_copy), **RUNTIME))


@pytest.mark.parametrize("change, message", [
    ("drop", r"consolidated.00.pth.*missing base tensor.*layers.1.ffn_norm.weight"),
    ("extra", r"consolidated.00.pth.*unexpected.*layers.9.attention.wq.weight"),
    ("shape", r"consolidated.00.pth.*'layers.0.attention.wk.weight' has shape \[16, 64\].*\[32, 64\]"),
])
def test_bad_checkpoint_tensors(meta_copy, change, message):
    state = load_pth(meta_copy / "consolidated.00.pth")
    if change == "drop":
        del state["layers.1.ffn_norm.weight"]
    elif change == "extra":
        state["layers.9.attention.wq.weight"] = state["layers.0.attention.wq.weight"]
    else:
        state["layers.0.attention.wk.weight"] = state["layers.0.attention.wk.weight"][:16]
    save_pth(state, meta_copy / "consolidated.00.pth", bf16=True)
    with pytest.raises(CheckpointError, match=message):
        build_model(str(meta_copy), ModelArgs.from_params_json(str(meta_copy), **RUNTIME))


def test_missing_checkpoint_file(meta_copy):
    (meta_copy / "consolidated.00.pth").unlink()
    model = LLaMA_adapter(ModelArgs.from_params_json(str(meta_copy / "params.json"), **RUNTIME))
    with pytest.raises(FileNotFoundError, match="consolidated"):
        load_base(model, str(meta_copy))


@pytest.mark.parametrize("fields, message", [
    (dict(dim=65, n_heads=4), "not divisible"),
    (dict(n_heads=4, n_kv_heads=3, dim=64), "n_kv_heads"),
    (dict(n_layers=0), "n_layers"),
    (dict(variant="dense"), "variant"),
])
def test_impossible_config(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, vocab_size=97), **fields})


def test_layer_spans():
    assert parse_layer_span("0-2", 4) == {0, 1}
    assert parse_layer_span("0-1,3-4", 4) == {0, 3}
    assert parse_layer_span("0-0", 4) == set()
    for bad in ("0-", "3-1", "a-b", "0-5", "2"):
        with pytest.raises(ValueError, match="layers"):
            parse_layer_span(bad, 4)


@pytest.mark.parametrize("precision", ["bf16", "fp32", "int8", "nf4"])
def test_streaming_load_peak_memory(tiny_meta, tmp_path, precision):
    """Loading a ~60 MB bf16 checkpoint raises the peak RSS by at most 1.15x the loaded base's bytes:
    tensors go from the file into their Vars one by one, with no fp32 copy of the whole model and
    no random initialisation run first; int8 and nf4 matrices are quantized as they are read, never whole
    in bf16. A fresh process measures its own peak (VmHWM)."""
    from Data.tiny_base import params_for, random_base_weights
    params = params_for(16384, 512, 4, 8, 4, 256)
    (tmp_path / "params.json").write_text(json.dumps(params))
    save_pth(random_base_weights(ModelArgs(**params), 0), tmp_path / "consolidated.00.pth", bf16=True)
    report = load_peak(tiny_meta, tmp_path, precision)
    assert report["model_bytes"] > 22e6  # nf4: matrices of half a byte a weight, the embedding in bf16
    # int8, nf4: besides, each thread's block of rows converted and quantized, and OpenMP's threads (a few MB, not
    # growing with the model; a bf16 copy of the model would be several times that)
    assert report["increase"] <= 1.15 * report["model_bytes"] + (8 << 20 if precision in ("int8", "nf4") else 0), report


def test_truncated_shard_names_the_file(meta_copy):
    path = meta_copy / "consolidated.00.pth"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth.*(truncated|damaged)"):
        build_model(str(meta_copy), ModelArgs.from_params_json(str(meta_copy), **RUNTIME))


def test_crafted_shard_is_refused_when_read_lazily(meta_copy):
    """A shard whose pickle names a callable outside the allow-list is refused, lazily too."""
    path = meta_copy / "consolidated.00.pth"
    with zipfile.ZipFile(path) as archive:
        records = {name: archive.read(name) for name in archive.namelist()}
    pkl = next(name for name in records if name.endswith("data.pkl"))
    records[pkl] = b"\x80\x02cos\nsystem\n(X\x04\x00\x00\x00truetR."
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    with pytest.raises(CheckpointError, match=r"consolidated.00.pth.*refusing to load global 'os.system'"):
        build_model(str(meta_copy), ModelArgs.from_params_json(str(meta_copy), **RUNTIME))
