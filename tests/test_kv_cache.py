"""Generation through the KV cache (Models/generate.py) on a tiny random base (conftest's tiny_base) with random
adapter weights, so that the experts and the router really change the outputs: the greedy picks equal recomputing
the whole sequence, a batch equals its prompts one by one, the router records equal a full forward's, stop tokens
end each row, sampling is seeded, and the authors' per-example budget."""
import os

import numpy as np
import pytest

from tiny_models import MOA, randomize_adapters
import jittor as jt

from Models.formats.base_model import build_model
from Models.generate import generate, prefill_length
from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer

TEXTS = ["Tom had 3 apples.", "Mary had 12 marbles and lost 5 of them. How many are left?", "Hi",
         "Sam picked 4 books and Leo picked 7 books. They shared them equally."]
GEN = 12


@pytest.fixture(scope="module")
def tok(tiny_base):
    return Tokenizer(os.path.join(tiny_base, "tokenizer.model"))


@pytest.fixture(scope="module")
def models(tiny_base):
    built = {}
    for i, (name, moa) in enumerate(MOA.items()):
        args = ModelArgs.from_params_json(tiny_base, max_seq_len=64, max_batch_size=4, **moa)
        model = build_model(tiny_base, args)
        randomize_adapters(model, seed=i, scale=0.1)
        model.eval()
        built[name] = model
    return built


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t, bos=True, eos=False) for t in TEXTS]


def full_recompute(model, tok, prompt, generated, max_gen_len):
    """Reference: the greedy picks without the cache, for the sequence `generated` followed. One forward
    of prompt + generated, no cache: the model is causal, so its position len(prompt) - 1 + i holds the
    logits that recomputing the whole sequence after step i gives, and greedy decoding picks their argmax
    until a stop token. One forward per prompt, not one per step: each length is a shape Jittor compiles."""
    seq = list(prompt) + list(generated)
    with jt.no_grad():
        logits = model.llama(jt.array(np.array([seq], np.int32))).numpy()[0]
    picks = []
    for nxt in logits[len(prompt) - 1:].argmax(-1)[:max_gen_len]:
        if int(nxt) in tok.stop_tokens:
            break
        picks.append(int(nxt))
    return picks


def test_prefill_length_buckets():
    assert [prefill_length(n) for n in (1, 2, 3, 17, 63, 64, 130)] == [1, 2, 2, 16, 32, 64, 128]


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_greedy_cache_equals_full_recompute(models, tok, prompts, variant):
    model = models[variant]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths
    for prompt in prompts:
        generated = generate(model, tok, [prompt], GEN)[0]
        assert generated == full_recompute(model, tok, prompt, generated, GEN)


def test_batch_of_4_equals_4_batches_of_1(models, tok, prompts):
    model = models["sparse"]
    batched = generate(model, tok, prompts, GEN)
    assert batched == [generate(model, tok, [p], GEN)[0] for p in prompts]
    assert all(len(out) == GEN for out in batched)  # random weights: no stop token met
    # padded to a fixed batch size: the same again
    assert generate(model, tok, prompts[:3], GEN, batch_size=4) == batched[:3]


@pytest.mark.parametrize("variant", ["sparse", "soft"])
def test_records_match_full_forward(models, tok, prompts, variant):
    model = models[variant]
    records = []
    outputs = generate(model, tok, prompts, GEN, records=records)
    for prompt, out, rec in zip(prompts, outputs, records):
        seq = prompt + out
        full = []
        with jt.no_grad():
            model.llama(jt.array(np.array([seq], np.int32)), records=full)
        assert len(rec) == len(full) == len(model.llama.layers)
        for layer, (got, want) in enumerate(zip(rec, full)):
            n_types = len(model.llama.layers[layer].type_names)
            assert got["type_weight"].shape == (len(seq), n_types)
            np.testing.assert_allclose(got["type_weight"], want["type_weight"].numpy()[0], atol=1e-5)
            if variant == "sparse":
                assert got["token_weight"].shape == (len(seq), 1)
                np.testing.assert_allclose(got["token_weight"], want["threshold"].numpy()[0], atol=1e-5)
            else:
                assert got["token_weight"] is None


class StopAt:
    """A tokenizer stand-in whose stop tokens are chosen by the test; every row of the table is a token."""

    def __init__(self, stop_tokens):
        self.stop_tokens, self.n_words = set(stop_tokens), None


def test_stop_tokens_end_each_row(models, tok, prompts):
    model = models["sparse"]
    free = generate(model, tok, prompts, GEN)
    stop = free[0][4]  # row 0 stops before its 5th token; the others wherever that token first shows up
    records = []
    stopped = generate(model, StopAt({stop}), prompts, GEN, records=records)
    for out, full, prompt, rec in zip(stopped, free, prompts, records):
        cut = full.index(stop) if stop in full else len(full)
        assert out == full[:cut]
        assert rec[0]["type_weight"].shape[0] == len(prompt) + len(out)


@pytest.mark.filterwarnings("ignore:The value of the smallest subnormal")
def test_sampling_is_seeded(models, tok, prompts):
    model = models["sparse"]
    first = generate(model, tok, prompts, 6, temperature=1.0, top_p=0.9, seed=3)
    assert first == generate(model, tok, prompts, 6, temperature=1.0, top_p=0.9, seed=3)
    assert all(0 <= t < tok.n_words for out in first for t in out)


def test_budget_per_example_as_the_authors(models, tok, prompts):
    """budget_seq_len L: each prompt of n tokens generates min(max_gen_len, L - n), whatever its batch."""
    model = models["sparse"]
    free = generate(model, tok, prompts, GEN)
    lengths = [len(p) for p in prompts]
    budget = max(lengths) + 3
    cut = generate(model, tok, prompts, GEN, budget_seq_len=budget)
    assert [len(out) for out in cut] == [min(GEN, budget - n) for n in lengths]
    assert len({len(out) for out in cut}) > 1  # some rows cut by the budget, some by max_gen_len
    assert all(out == full[:len(out)] for out, full in zip(cut, free))
    shortest = lengths.index(min(lengths))
    assert generate(model, tok, prompts, GEN, budget_seq_len=min(lengths))[shortest] == []  # a full prompt
