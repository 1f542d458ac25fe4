"""Batched generation through the KV cache (Meta's llama3 / gpt-fast style).

Every row starts at position 0 and is right-padded. The prefill feeds the first
P tokens of all rows, P <= the shortest prompt, in chunks of bucketed lengths
(prefill_chunks: at most `prefill_step` tokens each, so only a few shapes ever
compile and the activations of a chunk stay small); after that one token per step,
and a row whose prompt is not finished yet is fed its own next prompt token instead
of the picked one. Each row thus sees exactly its own tokens at its own
positions: a batch gives the same tokens as batch size 1 (greedy), and the
router values recorded at a position are those computed when its token was fed.
The instance-level methods prefill exactly the shortest prompt, in one call, instead:
their gates come from the prefill (the authors' min_prompt_len), so with several
prompts of different lengths a batch is not the same as batch size 1 for them.
A decode step's products read the base's weights once for the whole batch
(Models/kernels/switch.decoding), so tokens per second grow with the batch up to
DECODE_ROWS rows; `auto_batch_size` picks the largest batch the memory holds.
"""
import time

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .memory import available_memory, kv_cache_bytes, ranks_sharing_memory
from .ModelArgs import BF16_PRODUCTS, INSTANCE_METHODS
from .kernels.finite import nonfinite_rows
from .kernels.switch import DECODE_ROWS, GEMV_ROWS

PAD_TOKEN = 0  # fed in padded slots that are never read (pad_id -1 is not a valid embedding row)
NONFINITE_PICK = -1  # pick_tokens' answer for a row whose logits are not all finite


class NonFiniteLogits(ArithmeticError):
    """Logits holding NaN or inf where generate() was to pick a token: for row `row` of the batch, the
    `step`-th token of its answer, computed in `precision`; `where` names the prompt (default: its row)."""

    def __init__(self, row: int, step: int, precision: str, where: str = None):
        super().__init__(f"non-finite logits (NaN or inf) for token {step} of the answer to {where or f'prompt {row}'}"
                         f", computed in {precision}: the base's or the adapter's numbers overflow there")
        self.row, self.step = row, step


def decode_buffer_bytes(args, batch_size: int, chunk: int) -> int:
    """What generation holds besides the model and the cache, bounded from above: a prefill chunk's
    activations (the FFN's three hidden tensors and a few residual-stream ones, fp32) and the logits
    with their probabilities (fp32, and float64 on the host for sampling)."""
    return batch_size * (chunk * (3 * args.ffn_hidden_dim + 8 * args.dim) * 4 + args.vocab_size * 16)


# What a row of generation holds per byte of its KV cache, beside decode_buffer_bytes: measured at the
# LLaMA-3.1-8B shape (bench/eval_scale.py, 546 positions), 124-128 MB a row at batch 32 and 64 where the
# cache is 72 MB and the buffers 21; at 2 and 6 layers the count below is 15% and 31% over.
KV_CACHE_SHARE = 1.5


