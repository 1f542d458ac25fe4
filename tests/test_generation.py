"""Batched generation (Models/generate.py): batches give each prompt's own tokens, Infer.py's sorted batches keep
the data set's order, the bf16 KV cache, the prefill's chunks, nucleus sampling without sorting whole rows, the
batch that --batch_size auto picks, and only the tokenizer's ids generated (an id it lacks keeps the text before)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import DATA, infer_base_alone, one_error_line
from tiny_models import fused_layer_steps, kv_logits, randomize_adapters
import jittor as jt

import Infer
from Models import LLM
from Models.formats.base_model import base_args, build_model, open_tokenizer
from Models.generate import (NONFINITE_PICK, NonFiniteLogits, auto_batch_size, decode_buffer_bytes, generate,
                             kv_cache_bytes, pick_tokens, prefill_chunks, sample_top_p)
from Models.kernels.finite import nonfinite_rows
from Models.kernels.precision import set_base_precision
from Models.kernels import switch
from Models.kernels.switch import DECODE_ROWS, GEMV_ROWS, fused_kernels_on
from Models.ModelArgs import INSTANCE_METHODS, ModelArgs
from Utils.settings import METHOD_PRESETS

EXPERTS = dict(lora_layers="0-2", p_adapter_layers="0-2", prompt_layers="0-2", lora_rank=4,
               lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN")
NO_STOP = SimpleNamespace(stop_tokens=set(), n_words=None)  # every row of the embedding table a token


def tiny_model(base, method="sparse", seed=0, **settings):
    """The tiny base with every expert family the method takes (prompts: not Sparse MoA), drawn at random."""
    preset = METHOD_PRESETS[method]
    experts = {**EXPERTS, "prompt_layers": "0-0"} if preset.get("variant") == "sparse" else EXPERTS
    model = build_model(base, base_args(base, max_seq_len=96, max_batch_size=4, **{**experts, **preset, **settings}))
    randomize_adapters(model, seed=seed, scale=0.1)
    model.eval()
    return model


def random_prompts(rng, lengths, vocab):
    return [[1] + list(map(int, rng.integers(2, vocab, n - 1))) for n in lengths]


def test_prefill_chunks():
    """The prefill's chunks: prefill_length's bucket (in chunks of 64), then powers of two of the rest down to 8
    tokens; what is left goes one token per decode step."""
    assert prefill_chunks(5) == [4] and prefill_chunks(20) == [16] and prefill_chunks(30) == [16, 8]
    assert prefill_chunks(64) == [64] and prefill_chunks(127) == [64, 32, 16, 8]
    assert prefill_chunks(150) == [64, 64, 16] and sum(prefill_chunks(300)) == 296


def full_sort_sampling(probs, top_p, rng):
    """The reference: every row sorted whole (numpy's stable argsort), its nucleus renormalised, one
    rng.choice per row."""
    picks = []
    for row in probs:
        order = np.argsort(-row, kind="stable")
        p = row[order].astype(np.float64)
        p[np.cumsum(p) - p > top_p] = 0.0
        picks.append(order[rng.choice(len(row), p=p / p.sum())])
    return np.array(picks)


@pytest.mark.filterwarnings("ignore:The value of the smallest subnormal")
@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("V", [50, 384, 128256, 151936])
def test_nucleus_sampling_equals_sorting_whole_rows(V, where):
    """Rows whose nucleus lies among their 64 most probable tokens are drawn from those alone, the others from
    the whole sorted row: the same token for every row as sorting every row, and the same random stream after;
    with the probabilities left where they were computed (a jt.Var, as on a GPU: its rows sorted there) too."""
    rng = np.random.default_rng(V)
    for temperature in (0.1, 1.0, 3.0):  # peaked rows (small nuclei) and flat ones (the whole-row path)
        logits = rng.standard_normal((12, V)) * 3 / temperature
        logits[3, :5] = logits[3].max() + 1  # a tie at the top
        logits[4] = np.round(logits[4])  # ties everywhere
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
        for top_p in (0.3, 0.75, 0.9):
            ours, reference = np.random.default_rng(1), np.random.default_rng(1)
            given = probs if where == "host" else jt.array(probs)
            np.testing.assert_array_equal(sample_top_p(given, top_p, ours), full_sort_sampling(probs, top_p, reference))
            assert ours.random() == reference.random()


def test_a_tiny_temperature_samples_the_most_probable_token():
    """Logits over a tiny temperature overflow (and Jittor's softmax of logits near 1e12 is NaN): each row's
    largest is made 0 first, so the draw is the argmax, as greedy decoding's."""
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32) * 5
    for temperature in (1e-6, 1e-12, 1e-30, 1e-37):
        picked = pick_tokens(jt.array(logits), temperature, 0.9, np.random.default_rng(1))
        np.testing.assert_array_equal(picked, logits.argmax(-1))


def test_rows_with_non_finite_logits_pick_no_token():
    """A row holding a NaN, inf or -inf among the tokenizer's ids picks NONFINITE_PICK, greedy or sampled; the
    other rows pick as before, and a NaN past the tokenizer's ids (an embedding table's padding rows) is no
    token's. The rows are found by a fused CPU op and Jittor's isfinite alike."""
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    broken = logits.copy()
    broken[1, 7], broken[2, 0], broken[3, 49], broken[4, 45] = np.nan, np.inf, -np.inf, np.nan
    for temperature in (0.0, 0.7):
        expected = pick_tokens(jt.array(logits), temperature, 0.9, np.random.default_rng(1), n_words=45)
        picked = pick_tokens(jt.array(broken), temperature, 0.9, np.random.default_rng(1), n_words=45)
        assert (picked[[1, 2]] == NONFINITE_PICK).all() and (picked[[0, 3, 4]] == expected[[0, 3, 4]]).all()
        assert pick_tokens(jt.array(broken), temperature, 0.9, np.random.default_rng(1))[3] == NONFINITE_PICK
    edges = np.array([[3.4e38, -3.4e38, 1e-45, -0.0], [0, 0, 0, np.nan], [-np.inf, 0, 0, 0], [np.inf] * 4], np.float32)
    for check in (nonfinite_rows.fused, nonfinite_rows.plain):  # the fused one tests the bits of each float
        assert check(jt.array(edges)).numpy().tolist() == [False, True, True, True]


class ScriptedLlama:
    """A stand-in for model.llama whose logits at each position p pick token (2 + p) % 16, except that row
    `nan_row`'s logits are NaN at positions from `nan_from` on."""

    def __init__(self, nan_row, nan_from, vocab=16):
        self.args = SimpleNamespace(max_seq_len=64, method="moe", precision="bf16")
        self.nan_row, self.nan_from, self.vocab = nan_row, nan_from, vocab

    def reset_cache(self):
        pass

    def __call__(self, tokens, start_pos, records=None, last=True):
        B, T = tokens.shape
        assert (tokens.numpy() >= 0).all()  # an embedding row, also in a finished row
        position = start_pos + T  # the one the logits pick a token for
        logits = np.zeros((B, 1, self.vocab), np.float32)
        logits[:, 0, (2 + position) % self.vocab] = 1.0
        if position >= self.nan_from:
            logits[self.nan_row] = np.nan
        return jt.array(logits)


def test_non_finite_logits_stop_generation_naming_the_row_and_token():
    """generate() raises NonFiniteLogits at the first kept pick whose logits are not finite, naming the prompt's
    row, the token of its answer and the precision; logits of a row still reading its prompt, or of one that has
    finished (a stop token, or its budget), are read by no one and stop nothing."""
    model = SimpleNamespace(llama=ScriptedLlama(nan_row=1, nan_from=9), eval=lambda: None)
    prompts = [[1, 5, 5, 5], [1, 5, 5, 5, 5, 5]]  # generating from positions 4 and 6
    with pytest.raises(NonFiniteLogits, match="token 4 of the answer to prompt 1, computed in bf16") as info:
        generate(model, NO_STOP, prompts, 8)  # positions 6, 7, 8, then 9
    assert (info.value.row, info.value.step) == (1, 4)
    assert generate(model, SimpleNamespace(stop_tokens={9}, n_words=None), prompts, 8) == [[6, 7, 8], [8]]
    model.llama.nan_row, model.llama.nan_from = 0, 7  # row 0's budget of 3 ends at position 6, row 1's at 8
    assert generate(model, NO_STOP, prompts, 3) == [[6, 7, 8], [8, 9, 10]]
    model.llama.nan_row, model.llama.nan_from = 1, 4  # from inside row 1's prompt
    with pytest.raises(NonFiniteLogits, match="token 1 of the answer to prompt 1"):
        generate(model, NO_STOP, prompts, 3)


@pytest.mark.slow
@pytest.mark.parametrize("method, settings", [(method, {}) for method in METHOD_PRESETS]
                         + [("soft", dict(expert_num=3))], ids=list(METHOD_PRESETS) + ["soft-3-experts"])
def test_batched_greedy_equals_unbatched(tiny_base, method, settings):
    """fp32, greedy: a batch of prompts of different lengths gives each prompt the tokens it gets alone (the
    instance-level methods pool their prefill, so theirs are prompts of one length), padded to a larger batch
    too; and a prefill in several chunks gives the tokens of a prefill followed by decode steps. Also Soft MoA
    with three experts a family (mixtures of LoRA, prompt and adapter experts, gated per row)."""
    model = tiny_model(tiny_base, method, **settings)
    rng = np.random.default_rng(5)
    lengths = [12] * 3 if method in INSTANCE_METHODS else [9, 30, 17]
    prompts = random_prompts(rng, lengths, model.llama.args.vocab_size)
    alone = [generate(model, NO_STOP, [p], 6)[0] for p in prompts]
    assert all(len(a) == 6 for a in alone) and len({tuple(a) for a in alone}) == 3  # rows that could be mixed up
    assert generate(model, NO_STOP, prompts, 6) == alone
    assert generate(model, NO_STOP, prompts, 6, batch_size=4) == alone
    assert generate(model, NO_STOP, prompts[1:2], 6, prefill_step=8) == alone[1:2]  # chunks 8, 8, 8 of 30


@pytest.mark.slow
def test_sorted_batches_keep_the_data_sets_order(tiny_base, monkeypatch):
    """Infer.generate_share runs its examples longest-first in batches of --batch_size and returns each
    example's own generation under its index."""
    model = tiny_model(tiny_base, "soft")
    rng = np.random.default_rng(6)
    prompts = random_prompts(rng, [7, 25, 11, 40, 18], model.llama.args.vocab_size)
    batches = []
    original = Infer.generate

    def recording(model_, tok, batch, *rest, **kw):
        batches.append([len(p) for p in batch])
        return original(model_, tok, batch, *rest, **kw)
    monkeypatch.setattr(Infer, "generate", recording)
    tok = SimpleNamespace(stop_tokens=set(), n_words=model.llama.args.vocab_size,
                          decode=lambda ids: " ".join(map(str, ids)))
    args = SimpleNamespace(batch_size=2, save_weights=False, seed=0)
    gen = SimpleNamespace(max_gen_len=5, temperature=0.0, top_p=0.75)
    results = Infer.generate_share(model, tok, prompts, range(len(prompts)), args, gen, rank=0)
    assert batches == [[40, 25], [18, 11], [7]]
    for i, prompt in enumerate(prompts):
        assert results[i]["token_ids"] == prompt + generate(model, NO_STOP, [prompt], 5)[0]


@pytest.mark.skipif(not fused_kernels_on(), reason="fused kernels are off (no libdnnl or a GPU run)")
@pytest.mark.parametrize("method", ["soft", "lora"])
def test_bf16_kv_cache_within_bf16_of_fp32(tiny_base, method):
    """A bf16 base keeps its KV cache in bf16 (kv_cache 'base'): prefill and decode logits within bf16's
    rounding of those with an fp32 cache (kv_cache 'fp32'), through the fused decode layer (soft) and op by
    op (lora); the cache really is bf16 (the logits differ)."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, 300, (3, 10)).astype(np.int32)
    logits = {}
    for cache in ("base", "fp32"):
        model = tiny_model(tiny_base, method, kv_cache=cache)
        set_base_precision(model, "bf16")
        with jt.no_grad():
            logits[cache] = kv_logits(model.llama, tokens, prefill=4)
        assert model.llama.layers[0].attention._cache.dtype == ("bfloat16" if cache == "base" else "float32")
    scale = np.abs(logits["fp32"]).max()
    assert scale > 1.0
    np.testing.assert_allclose(logits["base"], logits["fp32"], atol=2e-2 * scale)
    assert not np.array_equal(logits["base"], logits["fp32"])


@pytest.mark.skipif(not LLM.layer_step.on(),
                    reason="the fused decode layer is off here (a CPU without libdnnl, a GPU without MOA_GPU_KERNELS=1)")
def test_decode_layer_above_gemv_rows(tiny_base, monkeypatch):
    """A bf16 base's decode step of 20 rows (more than GEMV_ROWS: the rows kernel) runs the fused decode layer,
    equal to the op-by-op layer within bf16's rounding."""
    model = tiny_model(tiny_base, "soft")
    set_base_precision(model, "bf16")
    tokens = np.random.default_rng(8).integers(1, 300, (20, 6)).astype(np.int32)
    calls = fused_layer_steps(monkeypatch)
    with jt.no_grad():
        got = kv_logits(model.llama, tokens, prefill=2)
        assert calls.count(20) == 5 * len(model.llama.layers) and 20 > GEMV_ROWS  # the prefill and 4 steps
        monkeypatch.setattr(LLM.layer_step, "when", lambda *a: False)
        want = kv_logits(model.llama, tokens, prefill=2)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


def test_auto_batch_size():
    """--batch_size auto: the most rows whose KV cache (bf16 with a bf16 base, counted 1.5 times) and decoding
    buffers fit in 80% of the memory left, at most the decode kernels' rows and the prompts there are."""
    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                     precision="bf16")
    per_row = 1.5 * kv_cache_bytes(args, 1, 400) + decode_buffer_bytes(args, 1, 64)
    assert kv_cache_bytes(args, 1, 400) == 32 * 2 * 8 * 128 * 400 * 2
    assert auto_batch_size(args, 400, 1000, available=per_row * 30 / 0.8) == 30
    assert auto_batch_size(args, 400, 1000, available=1 << 40) == DECODE_ROWS
    assert auto_batch_size(args, 400, 5, available=1 << 40) == 5
    assert auto_batch_size(args, 400, 1000, available=0) == 1
    fp32 = ModelArgs(**{**args.to_dict(), "precision": "fp32"})
    assert auto_batch_size(fp32, 400, 1000, available=1 << 40) == GEMV_ROWS
    assert kv_cache_bytes(fp32, 1, 400) == 2 * kv_cache_bytes(args, 1, 400)
    assert kv_cache_bytes(ModelArgs(**{**args.to_dict(), "kv_cache": "fp32"}), 1, 400) == kv_cache_bytes(fp32, 1, 400)
    parser = Infer.get_args_parser()
    assert parser.parse_args([]).batch_size == "auto" and parser.parse_args(["--batch_size", "3"]).batch_size == 3


