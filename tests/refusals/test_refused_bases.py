"""Bases, refused in one line naming the file and the tensor or field (exit 2), nothing written: a tensor holding
NaN or inf (a corrupted download) found while it streams in, and a config field of the wrong kind found before
anything is computed from it."""
import json
import shutil
import struct

import numpy as np
import pytest
from conftest import assert_refused, edited_base, infer_base_alone

import Infer
from Models.formats.base_model import base_args, build_model
from Models.formats.pth import load_pth, save_pth
from Models.formats.reading import NonFiniteBase, checked_in_memory
from Models.formats.safetensors import read_header


def no_generation(*args, **kwargs):
    raise AssertionError("generation started on inputs that should have been refused")


def poked(folder, copy, tensor: str, element: int, bits: int):
    """A copy of the Hugging Face base `folder` whose bf16 tensor `tensor` has `bits` at `element`."""
    shutil.copytree(folder, copy)
    found = read_header(copy / "model.safetensors")[tensor]
    with open(found.path, "r+b") as f:
        f.seek(found.offset + 2 * element)
        f.write(struct.pack("<H", bits))
    return str(copy)


def test_a_non_finite_base_tensor_is_refused_naming_it(tiny_qwen3, tiny_base, addsub, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Infer, "generate", no_generation)
    nan_norm = poked(tiny_qwen3, tmp_path / "nan", "model.layers.1.input_layernorm.weight", 5, 0x7FC0)
    assert_refused(capsys, lambda: infer_base_alone(nan_norm, tmp_path / "eval", "--data_path", addsub),
                   f"{nan_norm}/model.safetensors", "tensor 'model.layers.1.input_layernorm.weight'", "1 value(s)",
                   "NaN or inf")
    assert not (tmp_path / "eval").exists()
    inf_table = poked(tiny_qwen3, tmp_path / "inf", "model.embed_tokens.weight", 100, 0xFF80)  # -inf
    for precision in ("fp32", "bf16"):
        with pytest.raises(NonFiniteBase, match="tensor 'model.embed_tokens.weight' holds 1 value"):
            build_model(inf_table, base_args(inf_table, max_seq_len=16, precision=precision))

    weights = load_pth(f"{tiny_base}/consolidated.00.pth")  # Meta's layout, fp32
    meta = tmp_path / "meta"
    shutil.copytree(tiny_base, meta)
    for value, refused in [(np.nan, ("fp32", "bf16")), (3.4e38, ("bf16",))]:  # 3.4e38: finite, past bf16's range
        bad = {**weights, "layers.1.feed_forward.w2.weight": weights["layers.1.feed_forward.w2.weight"].copy()}
        bad["layers.1.feed_forward.w2.weight"][3, 7] = value
        save_pth(bad, meta / "consolidated.00.pth")
        for precision in ("fp32", "bf16"):
            args = base_args(str(meta), max_seq_len=16, precision=precision)
            if precision not in refused:
                build_model(str(meta), args)
                continue
            with pytest.raises(NonFiniteBase, match="consolidated.00.pth: tensor 'layers.1.feed_forward.w2.weight' "
                                                    "holds 1 value") as info:
                build_model(str(meta), args)
            assert ("past the range of the model's bfloat16" in str(info.value)) == (precision == "bf16")

    import jittor as jt  # a tensor that comes through memory (a non-contiguous or big-endian one) by the same rule
    values = jt.array(np.array([1.0, np.inf, -2.0, np.nan, 3.3e38], np.float32))
    counts = [checked_in_memory(values, "float32", dtype, ("f", "t")).checks[0].count.item() for dtype in
              ("float32", "bfloat16")]
    assert counts == [2, 2]  # 3.3e38 stays finite in bf16; 3.4e38 rounds to inf there
    assert checked_in_memory(jt.array(np.array([3.4e38], np.float32)), "float32", "bfloat16",
                             ("f", "t")).checks[0].count.item() == 1


CONFIG_CASES = [  # (file, fields, what the one line names besides the file)
    ("config.json", dict(architectures=[["Qwen3ForCausalLM"]]), "architectures [['Qwen3ForCausalLM']]"),
    ("config.json", dict(architectures=[{"name": "Qwen3ForCausalLM"}]), "architectures [{'name'"),
    ("config.json", dict(layer_types=5), "field 'layer_types' is 5, expected a list"),
    ("config.json", dict(layer_types="full_attention"), "field 'layer_types' is 'full_attention', expected a list"),
    ("config.json", dict(layer_types=[["full_attention"]]), "field 'layer_types[0]'"),
    ("config.json", dict(rope_parameters={"rope_theta": [1]}), "field 'rope_parameters.rope_theta' must be a number"),
    ("config.json", dict(rope_parameters={"rope_theta": "lots"}), "field 'rope_parameters.rope_theta'"),
    ("config.json", dict(rope_parameters={"rope_type": ["default"]}), "field 'rope_parameters.rope_type'"),
    ("config.json", dict(rope_parameters="default"), "field 'rope_parameters' is 'default', expected an object"),
    ("config.json", dict(rms_norm_eps="lots"), "field 'rms_norm_eps' must be a number, got 'lots'"),
    ("config.json", dict(head_dim=2.5), "field 'head_dim' must be an integer"),
    ("config.json", dict(num_hidden_layers=10**30), "field 'num_hidden_layers' must be an integer of 64 bits"),
    ("config.json", dict(tie_word_embeddings="yes"), "field 'tie_word_embeddings' must be true or false"),
    ("config.json", dict(attention_bias="no"), "field 'attention_bias' is 'no', expected true or false"),
    ("config.json", dict(hidden_size=None), "field 'hidden_size' is missing"),
    ("generation_config.json", dict(eos_token_id=2.0), "field 'eos_token_id' is 2.0"),
    ("generation_config.json", dict(eos_token_id=[1, "2"]), "field 'eos_token_id[1]' is '2'"),
    ("tokenizer_config.json", dict(add_bos_token="yes"), "field 'add_bos_token' is 'yes'"),
]


def test_config_fields_are_checked_by_kind_before_use(tiny_qwen3, addsub, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Infer, "generate", no_generation)
    for i, (file, fields, needle) in enumerate(CONFIG_CASES):
        folder = edited_base(tiny_qwen3, tmp_path / f"base{i}", file, **fields)
        assert_refused(capsys, lambda: infer_base_alone(folder, tmp_path / "eval", "--data_path", addsub),
                       f"{folder}/{file}: ", needle)
    with open(f"{tiny_qwen3}/tokenizer.json") as f:
        model = json.load(f)["model"]
    folder = edited_base(tiny_qwen3, tmp_path / "no_vocab", "tokenizer.json", model={**model, "vocab": {}, "merges": []},
                         added_tokens=[])
    assert_refused(capsys, lambda: infer_base_alone(folder, tmp_path / "eval", "--data_path", addsub),
                   f"{folder}/tokenizer.json", "vocabulary", "empty")
    assert not (tmp_path / "eval").exists()
