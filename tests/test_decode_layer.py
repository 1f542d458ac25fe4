"""The decode step's layer in two ops (Models/kernels/decode_layer.py) against the op-by-op layer, its plain
reference, for MoA, the baselines and the mixtures; the ops built once per KV cache; their texts given to Jittor as
included files."""
import numpy as np
import pytest

from tiny_models import DECODE_EXPERTS, fused_layer_steps, kv_logits, randomize_adapters
import jittor as jt

from Models import LLM
from Models.formats.base_model import base_args, build_model
from Models.kernels import cpp, decode_layer
from Models.kernels.precision import set_base_precision


@pytest.fixture(scope="module")
def base_dir(tiny_base):
    return tiny_base


@pytest.mark.skipif(not LLM.layer_step.on(),
                    reason="the fused decode layer is off here (a CPU without libdnnl, a GPU without MOA_GPU_KERNELS=1)")
@pytest.mark.parametrize("arch, variant, precision", [(arch, variant, precision) for arch in ("llama", "qwen3")
                                                      for variant in ("sparse", "soft") for precision in ("fp32", "bf16")]
                         + [("llama", "sparse", "int8"), ("qwen3", "soft", "int8"), ("llama", "lora", "fp32"),
                            ("qwen3", "lora", "bf16"), ("llama", "instance", "bf16"), ("qwen3", "instance", "fp32"),
                            ("llama", "unipeft", "fp32"), ("qwen3", "unipeft", "int8"), ("llama", "molora", "fp32"),
                            ("qwen3", "hydralora", "bf16"), ("llama", "topk", "bf16"), ("qwen3", "adamole", "int8"),
                            ("llama", "moa_experts", "fp32"), ("qwen3", "prompt_adapter_moe", "int8"),
                            ("llama", "soft", "nf4"), ("qwen3", "sparse", "nf4")])
def test_decode_layer_equals_op_by_op(monkeypatch, base_dir, tiny_qwen3, arch, variant, precision):
    """A decode step's layer in two ops (Models/kernels/decode_layer.py) against the op-by-op layer, its plain
    reference, through the KV cache: a prefill of 2 x 3 rows (causal within it) and 2-row steps; layers
    with and without prompt and adapter, grouped kv heads; Qwen3 (head_dim 32 of a 64-wide model, its
    per-head q_norm and k_norm, with weights drawn so that they matter). fp32: the same numbers to float
    rounding; bf16, int8 and nf4: a last-bit difference can round a projection's input to the neighbouring bf16
    value, so a looser bound. The baselines with one expert per family too: LoRA, and instance and UniPEFT, whose
    gates the prefill decides; and the mixtures, gated per row in the op: of LoRA experts (MoLoRA, HydraLoRA, top-k
    and AdaMoLE, routers drawn so that top-k's and AdaMoLE's selections leave experts out), MoA's three experts
    a family, and the prompt and adapter MoE."""
    path = base_dir if arch == "llama" else tiny_qwen3
    model = build_model(path, base_args(path, max_seq_len=64, max_batch_size=2, **DECODE_EXPERTS[variant]))
    randomize_adapters(model, seed=7, scale=0.1)
    rng = np.random.default_rng(3)
    for name, var in model.base_parameters().items():
        if "q_norm" in name or "k_norm" in name:
            var.assign(jt.array((1 + 0.5 * rng.standard_normal(var.shape)).astype(np.float32)))
    set_base_precision(model, precision)
    model.eval()
    tokens = rng.integers(1, model.llama.args.vocab_size, (2, 8)).astype(np.int32)
    calls = fused_layer_steps(monkeypatch)
    with jt.no_grad():
        got = kv_logits(model.llama, tokens, prefill=3)
        assert len(calls) == 6 * len(model.llama.layers)  # the prefill and 5 steps, every layer
        monkeypatch.setattr(LLM.layer_step, "when", lambda *a: False)
        want = kv_logits(model.llama, tokens, prefill=3)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=2e-5 if precision == "fp32" else 2e-2)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if variant in ("topk", "adamole"):  # the selections left experts out of some rows and kept others
        records = []
        with jt.no_grad():
            model.llama(jt.array(tokens), records=records)
        weights = np.concatenate([w.numpy().reshape(-1) for r in records for w in r["expert_weights"].values()])
        assert (weights == 0).mean() > 0.1 and (weights > 0.1).any()