@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "many", ""])
def test_batch_size_refuses_what_is_neither_a_count_nor_auto(tiny_base, tmp_path, capsys, bad):
    """One error line naming the flag and the value, exit 2, before anything is loaded or written."""
    with pytest.raises(SystemExit) as exit_:
        Infer.main(["--no_adapter", "--llama_path", tiny_base, "--batch_size", bad,
                    "--output_dir", str(tmp_path / "out")])
    assert exit_.value.code == 2
    one_error_line(capsys.readouterr().err, "--batch_size", repr(bad), "'auto'")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_infer_batch_size_auto(tiny_base, tmp_path, capsys):
    """Infer.py without --batch_size picks the batch (here every example of the rank: the tiny model's cache is
    small), says which, and writes the greedy predictions of --batch_size 1."""
    common = ["--no_adapter", "--llama_path", tiny_base, "--data_path", str(DATA / "math" / "AddSub"),
              "--max_examples", "5", "--max_gen_len", "4", "--plot_examples", "0"]
    capsys.readouterr()
    Infer.main(common + ["--output_dir", str(tmp_path / "auto")])
    assert "; batch size 5" in capsys.readouterr().out
    Infer.main(common + ["--batch_size", "1", "--output_dir", str(tmp_path / "one")])
    auto, one = ((tmp_path / run / "AddSub_predictions.jsonl").read_text() for run in ("auto", "one"))
    assert auto == one and len(auto.splitlines()) == 5


