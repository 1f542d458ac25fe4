"""The GPU's CUDA sources, checked on a machine without a GPU: the exact sources the code gives jt.code (recorded as
it runs on the CPU) compile with nvcc where it is installed, placed as Jittor's code op places them (the header,
then the source as a function body with in<i>, in<i>_p, out<i>_p and `data`); and the decode layer's, run on the
CPU through an emulation of the CUDA it uses (tests/cuda_emulation.h), equals the plain layer. A GPU runs the same
comparisons for real (scripts/gpu_check.sh)."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tiny_models import DECODE_EXPERTS, MIXTURES, kv_logits, randomize_adapters
import jittor as jt
from Data.tiny_base import write_random_hf_base
from Models import LLM
from Models.formats.base_model import base_args, build_model
from Models.kernels import cpp
from Models.kernels.bf16 import to_bf16
from Models.kernels.precision import set_base_precision

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C_TYPES = {"float32": "float", "float64": "double", "uint64": "uint64_t", "bfloat16": "__nv_bfloat16"}  # Jittor's
EMULATION = open(os.path.join(REPO, "tests", "cuda_emulation.h")).read()
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) on this machine")
pytestmark = pytest.mark.skipif(not LLM.layer_step.on(),
                                reason="the fused ops these sources belong to are not built here (no libdnnl)")


@pytest.fixture
def cuda_sources(monkeypatch):
    """{(cuda_header, cuda_src): (inputs, output C types)} of the jt.code calls made meanwhile, each also run."""
    sources = {}
    code = jt.code

    def recorded(shapes, dtypes, inputs, **kwargs):
        if "cuda_src" in kwargs:
            types = [C_TYPES[d] for d in (dtypes if isinstance(dtypes, list) else [dtypes])]
            sources[cpp.expanded(kwargs["cuda_header"]), cpp.expanded(kwargs["cuda_src"])] = len(inputs), types
        return code(shapes, dtypes, inputs, **kwargs)
    monkeypatch.setattr(jt, "code", recorded)
    return sources


def assert_nvcc_compiles(sources: dict, folder):
    """Each header's sources as one translation unit, compiled for an H100 (sm_90)."""
    for n, header in enumerate({header for header, _ in sources}):
        program = [header, "#include <string>\n#include <unordered_map>\n#include <cuda_bf16.h>\n"
                           "struct VarInfo { int64_t size, num; };\n"]
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


@needs_nvcc
def test_decode_layer_sources_compile(cuda_sources, tiny_base, tiny_qwen3, tmp_path):
    """The decode layer's CUDA form (Models/kernels/cuda/) for LLaMA Sparse with a bf16 base and cache, and Qwen3
    Soft with a prompt expert in fp32, UniPEFT's gates given, AdaMoLE's mixtures gated in the op: its numbers are
    tests/test_decode_layer.py::test_decode_layer_equals_op_by_op's on a GPU."""
    for path, precision, variant in ((tiny_base, "bf16", "sparse"), (tiny_qwen3, "fp32", "soft"),
                                     (tiny_qwen3, "fp32", "unipeft"), (tiny_base, "bf16", "adamole")):
        model = build_model(path, base_args(path, max_seq_len=16, max_batch_size=2, **DECODE_EXPERTS[variant]))
        set_base_precision(model, precision)
        model.eval()
        with jt.no_grad():
            kv_logits(model.llama, np.ones((2, 3), np.int32), prefill=2)
    assert len(cuda_sources) >= 8, "each model's two ops"
    assert_nvcc_compiles(cuda_sources, tmp_path)


@needs_nvcc
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


def emulated(cuda: str) -> str:
    """A CUDA source as tests/cuda_emulation.h runs it on the CPU: launches and dynamic shared memory rewritten."""
    text = cuda.replace("#include <cuda_runtime.h>\n", "")
    text = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1 *\2 = (\1 *)emu_dynamic_shared();", text)
    return re.sub(r"(\b\w+(?:<[^<>;()]*>)?)<<<(.*?)>>>\(", r"emu_launch(emu_config(\2), \1, ", text)


