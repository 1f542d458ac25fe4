"""Bases, refused in one line naming the file and the tensor or field (exit 2), nothing written: a tensor holding
NaN or inf (a corrupted download) found while it streams in, a config field of the wrong kind found before anything
is computed from it, an odd in-dimension in nf4, and a base, RoPE tables, adapters or KV cache larger than the memory left found before any of
it is allocated (--batch_size auto included). A base whose finite weights overflow when computed stops the
evaluation at its first non-finite logits, naming the example (exit 3)."""
import json
import os
import shutil
import struct
import subprocess
import time

import numpy as np
import pytest
from conftest import (assert_refused, edited_base, infer_base_alone, math_argv, math_refuses, python_program,
                      squeezed_memory)

import Infer
from Models import memory
from Models.formats import CheckpointError
from Models.formats.base_model import base_args, build_model
from Models.formats.pth import load_pth
from Models.formats.pth_writer import save_pth
from Models.formats.reading import NonFiniteBase, checked_in_memory
from Models.formats.safetensors import read_header

GIB = 1 << 30


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



@pytest.mark.slow
def test_a_base_that_overflows_stops_the_evaluation_naming_the_example(tiny_base, addsub, tmp_path, capsys):
    """Weights that are finite as stored (1e38, in every precision's range) but overflow once multiplied give NaN
    logits: the evaluation stops at the first, naming the data set, the example and the precision (exit 3), and
    writes nothing, in fp32, bf16 and int8 alike."""
    weights = load_pth(f"{tiny_base}/consolidated.00.pth")
    weights["layers.1.feed_forward.w2.weight"] = weights["layers.1.feed_forward.w2.weight"].copy()
    weights["layers.1.feed_forward.w2.weight"][:, :3] = 1e38
    base = tmp_path / "overflowing"
    shutil.copytree(tiny_base, base)
    save_pth(weights, base / "consolidated.00.pth")
    for precision in ("fp32", "bf16", "int8"):
        assert_refused(capsys, lambda: infer_base_alone(str(base), tmp_path / "eval", "--data_path", addsub,
                                                        "--precision", precision),
                       "non-finite logits", "token 1 of the answer to example 0 of data set 'AddSub'", addsub,
                       f"computed in {precision}", code=3)
        assert not (tmp_path / "eval").exists()