@pytest.mark.parametrize("path", ["fused", "plain"])
def test_padding_rows_of_the_table_are_never_generated(tiny_base, monkeypatch, path):
    """An embedding table with more rows than the tokenizer has tokens (here the tokenizer knows half of them,
    as Qwen3's 151,669 tokens fill 151,936 rows): greedy and sampled generation pick the tokenizer's ids only,
    in the fused decode path and in the plain one (a GPU's), greedy the most probable of them."""
    if path == "plain":
        monkeypatch.setattr(switch, "fused_kernels_on", lambda: False)
    elif not fused_kernels_on():
        pytest.skip("fused kernels are off (no libdnnl or a GPU run)")
    model = tiny_model(tiny_base, "sparse")
    half = model.llama.args.vocab_size // 2
    tok = SimpleNamespace(stop_tokens=set(), n_words=half)
    prompts = random_prompts(np.random.default_rng(9), [9, 14, 11], half)
    assert max(max(out) for out in generate(model, NO_STOP, prompts, 8)) >= half  # those rows do win otherwise
    greedy = generate(model, tok, prompts, 8)
    sampled = generate(model, tok, prompts, 8, temperature=1.0, top_p=1.0, seed=3)
    assert [len(out) for out in greedy + sampled] == [8] * 6
    assert all(0 <= t < half for out in greedy + sampled for t in out), (greedy, sampled)
    with jt.no_grad():
        best = [int(model.llama(jt.array(np.array([p], np.int32)))[0, -1].numpy()[:half].argmax()) for p in prompts]
    assert [out[0] for out in greedy] == best


def test_an_id_outside_the_tokenizer_keeps_the_text_before_it(tiny_base, addsub, tmp_path, monkeypatch):
    """Should a generation still hold an id the tokenizer lacks, its example keeps the text before that id,
    marked in its predictions row and counted in scores.json, and the evaluation is written (it used to end in
    `error: token id ... is outside the vocabulary`, exit 2, nothing saved)."""
    tok = open_tokenizer(tiny_base, base_args(tiny_base).vocab_size)
    said = tok.encode(" 7 apples", bos=False, eos=False)
    outside = tok.n_words + 5
    monkeypatch.setattr(Infer, "generate", lambda model, tok_, prompts, *rest, **kw:
                        [said + [outside] + said] + [said] * (len(prompts) - 1))
    summary = infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", addsub)
    rows = [json.loads(line) for line in (tmp_path / "eval" / "AddSub_predictions.jsonl").read_text().splitlines()]
    assert [row["generation"] for row in rows] == [" 7 apples"] * 2
    assert sorted(row.get("undecodable_id", -1) for row in rows) == [-1, outside]
    assert summary["datasets"]["AddSub"]["undecodable"] == 1 and summary["datasets"]["AddSub"]["total"] == 2