@pytest.fixture(scope="module")
def odd_qwen3(tmp_path_factory):
    """A random Qwen3 whose sizes take the kernels' general paths: K % 8 != 0 (dim 36, FFN 44: a row of
    weights read one element at a time) and head_dim 260 (not a multiple of 8, and above the 256 elements
    one pass over the values covers)."""
    return write_random_hf_base(str(tmp_path_factory.mktemp("odd_qwen3")), "qwen3", dim=36, n_heads=2, n_kv_heads=1,
                                head_dim=260, ffn_dim=44)


# floats of x staged per product_rows chunk in the emulation (8192 on a GPU): rows of 16 take chunks of 48, rows of
# 32 chunks of 24, so that K = 64 and 256 end in a partial one
STAGED = 768


# (id, arch, variant, precision, rows a step, router settings)
DECODE_CASES = [("llama-sparse-bf16", "llama", "sparse", "bf16", 12, {}),
                ("qwen3-soft-fp32", "qwen3", "soft", "fp32", 2, {}),
                ("llama-soft-int8", "llama", "soft", "int8", 2, {}),
                ("llama-sparse-linear-router", "llama", "sparse", "fp32", 3, dict(swi_x=0, const_threshold=True)),
                ("llama-lora-fp32", "llama", "lora", "fp32", 3, {}),
                ("qwen3-unipeft-bf16", "qwen3", "unipeft", "bf16", 2, {}),
                ("odd-qwen3-soft-fp32", "odd", "soft", "fp32", 2, {}),
                ("llama-topk-fp32", "llama", "topk", "fp32", 3, {}),
                ("qwen3-adamole-bf16", "qwen3", "adamole", "bf16", 2, {}),
                ("llama-hydralora-fp32", "llama", "hydralora", "fp32", 2, {}),
                ("llama-moa-experts-fp32", "llama", "moa_experts", "fp32", 3, {}),
                ("qwen3-prompt-adapter-moe-bf16", "qwen3", "prompt_adapter_moe", "bf16", 2, {})]
# in the reverse order too: two passes of rows, the SwiGLU router and Gamma; the prompt and per-head norms; the general
# paths. The others' kernels have the same barriers (a barrier removed from product_rows' staging fails all seven cases
# that ran reversed) or none (the mixtures' gates, a thread per row)
REVERSED = {"llama-sparse-bf16", "qwen3-soft-fp32", "odd-qwen3-soft-fp32"}
ORDERED_CASES = [pytest.param(*case[1:], order, id=f"{case[0]}-{order}") for case in DECODE_CASES
                 for order in (("forward", "reversed") if case[0] in REVERSED else ("forward",))]


