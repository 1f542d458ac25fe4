"""The transformers/peft side of tests/test_export_hf_reference.py, run by the python of $MOA_HF_PYTHON (a venv with
torch, transformers, peft; never the project's venv, which has no torch):

    $MOA_HF_PYTHON tests/hf_reference.py jobs.json

jobs.json: a list of jobs, each {"kind": ..., "out": npz path, ...}:
  "peft"    {"base", "folder", "tokens", "prefill", "new_tokens"}: PeftModel.from_pretrained(base model, folder)
  "remote"  {"folder", "tokens", "prefill", "new_tokens"}: AutoModelForCausalLM.from_pretrained(folder,
            trust_remote_code=True)
  "make_peft" {"base", "folder", "tokens", "lora": LoraConfig fields, "seed"}: a peft LoRA adapter with random
            A and B (init_lora_weights=False) saved into folder, and its logits
  "select"  {"configs": LoraConfig fields each, "keys": a base's module names}: which configs LoraConfig takes
            (`taken` [C]) and, for those, which modules peft's check_target_module_exists puts LoRA on (`chosen` [C,K])
Every model is loaded in fp32. The npz holds `logits` (the whole sequence, no cache), `base_logits` (the base
alone), and for peft/remote `kv_logits` (a prefill of `prefill` tokens, then one token per step through the KV
cache: the last position of each), `generated` (generate(), greedy, new_tokens tokens from the first `prefill`
tokens) and `generated_logits` (generate()'s logits of each step).
"""
import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def base_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def cached_logits(model, tokens, prefill):
    out = model(tokens[:, :prefill], use_cache=True)
    rows, cache = [out.logits[:, -1]], out.past_key_values
    for pos in range(prefill, tokens.shape[1]):
        out = model(tokens[:, pos:pos + 1], past_key_values=cache, use_cache=True)
        rows.append(out.logits[:, -1])
        cache = out.past_key_values
    return torch.stack(rows, 1)


def greedy(model, tokens, prefill, new_tokens):
    model.generation_config.eos_token_id = None  # every step generates: compared token for token
    out = model.generate(tokens[:, :prefill], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, prefill:], torch.stack(out.logits, 1)


def run(job):
    tokens = torch.tensor(np.load(job["tokens"]))
    kind = job["kind"]
    result = {}
    with torch.no_grad():
        if kind == "make_peft":
            from peft import LoraConfig, get_peft_model
            torch.manual_seed(job["seed"])
            base = base_model(job["base"])
            result["base_logits"] = base(tokens, use_cache=False).logits
            model = get_peft_model(base, LoraConfig(init_lora_weights=False, **job["lora"])).eval()
            model.save_pretrained(job["folder"])
        elif kind == "peft":
            from peft import PeftModel
            result["base_logits"] = base_model(job["base"])(tokens, use_cache=False).logits
            model = PeftModel.from_pretrained(base_model(job["base"]), job["folder"]).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True,
                                                         dtype=torch.float32).eval()
            base = json.load(open(f"{job['folder']}/config.json"))["base_model_name_or_path"]
            result["base_logits"] = base_model(base)(tokens, use_cache=False).logits
        result["logits"] = model(tokens, use_cache=False).logits
        if kind != "make_peft":
            result["kv_logits"] = cached_logits(model, tokens, job["prefill"])
            result["generated"], result["generated_logits"] = greedy(model, tokens, job["prefill"], job["new_tokens"])
    np.savez(job["out"], **{k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in result.items()})


def select(job):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    taken, chosen = [], []
    for fields in job["configs"]:
        try:
            config = LoraConfig(**fields)
        except ValueError:
            config = None
        taken.append(config is not None)
        chosen.append([config is not None and bool(check_target_module_exists(config, key)) for key in job["keys"]])
    np.savez(job["out"], taken=np.array(taken), chosen=np.array(chosen))


def main():
    with open(sys.argv[1]) as f:
        for job in json.load(f):
            select(job) if job["kind"] == "select" else run(job)


if __name__ == "__main__":
    main()