CONFIG_CASES = [  # (file, fields, what the one line names besides the file)
    ("config.json", dict(architectures=[["Qwen3ForCausalLM"]]), "architectures [['Qwen3ForCausalLM']]"),
    ("config.json", dict(architectures=[{"name": "Qwen3ForCausalLM"}]), "architectures [{'name'"),
    ("config.json", dict(architectures=None), "architectures missing"),
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


def test_sizes_are_checked_before_anything_is_allocated(tiny_qwen3, tiny_base, synthetic_data, addsub, tmp_path,
                                                        monkeypatch, capsys):
    """With 1 GiB left (whatever the machine has): a base, RoPE tables or one row of KV cache past it is refused
    in one line naming the file or the flags, before the tables or the model are built or a token generated."""
    monkeypatch.setattr(memory, "available_memory", lambda: GIB)
    monkeypatch.setattr(Infer, "generate", no_generation)
    for i, fields in enumerate([dict(vocab_size=2**62), dict(head_dim=2**22), dict(hidden_size=2**30),
                                dict(intermediate_size=2**40), dict(num_hidden_layers=2**40)]):
        folder = edited_base(tiny_qwen3, tmp_path / f"big{i}", "config.json", **fields)
        assert_refused(capsys, lambda: infer_base_alone(folder, tmp_path / "eval", "--data_path", addsub),
                       f"{folder}/config.json: the model needs", "base weights", "more than the 1 GiB available")
    # a layer span over 2^40 layers (Math.py's default: every layer) would be built before the model; the refusal
    # names the base in the run's own precision (it once named int8, the least it sized first)
    deep = edited_base(tiny_base, tmp_path / "deep", n_layers=2**40)
    for flags, precision in [([], "fp32"), (["--precision", "bf16"], "bf16"), (["--precision", "int8"], "int8"),
                             (["--precision", "nf4"], "nf4")]:
        math_refuses(deep, synthetic_data, tmp_path / "out", capsys, flags,
                     ["params.json: the model needs", f"base weights in {precision} ", "GiB available"])
    assert_refused(capsys, lambda: infer_base_alone(deep, tmp_path / "eval", "--data_path", addsub, "--precision",
                                                    "fp32"), "params.json: the model needs", "base weights in fp32 ")
    # read for its shape alone (export, conversion: no run precision), the base is sized by the least it takes
    with pytest.raises(ValueError, match=r"params.json \(a lower bound: nf4 takes the least of any --precision\): "
                                         r"the model needs .*base weights in nf4 "):
        base_args(deep)
    # --batch_size auto (the default): the cache of its first row must fit beside the model too
    for extra, needles in [(["--max_seq_len", 200_000_000, "--max_gen_len", 16_000_000], ["RoPE tables"]),
                           (["--max_seq_len", 3_000_000, "--max_gen_len", 2_000_000],
                            ["the KV cache for --batch_size 1 x 2000", "1 GiB available"])]:
        assert_refused(capsys, lambda: Infer.main(["--no_adapter", "--llama_path", tiny_base, "--data_path", addsub,
                                                   "--output_dir", str(tmp_path / "eval"), *map(str, extra)]), *needles)
    assert not (tmp_path / "eval").exists()


def test_an_export_refuses_a_base_that_carries_code(tiny_qwen3, tmp_path, capsys):
    """A base whose config.json or tokenizer_config.json has `auto_map` names code of its own, which the exported
    folder's trust_remote_code=True would run: refused, nothing written (the same base exports without it)."""
    from Models.formats.adapters import save_adapter
    from scripts import export_hf
    save_adapter(build_model(tiny_qwen3, base_args(tiny_qwen3, max_seq_len=32, lora_rank=4, lora_layers="0-2")),
                 str(tmp_path / "adapter"))
    auto_map = {"AutoModelForCausalLM": "evil.EvilForCausalLM", "AutoTokenizer": ["evil.EvilTokenizer", None]}
    for name in ("config.json", "tokenizer_config.json"):
        base = edited_base(tiny_qwen3, tmp_path / name, name, auto_map=auto_map)
        assert_refused(capsys, lambda: export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out"), "--base",
                                                       base]), f"{base}/{name}", "auto_map")
        assert not (tmp_path / "out").exists()
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "out"), "--base", tiny_qwen3]) is None


def test_an_odd_in_dimension_is_refused_in_nf4(tiny_qwen3, synthetic_data, addsub, tmp_path, capsys):
    """nf4 packs two codes a byte: a base whose FFN width (the down projection's in-dimension) is odd is refused
    in nf4, naming the matrix, by training and evaluation alike, before anything is read or written."""
    odd = edited_base(tiny_qwen3, tmp_path / "odd", "config.json", intermediate_size=95)
    needles = ["llama.layers.0.feed_forward.w2.weight", "--precision nf4 stores two weights a byte",
               "in-dimension 95 is odd"]
    math_refuses(odd, synthetic_data, tmp_path / "out", capsys, ["--precision", "nf4"], needles)
    assert_refused(capsys, lambda: infer_base_alone(odd, tmp_path / "eval", "--data_path", addsub, "--precision",
                                                    "nf4"), *needles)
    assert not (tmp_path / "eval").exists()


ADAPTER_SHAPE = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16,
                     lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN", lora_rank=3, p_adapter_size=5, prompt_len=2)


