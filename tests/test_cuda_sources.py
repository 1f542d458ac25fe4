"""The GPU's CUDA sources, checked on a machine without a GPU: the exact sources the code gives jt.code (recorded as
it runs on the CPU) compile with nvcc where it is installed, placed as Jittor's code op places them (the header,
then the source as a function body with in<i>, in<i>_p, out<i>_p and `data`). What they compute is checked on a
GPU (scripts/gpu_check.sh runs the step-by-step comparisons)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import kv_logits
import jittor as jt
from Models import LLM
from Models.formats.base_model import base_args, build_model
from Models.kernels.precision import set_base_precision, to_bf16

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a Sparse MoA with LoRA on every target and the parallel adapter; a Soft one with prompt experts besides
SPARSE = dict(variant="sparse", lora_layers="0-2", p_adapter_layers="0-2", lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN")
SOFT = dict(variant="soft", lora_layers="0-2", p_adapter_layers="0-1", prompt_layers="1-2")
C_TYPES = {"float32": "float", "float64": "double", "uint64": "uint64_t"}
pytestmark = [pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) on this machine"),
              pytest.mark.skipif(not LLM.layer_step.on(),
                                 reason="the fused ops these sources belong to are not built here (no libdnnl)")]


@pytest.fixture
def cuda_sources(monkeypatch):
    """{(cuda_header, cuda_src): (inputs, output C types)} of the jt.code calls made meanwhile, each also run."""
    sources = {}
    code = jt.code

    def recorded(shapes, dtypes, inputs, **kwargs):
        if "cuda_src" in kwargs:
            types = [C_TYPES[d] for d in (dtypes if isinstance(dtypes, list) else [dtypes])]
            sources[kwargs["cuda_header"], kwargs["cuda_src"]] = len(inputs), types
        return code(shapes, dtypes, inputs, **kwargs)
    monkeypatch.setattr(jt, "code", recorded)
    return sources


def assert_nvcc_compiles(sources: dict, folder):
    """Each header's sources as one translation unit, compiled for an H100 (sm_90)."""
    for n, header in enumerate({header for header, _ in sources}):
        program = [header, "#include <string>\n#include <unordered_map>\nstruct VarInfo { int64_t size, num; };\n"]
        for i, ((_, src), (n_in, out_types)) in enumerate((key, value) for key, value in sources.items()
                                                          if key[0] == header):
            operands = [f"VarInfo *in{j}, void *in{j}_p" for j in range(n_in)]
            operands += [f"{ctype} *out{j}_p" for j, ctype in enumerate(out_types)]
            program.append(f"void op{i}({', '.join(operands)}, std::unordered_map<std::string, double> &data) {{\n"
                           f"{src}\n}}\n")
        name = f"unit{n}.cu"
        (folder / name).write_text("\n".join(program))
        compiled = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", name, "-o", f"unit{n}.o"], cwd=folder,
                                  capture_output=True, text=True, timeout=600)
        assert compiled.returncode == 0, compiled.stderr[-4000:]


def test_decode_layer_sources_compile(cuda_sources, tiny_base, tiny_qwen3, tmp_path):
    """The decode layer's CUDA form (Models/kernels/cuda/) for LLaMA Sparse with a bf16 base and cache, and Qwen3
    Soft with a prompt expert in fp32: its numbers are tests/test_infer.py::test_decode_layer_equals_op_by_op's
    on a GPU."""
    for path, precision, experts in ((tiny_base, "bf16", SPARSE), (tiny_qwen3, "fp32", SOFT)):
        model = build_model(path, base_args(path, max_seq_len=16, max_batch_size=2, **experts))
        set_base_precision(model, precision)
        model.eval()
        with jt.no_grad():
            kv_logits(model.llama, np.ones((2, 3), np.int32), prefill=2)
    assert len(cuda_sources) >= 4, "each model's two ops"
    assert_nvcc_compiles(cuda_sources, tmp_path)


def test_roofline_sources_compile(cuda_sources, tmp_path, monkeypatch):
    """bench/rooflines.py's GPU forms: the streaming read and the decode layer's pass timed by CUDA events."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    import rooflines
    weight = to_bf16(jt.array(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)))
    assert rooflines.stream_bandwidth([weight], runs=1) > 0
    assert rooflines.product_gflops(2, weight, None, 2, decode=True) > 0
    assert len(cuda_sources) == 2
    assert_nvcc_compiles(cuda_sources, tmp_path)
    sys.modules.pop("rooflines", None)
