"""A small byte-level BPE trainer that writes a tiktoken BPE file (loadable by Models.Tokenizer);
`train_hf_bpe` makes a Hugging Face tokenizer.json with the `tokenizers` library instead.

Ranks 0..255 are the single bytes in byte order; each later rank is the most frequent
adjacent pair inside one pre-tokenised piece (LLaMA-3's regex). ASCII digits are never
merged, so numbers are tokenised digit by digit and arithmetic stays learnable.
Ties go to the smallest (left bytes, right bytes), so training is deterministic.

Pair counts are kept incrementally over a table of distinct pieces and their
frequencies; only the pieces containing the merged pair are revisited per merge.
"""
import base64
import heapq
import os
from collections import Counter, defaultdict

import regex
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from Models.Tokenizer import PRETOKENIZE_PATTERN

DIGIT_IDS = frozenset(b"0123456789")  # single-byte token ids of the ASCII digits


def count_pieces(texts):
    """{piece bytes: occurrences} over all texts, using LLaMA-3 pre-tokenisation."""
    pattern = regex.compile(PRETOKENIZE_PATTERN)
    counts = Counter()
    for text in texts:
        counts.update(pattern.findall(text))
    return Counter({piece.encode("utf-8"): n for piece, n in counts.items()})


def mergeable_pairs(symbols):
    """Adjacent pairs of a symbol list that may merge (no digit on either side)."""
    return [(a, b) for a, b in zip(symbols, symbols[1:]) if a not in DIGIT_IDS and b not in DIGIT_IDS]


def merge_pair(symbols, pair, new_id):
    """symbols with every non-overlapping occurrence of pair (left to right) replaced by new_id."""
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def write_tiktoken_bpe(vocab, path):
    """Write vocab (list of token bytes, index = rank) as 'base64 rank' lines."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="ascii") as f:
        for rank, token in enumerate(vocab):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def train_bpe(texts, vocab_size, path):
    """Learn a base vocabulary of vocab_size tokens (specials not counted) from texts; write it to path.

    Stops early, with a smaller vocabulary, when no mergeable pair is left.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    vocab = [bytes([b]) for b in range(256)]
    id_of = {token: i for i, token in enumerate(vocab)}

    pieces = count_pieces(texts)
    words = [list(piece) for piece in pieces]  # bytes -> ids, since byte b has id b
    freqs = list(pieces.values())

    pair_counts = Counter()
    words_with = defaultdict(set)  # pair -> indices of words that (may) contain it
    for w, symbols in enumerate(words):
        for pair in mergeable_pairs(symbols):
            pair_counts[pair] += freqs[w]
            words_with[pair].add(w)

    def heap_key(pair, count):
        return (-count, vocab[pair[0]], vocab[pair[1]], pair)

    # max-heap of (count, bytes order) with lazy deletion: stale entries are skipped on pop
    heap = [heap_key(p, c) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < vocab_size and heap:
        neg_count, _, _, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count or neg_count == 0:
            continue
        merged = vocab[pair[0]] + vocab[pair[1]]
        # two different splits can spell the same bytes; reuse the existing token then
        new_id = id_of.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            id_of[merged] = new_id

        changed = Counter()
        for w in words_with.pop(pair):
            old = words[w]
            new = merge_pair(old, pair, new_id)
            if len(new) == len(old):
                continue
            words[w] = new
            for p in mergeable_pairs(old):
                changed[p] -= freqs[w]
            for p in mergeable_pairs(new):
                changed[p] += freqs[w]
                if p != pair:
                    words_with[p].add(w)
        for p, delta in changed.items():
            if delta == 0:
                continue
            pair_counts[p] += delta
            if pair_counts[p] <= 0:
                del pair_counts[p]
            else:
                heapq.heappush(heap, heap_key(p, pair_counts[p]))
        pair_counts.pop(pair, None)

    write_tiktoken_bpe(vocab, path)
    return path


def train_hf_bpe(texts, vocab_size, path, special_tokens) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer.json learnt from texts by the `tokenizers` library: the 256 byte tokens,
    merges up to vocab_size (digits split one by one, as Qwen's pre-tokenizer does), then
    special_tokens; written to path."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(list(special_tokens))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer
