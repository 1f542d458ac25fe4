"""Exported adapters in transformers and peft give our numbers, and peft's adapters give peft's numbers here.

The torch side runs in another python: $MOA_HF_PYTHON, a venv with torch, transformers and peft (the project's
venv has no torch), which runs tests/hf_reference.py once for every case:

    python3 -m venv ~/.venvs/moa-export && ~/.venvs/moa-export/bin/pip install torch "numpy<2" &&
    ~/.venvs/moa-export/bin/pip install transformers safetensors tokenizers peft
    ~/.venvs/moa-export/bin/pip install lm-eval "datasets<5" "pyarrow<20"   # the lm-eval test; else it skips
    MOA_HF_PYTHON=~/.venvs/moa-export/bin/python bash test.sh tests/test_export_hf_reference.py

Without it every test here skips, saying so. The bases are transformers' own tiny checkpoints of
../shared/golden/hf (LLaMA-3.1 style and Qwen3, bf16 files) and an fp32 LLaMA folder written here; each adapter
has random tensors N(0, 0.2^2) (LoRA B nonzero), so every expert and router moves the logits (each test checks that it
does). Compared in fp32, to 1e-4: the whole sequence's logits, the KV-cache path (a prefill, then one token a
step), generate()'s greedy tokens against ours (Models/generate.py) and its logits at each step.
"""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SHARED, edited_base
from tiny_models import kv_logits, max_abs, randomize_adapters

import jittor as jt

TOLERANCE = 1e-4
PREFILL, NEW_TOKENS = 5, 6
ALL_TARGETS = "Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN"
LORA = dict(method="moe", expert_num=1, lora_layers="0-2", lora_targets=ALL_TARGETS)
SPARSE = dict(method="moa", variant="sparse", lora_layers="0-2", p_adapter_layers="0-2", swi_x=2)
SOFT = dict(method="moa", variant="soft", lora_layers="0-2", p_adapter_layers="0-2", prompt_layers="0-2", swi_x=2,
            lora_targets=ALL_TARGETS)
# case -> (base, our adapter's settings): every method on some base, the paper's two on every base
CASES = {
    "lora-llama": ("llama31_tiny", LORA), "lora-qwen3": ("qwen3_tiny", {**LORA, "lora_layers": "1-2",
                                                                       "lora_targets": "Q,K,FFN_DOWN"}),
    "lora-fp32": ("fp32_llama", LORA),
    "sparse-llama": ("llama31_tiny", SPARSE), "sparse-qwen3": ("qwen3_tiny", SPARSE),
    "sparse-fp32": ("fp32_llama", {**SPARSE, "swi_x": 0, "const_threshold": True}),
    "soft-llama": ("llama31_tiny", SOFT), "soft-qwen3": ("qwen3_tiny", SOFT), "soft-fp32": ("fp32_llama", SOFT),
    "moe-mixture-qwen3": ("qwen3_tiny", dict(method="moe", expert_num=2, hydra_moe=True, lora_layers="0-2",
                                             prompt_layers="0-1", p_adapter_layers="1-2")),
    "moe-prompt-llama": ("llama31_tiny", dict(method="moe", expert_num=1, lora_layers="0-1", prompt_layers="0-2",
                                              p_adapter_layers="0-2")),
    "topk-llama": ("llama31_tiny", dict(method="topk", expert_num=3, top_k=2, lora_layers="0-2")),
    "adamole-qwen3": ("qwen3_tiny", dict(method="adamole", expert_num=3, lora_layers="0-2")),
    "instance-llama": ("llama31_tiny", dict(method="instance", variant="soft", lora_layers="0-2", prompt_layers="0-2",
                                            p_adapter_layers="0-2", swi_x=2)),
    "unipeft-qwen3": ("qwen3_tiny", dict(method="unipeft", variant="soft", lora_layers="0-2", prompt_layers="0-2",
                                         p_adapter_layers="0-2")),
}
# peft adapters made by peft (random A and B) that load here: case -> (base, LoraConfig fields)
PEFT_IMPORTS = {
    "peft-llama": ("llama31_tiny", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"])),
    "peft-qwen3-rslora": ("qwen3_tiny", dict(r=2, lora_alpha=3, use_rslora=True, lora_dropout=0.1,
                                             target_modules=["q_proj", "k_proj", "down_proj"], layers_to_transform=[1])),
}


def reference_python():
    python = os.environ.get("MOA_HF_PYTHON")
    if not python:
        pytest.skip("set MOA_HF_PYTHON to a python with torch, transformers and peft (tests/test_export_hf_reference.py "
                    "says how): the project's venv has no torch")
    probe = subprocess.run([python, "-c", "import torch, transformers, peft, safetensors"], capture_output=True,
                           text=True)
    if probe.returncode:
        pytest.skip(f"MOA_HF_PYTHON={python} cannot import torch, transformers, peft: {probe.stderr.strip()[-200:]}")
    return python


def base_folder(name, work):
    """A golden transformers checkpoint (bf16 files), or the fp32 LLaMA folder written here."""
    if name != "fp32_llama":
        path = SHARED / "golden" / "hf" / name
        if not path.is_dir():
            pytest.skip(f"needs {path} (the read-only ../shared folder beside the clone), which is absent")
        return str(path), np.load(SHARED / "golden" / "hf" / f"{name}.npz")["tokens"]
    from Data.tiny_base import random_base_weights
    from Models.formats.hf import write_hf_base
    from Models.ModelArgs import ModelArgs
    folder = work / "fp32_llama"
    if not folder.is_dir():
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=96, vocab_size=96, norm_eps=1e-5,
                         rope_theta=10000.0)
        write_hf_base(str(folder), args, random_base_weights(args, seed=3))
    tokens = np.random.default_rng(4).integers(1, 96, (2, 12))
    return str(folder), tokens


