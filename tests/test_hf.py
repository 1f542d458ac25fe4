"""Hugging Face bases (LlamaForCausalLM, Qwen3ForCausalLM): their settings, the q/k row order, sharding, the load's
peak memory, the safetensors format against the `safetensors` library and crafted files, config.json refusals,
the tokenizer.json conventions, Qwen3's norms with the MoA experts, adapters bound to their base (transformers'
logits and KV-cache logits, fused and plain, fp32 and bf16: tests/test_golden.py)."""
import json
import re
import shutil
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from conftest import GOLDEN, one_error_line, train
from tiny_models import kv_logits, max_abs, randomize_adapters
from load_memory import load_peak

import jittor as jt
from Models import load_base_model
from Models.formats import CheckpointError, hf
from Models.formats.adapters import export_authors_adapter, load_adapter, save_adapter
from Models.formats.base_model import base_args, open_tokenizer
from Models.formats.meta import meta_shapes
from Models.formats.pth import load_pth
from Models.formats.safetensors import open_checkpoint, read_header, save_safetensors
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits
from Models.kernels import switch
from Models.kernels.decode_layer import fuses_decode_step

HF_GOLDEN = GOLDEN / "hf"
RUNTIME = dict(max_seq_len=32, max_batch_size=4)


def golden(name):
    data = np.load(HF_GOLDEN / f"{name}.npz", allow_pickle=False)
    return data, json.loads(str(data["meta"]))