@pytest.mark.parametrize("arch, variant, precision, batch, router, order", ORDERED_CASES)
def test_decode_layer_cuda_form_equals_the_plain_layer(monkeypatch, tiny_base, tiny_qwen3, odd_qwen3, arch, variant,
                                                       precision, batch, router, order):
    """The decode layer's CUDA form (Models/kernels/cuda/), emulated on the CPU, against the plain layer through
    the KV cache, as tests/test_decode_layer.py::test_decode_layer_equals_op_by_op compares the CPU form: a prefill of 3
    positions, then steps; LLaMA Sparse with a bf16 base and cache at 12 rows a step (36 in the prefill: two
    passes of product_rows, 32 rows and 4), Qwen3 Soft (per-head norms, a prompt expert) in fp32 at 2 (6 in the
    prefill), LLaMA Soft with an int8 base, LLaMA Sparse with a Linear type router and a constant Gamma, and two
    baselines: LoRA (experts of weight 1) and UniPEFT on Qwen3 (gates given per sequence, one for every LoRA), the
    mixtures of LoRA experts top-k, AdaMoLE and HydraLoRA, MoA's three experts a family, and the prompt and adapter
    MoE (gated per row in the ops), and
    Soft on a Qwen3 of sizes no real model has, for the kernels' general paths (odd_qwen3). Each with the
    emulation's threads and blocks in index order, and three (REVERSED) in the reverse order, so that a missing barrier
    (a race on a GPU) gives other numbers in one of the two; x is staged STAGED floats at a time, so that these
    sizes take several chunks of K, the last one partial, as 8B's do."""
    code = jt.code
    emulations = []

    def emulating(shapes, dtypes, inputs, **kwargs):
        if "cuda_src" in kwargs:
            emulations.append(1)
            header, staged = re.subn(r"\bSTAGED = \d+;", f"STAGED = {STAGED};",
                                     emulated(cpp.expanded(kwargs["cuda_header"])))
            assert staged == 1, "products.cuh's STAGED"
            header = f"#define EMU_REVERSED {int(order == 'reversed')}\n" + EMULATION + header
            kwargs.update(cpu_header=header, cpu_src=emulated(cpp.expanded(kwargs["cuda_src"])))
        return code(shapes, dtypes, inputs, **kwargs)
    path = {"llama": tiny_base, "qwen3": tiny_qwen3, "odd": odd_qwen3}[arch]
    model = build_model(path, base_args(path, max_seq_len=16, max_batch_size=batch, **DECODE_EXPERTS[variant],
                                        **router))
    randomize_adapters(model, seed=5, scale=0.1)
    rng = np.random.default_rng(4)
    for name, var in model.base_parameters().items():  # Qwen3's per-head norms, drawn so that they matter
        if "q_norm" in name or "k_norm" in name:
            var.assign(jt.array((1 + 0.5 * rng.standard_normal(var.shape)).astype(np.float32)))
    for layer in model.llama.layers:  # Sparse: types far below and above Gamma, whose learned bias matters
        if layer.adapter_threshold_fn is not None:
            router = layer.adapter_type_router
            types = (router.w2 if hasattr(router, "w2") else router).bias
            types.assign(jt.array(np.where(np.arange(types.shape[0]) % 2 == 0, 2.5, -2.5).astype(np.float32)))
            if not layer.adapter_threshold_fn.const:
                layer.adapter_threshold_fn.bias.assign(jt.array([1.0], dtype="float32"))
    set_base_precision(model, precision)
    model.eval()
    tokens = rng.integers(1, model.llama.args.vocab_size, (batch, 6)).astype(np.int32)

    def logits_and_routing():
        logits = kv_logits(model.llama, tokens, prefill=3)
        model.llama.reset_cache()
        records = []
        model.llama(jt.array(tokens[:, :3]), start_pos=0, records=records)  # the prefill's type weights and Gammas
        return logits, [r[key].numpy() for r in records for key in ("type_weight", "threshold") if r[key] is not None]
    with jt.no_grad():
        monkeypatch.setattr(jt, "code", emulating)
        got, got_routing = logits_and_routing()
        # two ops a layer, the prefill, 3 steps and the recorded prefill (op by op for mixtures: records)
        assert len(emulations) == 2 * (4 if variant in MIXTURES else 5) * len(model.llama.layers)
        monkeypatch.setattr(LLM.layer_step, "when", lambda *a: False)
        want, want_routing = logits_and_routing()
    tolerance = 2e-5 if precision == "fp32" else 2e-2
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=tolerance)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95
    routed = ("sparse", "soft", "instance", "unipeft", "moa_experts")
    routed_layers = len(model.llama.layers) if variant in routed else 0
    assert len(got_routing) == len(want_routing) == routed_layers * (2 if variant == "sparse" else 1)
    for ours, plain in zip(got_routing, want_routing):
        np.testing.assert_allclose(ours, plain, atol=tolerance)
    if variant == "sparse":  # Gamma switched types off and left others on
        weights = np.concatenate(want_routing[::2])
        assert (weights == 0).any() and (weights > 0.5).any()