def our_side(base, settings, tokens, work, name):
    """Our model with a random adapter: saved, exported, and our logits, cached logits and greedy tokens."""
    import export_hf
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import base_args, build_model
    from Models.generate import generate
    args = base_args(base, max_seq_len=32, precision="fp32", lora_rank=4, p_adapter_size=8, **settings)
    model = build_model(base, args)
    randomize_adapters(model, seed=len(name), scale=0.2)
    model.eval()
    save_adapter(model, str(work / name / "adapter"))
    assert export_hf.main([str(work / name / "adapter"), str(work / name / "export"), "--base", base]) is None
    stub = type("Stops", (), {"stop_tokens": set(), "n_words": None})()  # every row a token, as transformers picks
    generated = np.array(generate(model, stub, tokens[:, :PREFILL].tolist(), NEW_TOKENS))
    full = np.concatenate([tokens[:, :PREFILL], generated], 1)
    return {"logits": model.llama(jt.array(tokens.astype(np.int32))).numpy(),
            "kv_logits": kv_logits(model.llama, tokens.astype(np.int32), PREFILL), "generated": generated,
            # through the cache, as generate() computes them: per-sequence routers decide on the prefill
            "generated_logits": kv_logits(model.llama, full.astype(np.int32), PREFILL)[:, :NEW_TOKENS]}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """{case: (ours, transformers')} for every case, the torch side run once for all."""
    python = reference_python()
    sys.path.insert(0, str(REPO / "scripts"))
    work = tmp_path_factory.mktemp("export_hf_reference")
    jobs, ours = [], {}
    for name, (base_name, settings) in CASES.items():
        base, tokens = base_folder(base_name, work)
        np.save(work / f"{name}.tokens.npy", tokens)
        ours[name] = our_side(base, settings, tokens, work, name)
        kind = "peft" if os.path.isfile(work / name / "export" / "adapter_config.json") else "remote"
        jobs.append({"kind": kind, "base": base, "folder": str(work / name / "export"), "out": str(work / f"{name}.npz"),
                     "tokens": str(work / f"{name}.tokens.npy"), "prefill": PREFILL, "new_tokens": NEW_TOKENS})
    for name, (base_name, lora) in PEFT_IMPORTS.items():
        base, tokens = base_folder(base_name, work)
        np.save(work / f"{name}.tokens.npy", tokens)
        jobs.append({"kind": "make_peft", "base": base, "folder": str(work / name), "lora": lora, "seed": len(name),
                     "out": str(work / f"{name}.npz"), "tokens": str(work / f"{name}.tokens.npy")})
    (work / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([python, str(REPO / "tests" / "hf_reference.py"), str(work / "jobs.json")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = {job["out"]: dict(np.load(job["out"])) for job in jobs}
    return work, {name: (ours.get(name), theirs[str(work / f"{name}.npz")]) for name in [*CASES, *PEFT_IMPORTS]}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_adapter_gives_our_logits_in_transformers(compared, case):
    work, results = compared
    ours, theirs = results[case]
    assert max_abs(theirs["logits"], theirs["base_logits"]) > 0.5, "the adapter changes nothing: a vacuous check"
    print(f"{case}: logits {max_abs(ours['logits'], theirs['logits']):.2e}, "
          f"kv {max_abs(ours['kv_logits'], theirs['kv_logits']):.2e}, "
          f"generate {max_abs(ours['generated_logits'], theirs['generated_logits']):.2e}")
    assert max_abs(ours["logits"], theirs["logits"]) < TOLERANCE
    assert max_abs(ours["kv_logits"], theirs["kv_logits"]) < TOLERANCE
    np.testing.assert_array_equal(ours["generated"], theirs["generated"])
    assert max_abs(ours["generated_logits"], theirs["generated_logits"]) < TOLERANCE


@pytest.mark.parametrize("case", list(PEFT_IMPORTS))
def test_peft_adapter_loads_here_with_peft_logits(compared, case):
    from Models.formats.adapters import load_adapter, read_adapter_config
    from Models.formats.base_model import base_args, build_model
    work, results = compared
    theirs = results[case][1]
    base, tokens = base_folder(PEFT_IMPORTS[case][0], work)
    folder = str(work / case)
    model = build_model(base, base_args(base, max_seq_len=32, precision="fp32", **read_adapter_config(folder)))
    load_adapter(model, folder)
    logits = model.llama(jt.array(tokens.astype(np.int32))).numpy()
    assert max_abs(theirs["logits"], theirs["base_logits"]) > 0.5, "peft's adapter changes nothing: a vacuous check"
    print(f"{case}: logits {max_abs(logits, theirs['logits']):.2e}")
    assert max_abs(logits, theirs["logits"]) < TOLERANCE


# a base folder's own code, named by its config.json's auto_map: it leaves a mark if it ever runs
BASE_CODE = """
import pathlib
pathlib.Path(__file__).with_name("CODE_RAN").write_text("ran")
from transformers import Qwen3Config, Qwen3ForCausalLM
class OwnConfig(Qwen3Config):
    pass
class OwnForCausalLM(Qwen3ForCausalLM):
    config_class = OwnConfig
"""
LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)
print(type(model).__name__, float(model(torch.tensor([[1, 2, 3]])).logits.abs().sum()))
"""


def test_the_exported_folder_runs_no_code_of_its_base(tmp_path):
    """trust_remote_code=True is given for the exported folder's code alone: a base whose config.json names code
    of its own (auto_map; export_hf.py refuses such a base, but the folder may name another copy of it later) is
    loaded by transformers' Qwen3ForCausalLM, its code never run."""
    python = reference_python()
    sys.path.insert(0, str(REPO / "scripts"))
    import export_hf
    from Data.tiny_base import write_random_hf_base
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import base_args, build_model
    base = write_random_hf_base(str(tmp_path / "base"), "qwen3", head_dim=32, vocab_size=512)
    own = edited_base(base, tmp_path / "own", "config.json",
                      auto_map={"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnForCausalLM"})
    (tmp_path / "own" / "own_code.py").write_text(BASE_CODE)
    model = build_model(base, base_args(base, max_seq_len=32, lora_rank=4, lora_layers="0-2", p_adapter_layers="0-2"))
    randomize_adapters(model, seed=1, scale=0.2)
    save_adapter(model, str(tmp_path / "adapter"))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "export"), "--base", base, "--base_ref", own]) \
        is None
    loaded = subprocess.run([python, "-c", LOAD, str(tmp_path / "export")], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[0] == "Qwen3ForCausalLM" and float(loaded.stdout.split()[1]) > 0
    assert not (tmp_path / "own" / "CODE_RAN").exists()


TOKENIZE = """
import json, sys
import transformers
from transformers import AutoConfig, AutoTokenizer
transformers.logging.set_verbosity_error()
text = "12 + 30 = 42. The answer is 42."
exported, base = AutoTokenizer.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2])
trusted = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
print(json.dumps({"ids": exported(text).input_ids, "base_ids": base(text).input_ids,
                  "config": type(trusted).__name__, "precision": trusted.moa.get("trained_precision")}))
"""


def test_the_exported_tokenizer_loads_without_trust_remote_code(tiny_hf_llama, tmp_path):
    """AutoTokenizer on the exported folder, as on its base, with no trust_remote_code: no prompt (stdin closed,
    as a script's), the base's token ids; the folder's config is still MoAConfig where its code is trusted."""
    python = reference_python()
    sys.path.insert(0, str(REPO / "scripts"))
    import export_hf
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import base_args, build_model
    model = build_model(tiny_hf_llama, base_args(tiny_hf_llama, max_seq_len=32, lora_rank=4, lora_layers="0-2",
                                                 p_adapter_layers="0-2", swi_x=2))
    save_adapter(model, str(tmp_path / "adapter"))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "export"), "--base", tiny_hf_llama]) is None
    done = subprocess.run([python, "-c", TOKENIZE, str(tmp_path / "export"), tiny_hf_llama], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trust_remote_code" not in done.stdout + done.stderr and "custom code" not in done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["ids"] == found["base_ids"] and len(found["ids"]) > 5
    assert (found["config"], found["precision"]) == ("MoAConfig", "fp32")


def test_lm_eval_scores_an_exported_adapter_on_the_readmes_local_task(tiny_hf_llama, tmp_path):
    """docs/lm_eval_math.yaml, its data file pointed at 4 synthetic problems, run by lm-eval offline through an
    exported folder (where MOA_HF_PYTHON has lm_eval): every problem scored, each prompt the Alpaca prompt the
    tools train and score with."""
    python = reference_python()
    if subprocess.run([python, "-c", "import lm_eval"], capture_output=True).returncode:
        pytest.skip(f"MOA_HF_PYTHON={python} has no lm_eval (pip install lm-eval)")
    sys.path.insert(0, str(REPO / "scripts"))
    import export_hf
    from Data.prompts import format_prompt
    from Data.synthetic import make_splits
    from Models.formats.adapters import save_adapter
    from Models.formats.base_model import base_args, build_model
    model = build_model(tiny_hf_llama, base_args(tiny_hf_llama, max_seq_len=32, lora_rank=4, lora_layers="0-2",
                                                 p_adapter_layers="0-2", swi_x=2))
    save_adapter(model, str(tmp_path / "adapter"))
    assert export_hf.main([str(tmp_path / "adapter"), str(tmp_path / "export"), "--base", tiny_hf_llama]) is None
    problems = make_splits(4, 0, 4, seed=7)[2]
    (tmp_path / "test.json").write_text(json.dumps(problems))
    (tmp_path / "tasks").mkdir()
    task = (REPO / "docs" / "lm_eval_math.yaml").read_text()
    assert "    test: test.json\n" in task
    (tmp_path / "tasks" / "moa_math_local.yaml").write_text(task.replace("test: test.json",
                                                                        f"test: {tmp_path}/test.json"))
    command = [python, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'export'},"
               "trust_remote_code=True,dtype=float32", "--include_path", str(tmp_path / "tasks"), "--tasks",
               "moa_math_local", "--batch_size", "2", "--gen_kwargs", "max_gen_toks=8", "--output_path",
               str(tmp_path / "results"), "--log_samples"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    assert results["n-samples"]["moa_math_local"] == {"original": 4, "effective": 4}
    assert 0 <= results["results"]["moa_math_local"]["exact_match,answer"] <= 1
    samples = [json.loads(line) for line in next((tmp_path / "results").rglob("samples_*.jsonl")).read_text()
               .splitlines() if line]
    assert sorted(s["arguments"]["gen_args_0"]["arg_0"] for s in samples) == sorted(map(format_prompt, problems))
    assert sorted(s["target"] for s in samples) == sorted(p["answer"] for p in problems)


# where peft puts LoRA: every combination of these, on every module of a 3-layer Qwen3-shaped base
SELECTIONS = {
    "target_modules": [["q_proj", "v_proj"], ["q_proj", "down_proj", "lm_head"], ["model.layers.1.self_attn.q_proj",
                       "up_proj"], ["self_attn.q_proj", "mlp"], r".*\.(q|k)_proj", r"model\.layers\.[01]\..*_proj",
                       "q_proj", ".*", ["embed_tokens", "o_proj"], ["q_norm", "k_proj"]],
    "layers_to_transform": [None, [], [1], 2, [0, 2, 7]],
    "layers_pattern": [None, [], "layers", ["h", "layers"], "model.layers", "model", "lay.rs"],
    "exclude_modules": [None, [], ["down_proj"], r".*\.1\..*", ["model.layers.0.self_attn.q_proj"], "lm_head"]}


def test_the_peft_reader_selects_the_modules_peft_does(tmp_path):
    """peft.check_targeting refuses exactly the configs peft's LoraConfig refuses, and peft.excluded_by puts LoRA on
    exactly the modules peft's check_target_module_exists does (the projections, the norms, the blocks, the
    embeddings, lm_head), for every combination of target_modules, layers_to_transform, layers_pattern and
    exclude_modules in SELECTIONS: a peft folder loads here only as peft applies it."""
    from Models.formats import CheckpointError, peft
    from Models.ModelArgs import ModelArgs
    python = reference_python()
    base = ModelArgs(n_layers=3, qk_norm=True)
    keys = [peft.module_key(layer, t) for layer in range(3) for t in peft.TARGETS] + peft.other_modules(base)
    configs = [dict(zip(SELECTIONS, values)) for values in itertools.product(*SELECTIONS.values())]
    job = {"kind": "select", "configs": configs, "keys": keys, "out": str(tmp_path / "select.npz")}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    run = subprocess.run([python, str(REPO / "tests" / "hf_reference.py"), str(tmp_path / "jobs.json")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = np.load(job["out"])
    assert 0 < theirs["taken"].sum() < len(configs) and 0 < theirs["chosen"].sum() < theirs["chosen"].size
    for config, taken, chosen in zip(configs, theirs["taken"], theirs["chosen"]):
        try:
            peft.check_targeting(config, "adapter_config.json")
        except CheckpointError:
            assert not taken, config
            continue
        assert taken, config
        assert [peft.excluded_by(config, key) is None for key in keys] == chosen.tolist(), config
