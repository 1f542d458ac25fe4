"""--precision bf16: the authors' fp16 clamp by folder and precision, the demo base's greedy tokens in bf16 close to
fp32 (the golden files in bf16: tests/test_golden.py)."""
import os

import numpy as np
import pytest

from Models.formats.base_model import build_model
from Models.generate import generate
from Models.ModelArgs import ModelArgs
from Data.tiny_base import DEFAULT_BASE_DIR
from Models.Tokenizer import Tokenizer


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
