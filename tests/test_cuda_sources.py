"""The GPU's CUDA sources (Models/kernels/cuda/), checked on a machine without a GPU: compiled by nvcc where it is
installed. What they compute is checked on a GPU (scripts/gpu_check.sh runs the step-by-step comparisons)."""
import shutil
import subprocess

import numpy as np
import pytest

from conftest import kv_logits
import jittor as jt
from Models import LLM
from Models.formats.base_model import base_args, build_model
from Models.kernels.precision import set_base_precision

# a Sparse MoA with LoRA on every target and the parallel adapter; a Soft one with prompt experts besides
SPARSE = dict(variant="sparse", lora_layers="0-2", p_adapter_layers="0-2", lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN")
SOFT = dict(variant="soft", lora_layers="0-2", p_adapter_layers="0-1", prompt_layers="1-2")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.skipif(not LLM.layer_step.on(), reason="the decode layer's ops are not built here (a CPU without libdnnl)")
def test_decode_layer_sources_compile(monkeypatch, tiny_base, tiny_qwen3, tmp_path):
    """The GPU form of the decode layer (cuda/decode_layer.cuh, layer_input.cu, layer_output.cu), checked where
    no GPU runs it: the CUDA sources the model gives jt.code for a decode step (LLaMA Sparse with a bf16 base
    and cache, Qwen3 Soft with a prompt expert in fp32) compile with nvcc, placed as Jittor's code op places
    them (the header, then the source as a function body with typed in<i>_p/out<i>_p and `data`). Their
    numbers are checked on a GPU by tests/test_infer.py::test_decode_layer_equals_op_by_op."""
    sources = {}
    code = jt.code

    def recorded(shapes, dtypes, inputs, **kwargs):
        if "cuda_src" in kwargs:
            sources[kwargs["cuda_header"], kwargs["cuda_src"]] = len(inputs), len(dtypes)
        return code(shapes, dtypes, inputs, **kwargs)
    monkeypatch.setattr(jt, "code", recorded)
    for path, precision, experts in ((tiny_base, "bf16", SPARSE), (tiny_qwen3, "fp32", SOFT)):
        model = build_model(path, base_args(path, max_seq_len=16, max_batch_size=2, **experts))
        set_base_precision(model, precision)
        model.eval()
        with jt.no_grad():
            kv_logits(model.llama, np.ones((2, 3), np.int32), prefill=2)
    assert len(sources) >= 4, "each model's two ops"
    headers = {header for header, _ in sources}
    assert len(headers) == 1
    program = [headers.pop(), "#include <string>\n#include <unordered_map>\n"]
    for i, ((_, src), (n_in, n_out)) in enumerate(sources.items()):
        pointers = [f"void *in{j}_p" for j in range(n_in)] + [f"float *out{j}_p" for j in range(n_out)]
        program.append(f"void op{i}({', '.join(pointers)}, std::unordered_map<std::string, double> &data) {{\n"
                       f"{src}\n}}\n")
    (tmp_path / "decode_layer.cu").write_text("\n".join(program))
    compiled = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", "decode_layer.cu", "-o", "decode_layer.o"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