@pytest.mark.parametrize("settings", [
    dict(lora_layers="0-3", p_adapter_layers="1-3", swi_x=2),  # Sparse MoA: type routers and Gamma
    dict(lora_layers="0-2", p_adapter_layers="1-3", swi_x=0, const_threshold=True),
    dict(variant="soft", lora_layers="0-3", prompt_layers="1-2", p_adapter_layers="0-1", expert_num=3),
    dict(variant="soft", lora_layers="0-3", prompt_layers="0-3", p_adapter_layers="0-3", expert_num=2,
         hydra_moe=True, p_adapter_hydra=True),
    dict(method="moe", lora_layers="0-3", expert_num=4, hydra_moe=True),
    dict(method="topk", lora_layers="0-3", expert_num=4, top_k=2),
    dict(method="adamole", lora_layers="1-3", expert_num=3),
    dict(method="instance", variant="soft", lora_layers="0-3", prompt_layers="0-2", p_adapter_layers="1-3"),
    dict(method="unipeft", variant="soft", lora_layers="0-1", prompt_layers="0-3", p_adapter_layers="1-3"),
])
def test_the_adapters_are_counted_as_the_model_builds_them(settings):
    """memory.adapter_parameters, which refuses adapters past the memory before any is allocated, counts exactly
    the parameters LLaMA_adapter builds, for every method and the shared-weight variants."""
    from Models.LLaMA_Adapter import LLaMA_adapter
    from Models.ModelArgs import ModelArgs
    args = ModelArgs(**{**ADAPTER_SHAPE, **settings})
    assert memory.adapter_parameters(args) == LLaMA_adapter(args).parameter_counts()["total"] > 0
    assert memory.adapter_parameters(ModelArgs(**ADAPTER_SHAPE)) == 0  # no layer has experts


def test_adapters_and_their_training_state_are_counted_before_allocation():
    """In training each adapter parameter takes 16 bytes (itself, its gradient, AdamW's two moments); a rank of 10^8
    is 10^8 * (32 + 32) parameters on one target and refused naming the adapters' flags."""
    from Models.ModelArgs import ModelArgs
    args = ModelArgs(**{**ADAPTER_SHAPE, "method": "moe", "lora_layers": "0-1", "lora_targets": "Q",
                          "lora_rank": 10**8})  # no router
    assert memory.adapter_parameters(args) == 64 * 10**8
    fixed = memory.base_bytes(args) + memory.rope_table_bytes(args)
    memory.check_memory(args, "f", available=fixed + 16 * 64 * 10**8, training=True)  # fits exactly
    memory.check_memory(args, "f", available=fixed + 4 * 64 * 10**8)  # to infer: the parameters alone
    with pytest.raises(ValueError, match=r"6,400,000,000 adapter parameters with their gradients and AdamW moments "
                                         r"95\.4 GiB.*: lower the adapters' sizes \(--lora_rank"):
        memory.check_memory(args, "f", available=fixed + 16 * 64 * 10**8 - 1, training=True)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--lora_rank", "--expert_num", "--prompt_len", "--p_adapter_size", "--swi_x"])
def test_adapters_past_the_machine_are_refused_before_anything_is_allocated(flag, tiny_base, synthetic_data, tmp_path):
    """An adapter size of 10^8 ended in a segfault or double free (exit 134), 4*10^6 in the OOM killer: now one
    line, exit 2, within seconds, the process never larger than the program itself, nothing written."""
    soft = ["--variant", "soft", "--prompt_layers", "all"] if flag == "--prompt_len" else []
    start = time.monotonic()
    with open(tmp_path / "stderr", "w+") as err:
        process = subprocess.Popen(python_program("Math.py", *math_argv(tiny_base, synthetic_data, tmp_path / "out",
                                                                         *soft, flag, 10**8)), stderr=err)
        _, status, usage = os.wait4(process.pid, 0)  # this process's own peak memory
        process.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    assert process.returncode == 2 and time.monotonic() - start < 60, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "adapter parameters with their gradients" in lines[0] and flag in lines[0], lines
    assert usage.ru_maxrss < 2 * 2**20  # KiB: under 2 GiB, where the adapters alone would take thousands
    assert not (tmp_path / "out").exists()


def test_a_size_past_64_bits_in_a_safetensors_header_is_refused(tmp_path):
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2**70], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(CheckpointError, match=f"{path}: tensor 'w': dtype BF16 and shape \\[{2**70}\\] make"):
        read_header(path)