def golden_copy(name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(HF_GOLDEN / name, folder)
    return folder


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def file_bytes(tensor) -> bytes:
    with open(tensor.path, "rb") as f:
        f.seek(tensor.offset)
        return f.read(tensor.nbytes)


# ---- one model in either layout, its settings, shards and load memory -----------------------------

def test_config_settings_reach_the_model():
    llama, qwen = base_args(str(HF_GOLDEN / "llama31_tiny")), base_args(str(HF_GOLDEN / "qwen3_tiny"))
    assert (llama.architecture, llama.head_dim, llama.ffn_hidden_dim, llama.rope_scaling) == ("llama", 16, 176,
                                                                                              (8.0, 1.0, 4.0, 32))
    assert (qwen.architecture, qwen.head_dim, qwen.qk_norm, qwen.tied_embeddings, qwen.rope_theta, qwen.norm_eps,
            qwen.rope_scaling) == ("qwen3", 32, True, True, 1e6, 1e-6, None)
    model = load_base_model(str(HF_GOLDEN / "qwen3_tiny"), **RUNTIME)
    assert model.llama.output.weight is model.llama.tok_embeddings.weight  # tied: one Var
    shapes = {name[len("llama."):]: tuple(p.shape) for name, p in model.base_parameters().items()}
    assert shapes == meta_shapes(qwen) and "output.weight" not in shapes
    assert shapes["layers.0.attention.wq.weight"] == (128, 64) and shapes["layers.0.attention.q_norm.weight"] == (32,)


def test_meta_and_hf_layouts_of_one_model_agree(tiny_meta, tmp_path):
    """The authors' tiny Meta base written as an HF LlamaForCausalLM folder (HF's names, q/k rows in HF's
    half-split order, 4 shards) loads to the same model, bit for bit."""
    args = base_args(str(tiny_meta))
    weights = {k: v for k, v in load_pth(tiny_meta / "consolidated.00.pth").items() if k in meta_shapes(args)}
    hf.write_hf_base(str(tmp_path), args, weights, max_shard_bytes=60_000, bf16=True)
    tensors, _ = open_checkpoint(str(tmp_path))
    assert len({t.path for t in tensors.values()}) == 4
    H, hd, D = args.n_heads, args.head_dim, args.dim
    q_file = tensors["model.layers.0.self_attn.q_proj.weight"]
    q_hf = bf16_bits_to_float32(np.frombuffer(file_bytes(q_file), np.uint16)).reshape(H, 2, hd // 2, D)
    q_meta = weights["layers.0.attention.wq.weight"].reshape(H, hd // 2, 2, D)
    assert np.array_equal(q_hf, q_meta.transpose(0, 2, 1, 3))  # HF row c*hd/2 + i = Meta row 2i + c
    meta_model, hf_model = load_base_model(str(tiny_meta), **RUNTIME), load_base_model(str(tmp_path), **RUNTIME)
    hf_params = hf_model.base_parameters()
    assert all(np.array_equal(var.numpy(), hf_params[name].numpy()) for name, var in meta_model.base_parameters().items())


def test_sharded_equals_single_file(tmp_path):
    """qwen3_tiny's tensors written back by our writer: the same bytes as transformers wrote; as one file
    or as 4 shards joined by the index, the same model."""
    args = base_args(str(HF_GOLDEN / "qwen3_tiny"))
    model = load_base_model(str(HF_GOLDEN / "qwen3_tiny"), **RUNTIME)
    weights = {name[len("llama."):]: var.numpy() for name, var in model.base_parameters().items()}
    hf.write_hf_base(str(tmp_path / "single"), args, weights, bf16=True)
    hf.write_hf_base(str(tmp_path / "sharded"), args, weights, max_shard_bytes=70_000, bf16=True)
    theirs, _ = open_checkpoint(str(HF_GOLDEN / "qwen3_tiny"))
    ours, _ = open_checkpoint(str(tmp_path / "single"))
    assert sorted(ours) == sorted(theirs) and all(file_bytes(ours[n]) == file_bytes(theirs[n]) for n in theirs)
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) == len(theirs)
    assert len(list((tmp_path / "sharded").glob("model-0000?-of-00004.safetensors"))) == 4
    data, _ = golden("qwen3_tiny")
    tokens = jt.array(data["tokens"].astype(np.int32))
    single, sharded = (load_base_model(str(tmp_path / f), **RUNTIME) for f in ("single", "sharded"))
    assert np.array_equal(single.llama(tokens).numpy(), sharded.llama(tokens).numpy())
    assert max_abs(sharded.llama(tokens).numpy(), data["logits"]) <= 1e-4


@pytest.mark.parametrize("precision_", ["bf16", "fp32", "int8", "nf4"])
def test_streaming_load_peak_memory(tmp_path, precision_):
    """A ~60 MB bf16 safetensors base raises the peak RSS of its load by at most 1.15x the loaded base's
    bytes: no fp32 or numpy copy of the model, no random initialisation run (conftest.load_peak)."""
    from Data.tiny_base import random_base_weights
    from Models.ModelArgs import ModelArgs
    args = ModelArgs(architecture="qwen3", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=1536,
                     vocab_size=16384, qk_norm=True)
    hf.write_hf_base(str(tmp_path), args, random_base_weights(args, 0), max_shard_bytes=20 << 20, bf16=True)
    report = load_peak(HF_GOLDEN / "qwen3_tiny", tmp_path, precision_)
    assert report["model_bytes"] > 22e6  # nf4: matrices of half a byte a weight, the embedding in bf16
    # int8, nf4: besides, each thread's block of rows converted and quantized, and OpenMP's threads (a few MB, not
    # growing with the model; a bf16 copy of the model would be several times that)
    assert report["increase"] <= 1.15 * report["model_bytes"] + (8 << 20 if precision_ in ("int8", "nf4") else 0), report


# ---- the safetensors format ----------------------------------------------------------------------

def test_safetensors_files_agree_with_the_library(tmp_path):
    rng = np.random.default_rng(0)
    a, c, w = rng.standard_normal((3, 5)).astype(np.float32), np.arange(7, dtype=np.int64), rng.standard_normal((4, 2))
    save_safetensors({"a": a, "c": c}, tmp_path / "ours.safetensors")
    back = safetensors.numpy.load_file(tmp_path / "ours.safetensors")
    assert np.array_equal(back["a"], a) and np.array_equal(back["c"], c)
    save_safetensors({"w": w.astype(np.float32)}, tmp_path / "ours_bf16.safetensors", bf16=True)
    ((name, entry),) = safetensors.deserialize((tmp_path / "ours_bf16.safetensors").read_bytes())
    assert (name, entry["dtype"], entry["shape"]) == ("w", "BF16", [4, 2])
    assert bytes(entry["data"]) == float32_to_bf16_bits(w.astype(np.float32)).tobytes()
    bits = float32_to_bf16_bits(w.astype(np.float32))  # the library's file, bf16 given as raw bytes
    spec = safetensors.TensorSpec(dtype="bfloat16", shape=[4, 2], data_ptr=bits.ctypes.data, data_len=bits.nbytes)
    (tmp_path / "theirs.safetensors").write_bytes(safetensors.serialize({"w": spec}))
    safetensors.numpy.save_file({"a": a, "c": c}, tmp_path / "theirs_f32.safetensors")
    theirs = {**read_header(tmp_path / "theirs.safetensors"), **read_header(tmp_path / "theirs_f32.safetensors")}
    assert {n: (t.dtype, t.shape) for n, t in theirs.items()} == {"w": ("bfloat16", (4, 2)), "a": ("float32", (3, 5)),
                                                                 "c": ("int64", (7,))}
    assert file_bytes(theirs["w"]) == bits.tobytes() and file_bytes(theirs["a"]) == a.tobytes()
    assert file_bytes(theirs["c"]) == c.tobytes()


def crafted(header, data: bytes, length=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32 = lambda *offsets, shape=(2,): {"dtype": "F32", "shape": list(shape), "data_offsets": list(offsets)}  # noqa: E731


@pytest.mark.parametrize("contents, message", [
    (crafted({"x": F32(0, 8)}, bytes(8), length=10_000), r"header length 10000 reaches past the end of the file"),
    (crafted({"x": F32(0, 8), "y": F32(8, 400, shape=(98,))}, bytes(16)), r"'y': data_offsets \[8, 400\] lie outside"),
    (crafted({"x": F32(0, 8), "y": F32(4, 12)}, bytes(16)), r"tensors 'x' \[0, 8\] and 'y' \[4, 12\] overlap"),
    (crafted({"x": F32(0, 8, shape=(3,))}, bytes(8)), r"'x': dtype F32 and shape \[3\] make 12 bytes"),
    (crafted(b"{not json", bytes(8)), r"the header is not JSON"),
])
def test_crafted_safetensors_are_refused(contents, message, tmp_path):
    folder = golden_copy("qwen3_tiny", tmp_path)
    (folder / "model.safetensors").write_bytes(contents)
    with pytest.raises(CheckpointError, match=re.escape(str(folder / "model.safetensors")) + ": .*" + message):
        load_base_model(str(folder), **RUNTIME)


def test_shard_index_is_checked(tmp_path):
    args = base_args(str(HF_GOLDEN / "qwen3_tiny"))
    model = load_base_model(str(HF_GOLDEN / "qwen3_tiny"), **RUNTIME)
    weights = {name[len("llama."):]: var.numpy() for name, var in model.base_parameters().items()}
    hf.write_hf_base(str(tmp_path), args, weights, max_shard_bytes=70_000, bf16=True)
    index = tmp_path / "model.safetensors.index.json"
    mapping = json.loads(index.read_text())
    first = mapping["weight_map"]["model.embed_tokens.weight"]
    index.write_text(json.dumps({**mapping, "weight_map": {**mapping["weight_map"], "model.norm.weight": first}}))
    with pytest.raises(CheckpointError, match=r"index.json: tensor 'model.norm.weight' of model-0000\d-of-00004"
                                              r".safetensors is mapped to " + first):
        load_base_model(str(tmp_path), **RUNTIME)
    index.write_text(json.dumps(mapping))
    (tmp_path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"index.json: its shard model-00003-of-00004.safetensors is missing"):
        load_base_model(str(tmp_path), **RUNTIME)


# ---- config.json and the folder ------------------------------------------------------------------

@pytest.mark.parametrize("name, changes, message", [
    ("qwen3_tiny", {"architectures": ["MistralForCausalLM"]}, r"architectures \['MistralForCausalLM'\]"),
    ("qwen3_tiny", {"attention_bias": True}, r"attention_bias True: biases"),
    ("qwen3_tiny", {"use_sliding_window": True}, r"use_sliding_window True: sliding-window attention"),
    ("qwen3_tiny", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types 'sliding_attention'"),
    ("qwen3_tiny", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_parameters.rope_type 'yarn'"),
    ("qwen3_tiny", {"rope_parameters": None, "rope_scaling": {"type": "dynamic"}}, r"rope_scaling.rope_type 'dynamic'"),
    ("qwen3_tiny", {"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ("qwen3_tiny", {"quantization_config": {"quant_method": "awq"}}, r"quantization_config 'awq'"),
    ("qwen3_tiny", {"quantization_config": {"bits": 4}}, r"quantization_config \{'bits': 4\}"),
    ("qwen3_tiny", {"num_key_value_heads": 3}, r"n_kv_heads=3 \(n_heads is its num_attention_heads, n_kv_heads is its "
                                                r"num_key_value_heads\)"),
    ("qwen3_tiny", {"hidden_size": "64"}, r"field 'hidden_size' must be an integer, got '64'"),
    ("qwen3_tiny", {"head_dim": 31}, r"head_dim=31 must be even"),
    ("llama31_tiny", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     r"field 'rope_parameters.low_freq_factor' is missing"),
    ("llama31_tiny", {"mlp_bias": True}, r"mlp_bias True: biases"),
])
def test_config_fields_not_implemented_are_refused(name, changes, message, tmp_path):
    folder = golden_copy(name, tmp_path)
    edit_json(folder / "config.json", **changes)
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + ": .*" + message):
        load_base_model(str(folder), **RUNTIME)


def test_layout_is_told_by_the_files(tiny_meta, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a Meta checkpoint folder .* nor a Hugging Face one"):
        load_base_model(str(tmp_path / "empty"))
    both = golden_copy("qwen3_tiny", tmp_path)
    shutil.copy(tiny_meta / "params.json", both / "params.json")
    with pytest.raises(ValueError, match="holds both params.json .* and config.json"):
        load_base_model(str(both))


# ---- tokenizer -----------------------------------------------------------------------------------

def test_qwen3_tokenizer_conventions(tiny_qwen3):
    args = base_args(tiny_qwen3)
    tok = open_tokenizer(tiny_qwen3, args.vocab_size)
    end_of_text, im_end = tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_tokens) == (None, im_end, end_of_text, {im_end, end_of_text})
    assert (tok.n_words, args.vocab_size) == (387, 512)  # the table's last rows pad it, as Qwen3's do
    text = "Natalia sold 48 clips <|im_end|> in April."
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.encode(text, bos=True, eos=True) == ids + [im_end]  # no BOS
    assert im_end not in ids and tok.decode(ids) == text  # text spelling a special token stays text
    assert tok.decode(tok.encode("48", bos=False, eos=False)) == "48" and len(tok.encode("48", bos=False, eos=False)) == 2


def test_llama_tokenizer_starts_with_bos(tiny_hf_llama):
    tok = open_tokenizer(tiny_hf_llama, base_args(tiny_hf_llama).vocab_size)
    bos, eos, eot = (tok.token_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    ids = tok.encode("2 + 2", bos=True, eos=True)
    assert ids[0] == bos and ids[-1] == eos and bos not in ids[1:]
    assert (tok.pad_id, tok.stop_tokens) == (-1, {eos, eot})


def test_tokenizer_refusals(tiny_qwen3, tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(tiny_qwen3, folder)
    vocab = base_args(str(folder)).vocab_size
    n_words = open_tokenizer(str(folder), vocab).n_words  # fewer: the table's last rows pad it
    with pytest.raises(CheckpointError, match=rf"tokenizer.json .*token id {n_words - 1}, past the vocab_size "
                                              rf"{n_words - 1} of " + re.escape(str(folder / "config.json"))):
        open_tokenizer(str(folder), n_words - 1)
    edit_json(folder / "tokenizer_config.json", eos_token="<|nope|>")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: eos_token '<\|nope\|>' is not a token of"):
        open_tokenizer(str(folder), vocab)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer.json of the tokenizers library"):
        open_tokenizer(str(folder), vocab)


def test_a_rule_joining_settings_names_where_each_came_from(tiny_qwen3, tiny_base, synthetic_data, tmp_path, capsys):
    """`--method topk --expert_num 8` from the demo recipe breaks top-k's rule (LoRA experts only): the refusal names
    the recipe's p_adapter_layers and the flag's method, never the base's config.json, which holds neither."""
    for base in (tiny_qwen3, tiny_base):
        assert train(base, synthetic_data, tmp_path / "run", "--method", "topk", "--expert_num", 8) == 2
        err = capsys.readouterr().err
        one_error_line(err, "method=topk is a mixture of LoRA experts only", "method 'topk' from --method",
                       "p_adapter_layers 'all' from recipe 'demo'", "prompt_layers '0-0' from its default")
        assert "config.json" not in err and not (tmp_path / "run").exists()


# ---- Qwen3 with the experts ----------------------------------------------------------------------

def test_qwen3_q_and_k_experts_are_normed_with_their_heads():
    """The Q and K experts' outputs join the projections before q_norm/k_norm, as in the authors' Qwen3 MoA:
    scaling a projection together with its expert's B leaves the logits as they were (the norm takes the
    scale out); the expert alone does move them."""
    model = load_base_model(str(HF_GOLDEN / "qwen3_tiny"), lora_layers="all", lora_targets="Q,K", variant="soft",
                            **RUNTIME)
    randomize_adapters(model, 0, 0.3)
    tokens = jt.array(golden("qwen3_tiny")[0]["tokens"].astype(np.int32))
    before = model.llama(tokens).numpy()
    for layer in model.llama.layers:
        for base, lora, scale in ((layer.attention.wq, layer.attention.lora_Q, 3.0),
                                  (layer.attention.wk, layer.attention.lora_K, 0.5)):
            base.weight.assign(base.weight * scale)
            lora.lora_B.weight.assign(lora.lora_B.weight * scale)
    assert max_abs(model.llama(tokens).numpy(), before) <= 1e-4
    lora_B = model.llama.layers[0].attention.lora_Q.lora_B.weight
    lora_B.assign(lora_B * 3.0)
    assert max_abs(model.llama(tokens).numpy(), before) > 1e-2


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_qwen3_moa_fused_equals_plain_and_kv_cache(variant, monkeypatch):
    """Every expert family on Qwen3 (head_dim 32 != dim/heads): the fused kernels give the plain path's loss,
    logits and adapter gradients; the KV cache gives the full forward's logits, each decode step through the
    fused decode layer."""
    experts = dict(lora_layers="all", lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN", p_adapter_layers="all",
                   variant=variant, prompt_layers="all" if variant == "soft" else "0-0", prompt_len=3)
    model = load_base_model(str(HF_GOLDEN / "qwen3_tiny"), precision="fp32", **experts, **RUNTIME)
    randomize_adapters(model, 1, 0.2)
    tokens = golden("qwen3_tiny")[0]["tokens"].astype(np.int32)
    mask = jt.ones(tokens.shape)
    adapter = list(model.adapter_parameters().values())

    def forward():
        loss, logits = model(jt.array(tokens), mask)
        return float(loss.item()), logits.numpy(), [g.numpy() for g in jt.grad(loss, adapter)]
    fused = forward()
    monkeypatch.setattr(switch, "fused_kernels_on", lambda: False)
    plain = forward()
    assert abs(fused[0] - plain[0]) <= 1e-5 and max_abs(fused[1], plain[1]) <= 1e-4
    assert all(max_abs(f, p) <= 1e-4 * max(np.abs(p).max(), 1e-3) for f, p in zip(fused[2], plain[2]))
    monkeypatch.undo()
    model.eval()
    full = model.llama(jt.array(tokens)).numpy()
    assert max_abs(kv_logits(model.llama, tokens, 5), full[:, 4:]) <= 1e-4
    step = jt.zeros((tokens.shape[0], 1, model.args.dim))
    with jt.no_grad():  # the fused decode layer takes Qwen3's steps (on a CPU with oneDNN, or a GPU)
        assert all(fuses_decode_step(block, step, None, None, None, 5, None, None) for block in model.llama.layers)


def test_adapter_records_its_base_and_refuses_another(tiny_qwen3, tiny_hf_llama, tmp_path):
    experts = dict(lora_layers="all", p_adapter_layers="all", max_seq_len=64)
    qwen, llama = load_base_model(tiny_qwen3, **experts), load_base_model(tiny_hf_llama, **experts)
    save_adapter(qwen, str(tmp_path / "qwen"))
    saved = json.loads((tmp_path / "qwen" / "adapter_params.json").read_text())
    assert {k: saved[k] for k in ("architecture", "head_dim", "ffn_dim", "qk_norm", "tied_embeddings")} == \
        {"architecture": "qwen3", "head_dim": 32, "ffn_dim": 160, "qk_norm": True, "tied_embeddings": True}
    with pytest.raises(CheckpointError, match=r"adapter_params.json: adapter from another configuration: "
                                              r"architecture: adapter has 'qwen3', model has 'llama'"):
        load_adapter(llama, str(tmp_path / "qwen"))
    with pytest.raises(CheckpointError, match=r"an adapter of a qwen3 base has no form in the authors' LLaMA3 code"):
        export_authors_adapter(str(tmp_path / "qwen"), str(tmp_path / "theirs" / "adapter.pth"))
    assert not (tmp_path / "theirs").exists()
    save_adapter(llama, str(tmp_path / "llama"))  # an HF LLaMA's adapter has the authors' form
    export_authors_adapter(str(tmp_path / "llama"), str(tmp_path / "theirs" / "adapter.pth"))
    assert sorted(load_pth(tmp_path / "theirs" / "adapter.pth")) == sorted(llama.adapter_parameters())