def auto_batch_size(args, seq_len: int, n_prompts: int, available=None, chunk: int = 64) -> int:
    """`--batch_size auto`: the largest batch, at most n_prompts and the rows one pass of the decode
    kernels serves (DECODE_ROWS with a bf16 or int8 base, GEMV_ROWS otherwise), whose KV cache (counted
    KV_CACHE_SHARE times) and decode buffers fit in 80% of the memory left (all the ranks sharing
    it together; call it with the model loaded). The rest is for Jittor's compiler on the first batch."""
    available = (available_memory() if available is None else available) * 0.8 / ranks_sharing_memory()
    per_row = KV_CACHE_SHARE * kv_cache_bytes(args, 1, seq_len) + decode_buffer_bytes(args, 1, chunk)
    most = DECODE_ROWS if args.precision in BF16_PRODUCTS else GEMV_ROWS
    return max(1, min(most, n_prompts, int(available // per_row)))


def prefill_length(shortest_prompt: int, step: int = 64) -> int:
    """The largest bucket <= shortest_prompt: a multiple of `step`, or a power of two below it."""
    if shortest_prompt >= step:
        return shortest_prompt // step * step
    return 1 << (shortest_prompt.bit_length() - 1)


def prefill_chunks(shortest_prompt: int, step: int = 64, smallest: int = 8) -> list:
    """The lengths of the prefill's chunks, in order: prefill_length's bucket cut into chunks of `step`,
    then the largest power of two of the rest while it is at least `smallest` tokens (fewer would cost
    about as much as feeding them one per decode step, which the rest is)."""
    first = prefill_length(shortest_prompt, step)
    chunks = [min(step, first)] * (first // step) or [first]
    rest = shortest_prompt - first
    while rest >= smallest:
        chunks.append(1 << (min(rest, step).bit_length() - 1))
        rest -= chunks[-1]
    return chunks


def feed(model, tokens: np.ndarray, pos: int, records=None) -> jt.Var:
    """Feed tokens [B,T] at positions pos..pos+T-1 through the KV cache; logits [B,V] that predict pos + T."""
    return model.llama(jt.array(tokens.astype(np.int32)), start_pos=pos, records=records, last=True)[:, -1]


# Rows whose nucleus has fewer tokens than this are sampled from their most probable tokens alone
NUCLEUS_CANDIDATES = 64


def first_sum_block(n: int) -> int:
    """The length of the first block numpy's pairwise summation adds up alone in a row of n float64s (its
    blocks hold at most 128): a sum over n elements that are zero past that block equals the block's sum."""
    while n > 128:
        n = n // 2 - n // 2 % 8
    return n


def sample_top_p(probs, top_p: float, rng: np.random.Generator) -> np.ndarray:
    """Nucleus sampling: probs [B,V] -> token ids [B]. Each row keeps its most probable tokens (ties in token
    order) up to the first at which the mass before it exceeds top_p, renormalises them and draws one with rng,
    as rng.choice(V, p=...) does on the sorted row. A row whose nucleus lies within its NUCLEUS_CANDIDATES most
    probable tokens (ahead of any tie with the others) is drawn from them alone: the same numbers, sums and
    draw as from the whole sorted row (nucleus_of_sorted_rows), without sorting all V. probs is a numpy array,
    or a jt.Var left where it was computed (a GPU): then only the candidates, and the rows they do not settle,
    come to the host (most_probable)."""
    B, V = probs.shape
    uniforms = rng.random(B)  # rng.choice's one draw per row, in row order
    block = first_sum_block(V)
    k = min(NUCLEUS_CANDIDATES, block)
    picks = np.empty(B, np.int64)
    inside = np.zeros(B, bool)
    rows, candidates, candidate_probs = most_probable(probs, k, top_p)
    if len(rows):
        order = np.lexsort((candidates, -candidate_probs), axis=-1)  # by probability, ties by token id
        candidates = np.take_along_axis(candidates, order, axis=-1)
        sorted_probs = np.take_along_axis(candidate_probs, order, axis=-1).astype(np.float64)
        kept = np.cumsum(sorted_probs, axis=-1) - sorted_probs <= top_p  # a prefix of each row
        n_kept = kept.sum(-1)
        fits = (n_kept < k) & (sorted_probs[np.arange(len(rows)), n_kept - 1] > sorted_probs[:, -1]) if k < V \
            else n_kept > 0
        if fits.any():
            p = np.zeros((int(fits.sum()), block))
            p[:, :k] = np.where(kept[fits], sorted_probs[fits], 0.0)
            p /= p.sum(-1, keepdims=True)
            picks[rows[fits]] = np.take_along_axis(candidates[fits], inverse_cdf(p, uniforms[rows[fits]]), -1)[:, 0]
            inside[rows[fits]] = True
    outside = np.flatnonzero(~inside)
    for rows in np.array_split(outside, -(-len(outside) // 16)) if len(outside) else []:  # bounded temporaries
        order, p = nucleus_of_sorted_rows(rows_on_host(probs, rows), top_p)
        picks[rows] = np.take_along_axis(order, inverse_cdf(p, uniforms[rows]), -1)[:, 0]
    return picks


def most_probable(probs, k: int, top_p: float) -> tuple:
    """The rows of probs [B,V] whose nucleus may lie within their k most probable tokens, those tokens and their
    probabilities: (rows [R], tokens [R,k], probabilities [R,k]), each row's k in any order. The k-1 most
    probable tokens hold at most k-1 times the largest probability: a row where that is not above top_p has a
    nucleus longer than k-1 (the exact test in sample_top_p would find so, at a higher cost). On the host an
    argpartition of those rows; for a jt.Var a sort of every row where it lies, and k per row to the host."""
    B, V = probs.shape
    if k >= V:
        return np.arange(B), np.tile(np.arange(V), (B, 1)), rows_on_host(probs, np.arange(B))
    if isinstance(probs, jt.Var):
        tokens, values = jt.argsort(probs, dim=-1, descending=True)
        tokens, values = tokens[:, :k].numpy().astype(np.int64), values[:, :k].numpy()
        rows = np.flatnonzero((k - 1) * values[:, 0].astype(np.float64) * (1 + 1e-9) > top_p)
        return rows, tokens[rows], values[rows]
    rows = np.flatnonzero((k - 1) * probs.max(-1).astype(np.float64) * (1 + 1e-9) > top_p)
    tokens = np.argpartition(-probs[rows], k - 1, axis=-1)[:, :k]
    return rows, tokens, np.take_along_axis(probs[rows], tokens, axis=-1)


def rows_on_host(probs, rows: np.ndarray) -> np.ndarray:
    """probs[rows] as a numpy array, gathered where probs lies (a jt.Var: only those rows are copied)."""
    if isinstance(probs, jt.Var):
        return probs[jt.array(rows.astype(np.int32))].numpy()
    return probs[rows]


def inverse_cdf(p: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """The index [R,1] rng.choice(n, p=row) picks for each row of p [R,n] given its uniform draw [R]: the
    first at which the row's cumulative sum, divided by its total, exceeds the draw. Past the last nonzero
    column of all rows the sums stay at their totals (1 after the division, above any draw): not summed."""
    width = int(np.flatnonzero(p.any(0))[-1]) + 1
    cdf = np.cumsum(p[:, :width], axis=-1)
    cdf /= cdf[:, -1:]
    return (cdf <= uniforms[:, None]).sum(-1, keepdims=True)


def nucleus_of_sorted_rows(probs: np.ndarray, top_p: float) -> tuple:
    """Rows probs [R,V] sorted (stable, most probable first) and their nucleus probabilities [R,V] (float64,
    zero past the nucleus, each row summing to 1): (order, p). The sort is of one int64 key per token
    (the probability's bits, inverted, above the token id), which numpy sorts with its vector sort."""
    R, V = probs.shape
    shift = max(int(V - 1).bit_length(), 1)
    bits = np.ascontiguousarray(probs, dtype=np.float32).view(np.int32).astype(np.int64)  # >= 0, ordered as the values
    keys = ((0x7FFFFFFF - bits) << shift) | np.arange(V, dtype=np.int64)
    keys.sort(axis=-1)
    order = keys & ((1 << shift) - 1)
    p = (0x7FFFFFFF - (keys >> shift)).astype(np.int32).view(np.float32).astype(np.float64)  # probs[order]
    p[np.cumsum(p, axis=-1) - p > top_p] = 0.0
    return order, p / p.sum(-1, keepdims=True)


def pick_tokens(logits: jt.Var, temperature: float, top_p: float, rng: np.random.Generator,
                n_words: int = None) -> np.ndarray:
    """Greedy (argmax on the device) when temperature == 0, else temperature + nucleus sampling (on a GPU its
    candidates are found there: sample_top_p), among the ids below n_words (the tokenizer's): an embedding
    table may have more rows than the tokenizer has tokens (Qwen3's 151,936 for 151,669), and those padding
    rows are no tokens, whatever the weights give them. A row whose logits hold a NaN or inf picks
    NONFINITE_PICK: tested in the graph that picks, so it costs no sync of its own."""
    if n_words is not None and n_words < logits.shape[-1]:
        logits = logits[:, :n_words]
    broken = nonfinite_rows(logits)  # [B]
    if temperature == 0:
        return jt.where(broken, NONFINITE_PICK, jt.argmax(logits, dim=-1)[0]).numpy().astype(np.int64)
    # each row's largest logit made 0 first: a tiny temperature would make the others overflow, and Jittor's
    # softmax of logits near 1e12 is NaN; a broken row is sampled from zeros, then its pick discarded
    logits = jt.where(broken.unsqueeze(-1), 0.0, logits)
    probs = nn.softmax((logits - logits.max(dim=-1, keepdims=True)) / temperature, dim=-1)
    picks = sample_top_p(probs if jt.flags.use_cuda else probs.numpy(), top_p, rng)
    return np.where(broken.numpy(), NONFINITE_PICK, picks)


def fetch_records(step_records: list, store: list):
    """Per-layer numpy copies of one forward's router records, appended to `store`: type_weight,
    threshold, and expert_weights {family: [B,T,E]} of the families that mix several experts."""
    vars_ = [r[k] for r in step_records for k in ("type_weight", "threshold") if r[k] is not None]
    vars_ += [v for r in step_records for v in r.get("expert_weights", {}).values()]
    jt.sync(vars_)
    store.append([{"type_weight": None if r["type_weight"] is None else r["type_weight"].numpy(),
                   "threshold": None if r["threshold"] is None else r["threshold"].numpy(),
                   "expert_weights": {f: v.numpy() for f, v in r.get("expert_weights", {}).items()}}
                  for r in step_records])


def row_records(steps: list, row: int, n_tokens: int) -> list:
    """Join the steps along time for one row: per layer {type_weight [n,n_types], token_weight [n,1],
    expert_weight {family: [n,E]}}."""
    def joined(parts):
        return np.concatenate(parts, 0)[:n_tokens].astype(np.float32) if parts else None

    layers = []
    for layer in range(len(steps[0])):
        out = {name: joined([step[layer][key][row] for step in steps if step[layer][key] is not None])
               for key, name in (("type_weight", "type_weight"), ("threshold", "token_weight"))}
        out["expert_weight"] = {family: joined([step[layer]["expert_weights"][family][row] for step in steps])
                                for family in steps[0][layer]["expert_weights"]}
        layers.append(out)
    return layers


def generate(model, tokenizer, prompt_token_lists, max_gen_len: int, temperature: float = 0.0,
             top_p: float = 0.9, seed: int = 0, records=None, batch_size=None, prefill_step: int = 64,
             budget_seq_len=None, timings=None, names=None):
    """Continue each prompt (a list of token ids, bos included) by up to max_gen_len tokens. `tokenizer` gives
    stop_tokens (the ids that end a generation) and n_words (generated ids stay below it: pick_tokens).

    budget_seq_len: the authors' budget, a sequence length that no example's prompt plus
      generation exceeds: each prompt gets min(max_gen_len, budget_seq_len - len(prompt))
      tokens (none when its prompt fills it), whatever the batch. The authors' inference
      takes it from the adapter's config (its training max_seq_len).

    Returns one list of generated ids per prompt, cut before the first stop token. Logits holding NaN or inf
    where a prompt's token is picked raise NonFiniteLogits: a base or adapter that overflows in its precision
    stops here instead of generating token 0.
    records: a list that receives, per prompt, a per-layer list of dicts
      {"type_weight": [n, n_types] or None, "token_weight": [n, 1] (Sparse Gamma) or None,
       "expert_weight": {family: [n, E]} of the families mixing E > 1 experts}
    for the n = len(prompt) + len(generated) tokens, as numpy float32. Instance-level
    methods repeat their sequence's gates on every token.
    batch_size: pad the batch with copies of the first prompt to this many rows,
      so the last, smaller batch of a run reuses the compiled shapes.
    timings: a dict that receives prefill_s and prefill_tokens (the chunks, all rows), decode_s and
      decode_steps (one token per row each; the first picks belong to the prefill), and sampling_s (the
      decode steps' softmax and picks, in decode_s), for benchmarks.
    names: what a NonFiniteLogits calls each prompt (default: its row).
    """
    prompts = [list(map(int, p)) for p in prompt_token_lists]
    n_real = len(prompts)
    if n_real == 0:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (the bos)")
    if batch_size is not None:
        if n_real > batch_size:
            raise ValueError(f"{n_real} prompts do not fit batch_size={batch_size}")
        prompts += [prompts[0]] * (batch_size - n_real)
    max_seq_len = model.llama.args.max_seq_len
    lengths = np.array([len(p) for p in prompts])
    if lengths.max() >= max_seq_len:
        raise ValueError(f"a prompt of {lengths.max()} tokens leaves no room to generate in max_seq_len={max_seq_len}")
    budgets = np.full(len(prompts), max_gen_len)  # [B] tokens each row may generate
    if budget_seq_len is not None:
        budgets = np.clip(np.minimum(budgets, budget_seq_len - lengths), 0, None)
    if budgets.max() <= 0:
        if records is not None:
            records.extend([] for _ in range(n_real))
        return [[] for _ in range(n_real)]

    B = len(prompts)
    total_len = min(max_seq_len, int((lengths + budgets).max()))
    tokens = np.full((B, total_len), PAD_TOKEN, dtype=np.int64)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    is_prompt = np.arange(total_len)[None, :] < lengths[:, None]  # [B, total_len]
    stop_ids = np.array(sorted(tokenizer.stop_tokens))
    rng = np.random.default_rng(seed)
    steps = [] if records is not None else None
    done = budgets <= 0

    def forward(fn, *args):
        step_records = [] if steps is not None else None
        logits = fn(model, *args, records=step_records)
        if steps is not None:
            fetch_records(step_records, steps)
        return logits

    model.eval()
    with jt.no_grad():
        start = time.perf_counter()
        shortest = int(lengths.min())  # instance-level gates pool the prefill: all of it, in one call, as the authors'
        chunks = [shortest] if model.llama.args.method in INSTANCE_METHODS else prefill_chunks(shortest, prefill_step)
        model.llama.reset_cache()
        P = 0
        for length in chunks:
            logits = forward(feed, tokens[:, P:P + length], P)
            P += length
        last_fed, n_steps, sampling_s = P - 1, 0, 0.0
        for pos in range(P, total_len):
            if timings is not None:
                logits.sync()  # the forward's time stays out of the sampling's
                picking = time.perf_counter()
            picked = pick_tokens(logits, temperature, top_p, rng, tokenizer.n_words)
            if timings is not None and pos > P:
                sampling_s += time.perf_counter() - picking
            if pos == P:
                prefilled = time.perf_counter()
            generated = pos - lengths + 1  # tokens each row has generated so far (<= 0: still in its prompt)
            broken = np.flatnonzero((picked[:n_real] == NONFINITE_PICK) & ~done[:n_real] & ~is_prompt[:n_real, pos])
            if len(broken):  # a row whose pick is kept; a finished one's later logits are read by no one
                row = int(broken[0])
                raise NonFiniteLogits(row, int(generated[row]), model.llama.args.precision, names and names[row])
            picked[picked == NONFINITE_PICK] = PAD_TOKEN  # a finished row's, fed but never read
            tokens[:, pos] = np.where(is_prompt[:, pos], tokens[:, pos], picked)
            done |= ~is_prompt[:, pos] & np.isin(tokens[:, pos], stop_ids)
            done |= generated >= budgets
            last_pos = pos
            if done.all() or pos + 1 == total_len:
                break
            logits = forward(feed, tokens[:, pos:pos + 1], pos)
            last_fed, n_steps = pos, n_steps + 1
        if steps is not None and last_fed < last_pos:
            forward(feed, tokens[:, last_pos:last_pos + 1], last_pos)  # router values of the last kept token
        if timings is not None:
            timings.update(prefill_s=prefilled - start, prefill_tokens=B * P,
                           decode_s=time.perf_counter() - prefilled, decode_steps=n_steps, sampling_s=sampling_s)

    outputs = []
    for b in range(n_real):
        out = tokens[b, lengths[b]:min(last_pos + 1, lengths[b] + budgets[b])].tolist()
        stops = [i for i, t in enumerate(out) if t in tokenizer.stop_tokens]
        outputs.append(out[:stops[0]] if stops else out)
        if records is not None:
            records.append(row_records(steps, b, lengths[b] + len(outputs[-1])))
    return outputs
