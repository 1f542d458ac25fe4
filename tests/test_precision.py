"""--precision bf16: the frozen base in bf16 stays close to fp32 (loss, greedy tokens); fp32 stays fp32."""
import os

import numpy as np
import pytest

from conftest import golden_forward, golden_model, load_golden
from Models.formats.base_model import build_model
from Models.generate import generate
from Models.ModelArgs import ModelArgs
from Data.tiny_base import DEFAULT_BASE_DIR
from Models.Tokenizer import Tokenizer


def dtypes(model) -> dict:
    return {name: str(p.dtype) for name, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["sparse_s0", "soft_s0", "soft_e2_s3"])
def test_golden_loss_in_bf16_within_one_percent(variant):
    model, data, _ = golden_model(variant, precision="bf16")
    kinds = dtypes(model)
    assert kinds["llama.layers.0.attention.wq.weight"] == "bfloat16"
    assert kinds["llama.tok_embeddings.weight"] == "bfloat16" and kinds["llama.output.weight"] == "bfloat16"
    assert kinds["llama.layers.0.attention_norm.weight"] == "float32"
    assert all(dtype == "float32" for name, dtype in kinds.items() if name in model.adapter_parameters())
    loss, logits = golden_forward(model, data)
    assert logits.dtype == "float32"
    fp32_loss = float(data["loss"])
    assert abs(float(loss.item()) - fp32_loss) <= 0.01 * abs(fp32_loss)
    # the rounding is real: bf16 weights do not give the fp32 logits bit for bit
    assert np.abs(logits.numpy() - data["logits"]).max() > 1e-5


def test_parity_models_are_fp32():
    _, _, args = load_golden("sparse_s0")
    assert args.precision == "fp32" and ModelArgs().precision == "fp32"  # also the default
    model, _, _ = golden_model("sparse_s0")
    assert set(dtypes(model).values()) == {"float32"}


@pytest.mark.parametrize("method, variant", [("moa", "soft"), ("moa", "sparse"), ("moe", "soft")])
def test_block_clamp_as_the_authors_folders(method, variant):
    """Their fp16 guard (out.clamp(+-65500)) runs in fp32 in every folder but Sparse MoA's, and in none
    in their bf16 mode (`if not self.bf16`)."""
    from Models.LLM import SOFT_CLAMP, TransformerBlock
    for precision in ("fp32", "bf16"):
        args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=61, multiple_of=16, method=method,
                         variant=variant, precision=precision)
        clamps = precision == "fp32" and not (method == "moa" and variant == "sparse")
        assert TransformerBlock(0, args).clamp == (SOFT_CLAMP if clamps else None)


def test_greedy_tokens_of_the_demo_base_agree():
    """The shipped pretrained tiny base continues 4 texts greedily for 32 tokens in each precision."""
    tokenizer = Tokenizer(os.path.join(DEFAULT_BASE_DIR, "tokenizer.model"))
    texts = ["Tom has 12 apples and buys 7 more.", "24 + 19 =", "A baker made 35 cakes and sold",
             "Once upon a time, a girl"]
    prompts = [tokenizer.encode(t, bos=True, eos=False) for t in texts]
    outputs = {}
    for precision in ("fp32", "bf16"):
        args = ModelArgs.from_params_json(DEFAULT_BASE_DIR, precision=precision, max_seq_len=64, max_batch_size=4)
        model = build_model(DEFAULT_BASE_DIR, args)
        assert str(model.llama.layers[0].feed_forward.w1.weight.dtype) == {"fp32": "float32",
                                                                           "bf16": "bfloat16"}[precision]
        outputs[precision] = generate(model, tokenizer, prompts, max_gen_len=32)
    pairs = [(a, b) for fp32, bf16 in zip(outputs["fp32"], outputs["bf16"]) for a, b in zip(fp32, bf16)]
    assert len(pairs) >= 64, "too few tokens generated for a comparison"
    assert np.mean([a == b for a, b in pairs]) >= 0.9