@pytest.mark.skipif(not LLM.layer_step.on(),
                    reason="the fused decode layer is off here (a CPU without libdnnl, a GPU without MOA_GPU_KERNELS=1)")
def test_decode_layer_ops_built_once_per_cache(monkeypatch, base_dir):
    """The decode layer's two ops are built at a KV cache's first step and kept while it lives (StepOp): one build
    of each per layer for a prefill and 5 steps; a reset (each generation's) builds them anew, so a base cast to
    bf16 in between (new tensors) is what the next steps read, as the op-by-op layer reads it."""
    model = build_model(base_dir, base_args(base_dir, max_seq_len=64, max_batch_size=2, **DECODE_EXPERTS["soft"]))
    randomize_adapters(model, seed=7, scale=0.1)
    model.eval()
    builds = []
    for name in ("input_op", "output_op"):
        build = getattr(decode_layer, name)
        monkeypatch.setattr(decode_layer, name, lambda *a, build=build: builds.append(1) or build(*a))
    tokens = np.random.default_rng(3).integers(1, model.llama.args.vocab_size, (2, 8)).astype(np.int32)
    layers = len(model.llama.layers)
    with jt.no_grad():
        fp32 = kv_logits(model.llama, tokens, prefill=3)
        assert len(builds) == 2 * layers
        set_base_precision(model, "bf16")
        got = kv_logits(model.llama, tokens, prefill=3)
        assert len(builds) == 4 * layers
        monkeypatch.setattr(LLM.layer_step, "when", lambda *a: False)
        want = kv_logits(model.llama, tokens, prefill=3)
    assert np.abs(got - fp32).max() > 1e-3  # the cast changed the logits, and the cached ops saw it
    np.testing.assert_allclose(got, want, atol=2e-2)


@pytest.mark.skipif(not LLM.layer_step.on(), reason="the fused decode layer is off here")
def test_decode_layer_ops_take_their_texts_as_included_files(base_dir):
    """Each decode-layer op gives jt.code one `# include` line per text (cpp.included): Jittor rebuilds an op's key
    from its whole text at every run, some 30 us for these. The lines name files of the texts themselves, one file a
    text: the ops' headers and bodies (declarations, then cpp/layer_input.cc or layer_output.cc)."""
    model = build_model(base_dir, base_args(base_dir, max_seq_len=32, max_batch_size=1, **DECODE_EXPERTS["sparse"]))
    model.eval()
    with jt.no_grad():
        kv_logits(model.llama, np.array([[5, 9, 14, 3]], np.int32), prefill=2)
    for layer in model.llama.layers:
        ops = layer.decode_ops
        for op, body in ((ops["input"], decode_layer.LAYER_INPUT), (ops["output"], decode_layer.LAYER_OUTPUT)):
            texts = (op.cpu_header, op.cpu_src, op.cuda_header, op.cuda_src)
            assert all(cpp.INCLUDED.fullmatch(text) for text in texts), texts
            assert cpp.expanded(op.cpu_src).endswith(body)
            assert cpp.expanded(op.cpu_header).endswith(decode_layer.LAYER_HEADER)
            assert cpp.expanded(op.cuda_header) == decode_layer.GPU_LAYER_HEADER
    assert cpp.included(decode_layer.LAYER_INPUT) == cpp.included(decode_layer.LAYER_INPUT) != \
        cpp.included(decode_layer.LAYER_OUTPUT)