def test_model_and_kv_cache_memory_are_counted_exactly():
    from Models.ModelArgs import ModelArgs
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=1000)
    assert memory.kv_cache_bytes(args, 8, 100_000) == 8 * 2 * 2 * 2 * 16 * 100_000 * 4 == 409_600_000
    weights = sum(int(np.prod(s)) * 4 for s in args.outer_shapes().values()) + 2 * sum(
        int(np.prod(s)) * 4 for s in args.layer_shapes().values())
    matrices = 2 * 97 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64)  # 2 kv heads of 16; FFN 176
    assert memory.base_bytes(args) == weights == 4 * (matrices + 64 + 2 * 2 * 64)
    need = weights + memory.rope_table_bytes(args) + 409_600_000
    assert memory.rope_table_bytes(args) == 4 * 2000 * 8 * 4
    memory.check_memory(args, "f", 8, 100_000, available=need)  # fits exactly
    with pytest.raises(ValueError, match=r"f: the model needs 0\.38\d GiB .*the KV cache for --batch_size 8 x 100000 "
                                         r"tokens.*more than the 0\.38\d GiB available: lower --batch_size"):
        memory.check_memory(args, "f", 8, 100_000, available=need - 1)
    bf16 = ModelArgs(**{**args.to_dict(), "precision": "bf16"})
    assert memory.base_bytes(bf16) == weights - 2 * matrices  # the norms stay fp32
    # LLaMA-3-8B's shape: 32 layers, 8 kv heads of 128; batch 8 x 8192 tokens is 16 GiB in fp32
    big = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                    ffn_dim_multiplier=1.3, precision="bf16")
    assert memory.kv_cache_bytes(ModelArgs(**{**big.to_dict(), "precision": "fp32"}), 8, 8192) == 16 * 2**30
    assert memory.base_bytes(big) == 2 * 8_030_261_248 + 2 * 4096 * 65  # 8.03 B parameters, 65 norms in fp32


def test_a_gpu_run_is_checked_against_its_gpus_memory(monkeypatch, capsys):
    """On a GPU run the base and the KV cache live on the GPU: the checks read its free memory and count the ranks
    that share one GPU (two ranks on one GPU share it; one rank a GPU does not), and a refusal says it is the GPU's.
    Where the GPU's memory cannot be read (here: no CUDA runtime), the host's, with a warning."""
    from Models.ModelArgs import ModelArgs
    assert memory.gpu_free_memory() is None and "the GPU's free memory could not be read" in capsys.readouterr().err
    host = memory.available_memory()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=1000)
    monkeypatch.setattr(memory, "on_gpu", lambda: True)
    monkeypatch.setattr(memory, "gpu_free_memory", lambda: GIB // 4)
    assert memory.available_memory() == GIB // 4
    with pytest.raises(ValueError, match=r"f: the model needs 0\.38\d GiB .*more than the 0\.25 GiB available on the "
                                         r"GPU: lower --batch_size"):
        memory.check_memory(args, "f", 8, 100_000)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    for gpus, sharing in ((1, 2), (2, 1), (4, 1)):
        monkeypatch.setattr(memory.jt.core, "get_device_count", lambda gpus=gpus: gpus)
        assert memory.ranks_sharing_memory() == sharing
    monkeypatch.setattr(memory, "gpu_free_memory", lambda: None)
    assert abs(memory.available_memory() - host) < GIB  # the host's MemAvailable, read again


def test_a_step_that_fits_only_recomputed_is_refused_with_no_recompute(tiny_base, synthetic_data, tmp_path,
                                                                       monkeypatch, capsys):
    """Where a step fits only with the layers' activations recomputed, --no-recompute is refused before the data is
    read, naming the activations and the flag that makes the step fit (without the flag Math.py recomputes:
    tests/test_recompute.py)."""
    squeezed_memory(monkeypatch)
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--no-recompute"],
                 ["params.json: the model needs", "the activations of 4 rows x 256 tokens a rank (every layer's)",
                  "use --recompute"])
