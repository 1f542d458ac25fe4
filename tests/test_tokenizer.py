"""Tokenizer (Models/Tokenizer.py) against the genuine LLaMA-3 file, and the BPE trainer (Data/bpe.py)."""
import base64
import json
import random
import time
from collections import Counter

import pytest
from conftest import shared_path

from Data.bpe import DIGIT_IDS, count_pieces, mergeable_pairs, merge_pair, train_bpe
from Models.Tokenizer import ChatFormat, Tokenizer


@pytest.fixture(scope="module")
def llama3():
    return Tokenizer(shared_path("llama3", "tokenizer.model"))


# ---- genuine LLaMA-3 tokenizer ------------------------------------------------------------

def test_vocabulary_and_special_ids(llama3):
    assert llama3.n_words == 128256
    assert (llama3.bos_id, llama3.eos_id, llama3.eot_id) == (128000, 128001, 128009)
    assert llama3.pad_id == -1
    assert llama3.stop_tokens == {128001, 128009}
    assert len(llama3.special_tokens) == 256
    assert llama3.special_tokens["<|start_header_id|>"] == 128006
    assert llama3.special_tokens["<|end_header_id|>"] == 128007
    assert llama3.special_tokens["<|reserved_special_token_4|>"] == 128008
    assert llama3.special_tokens["<|reserved_special_token_250|>"] == 128255


# Expected ids came from tiktoken.Encoding built directly on the file with LLaMA-3's regex.
PINNED = {
    "Hello, world! The quick brown fox.": [9906, 11, 1917, 0, 578, 4062, 14198, 39935, 13],
    "1234567": [4513, 10961, 22],
    "你好，世界": [57668, 53901, 3922, 102616],
    "🦙 llama": [9468, 99, 247, 94776],
    "   leading spaces": [256, 6522, 12908],
}


@pytest.mark.parametrize("text", list(PINNED))
def test_pinned_ids(llama3, text):
    assert llama3.encode(text, bos=False, eos=False) == PINNED[text]
    assert llama3.decode(PINNED[text]) == text


def test_bos_eos_flags(llama3):
    body = PINNED["1234567"]
    assert llama3.encode("1234567", bos=True, eos=False) == [128000] + body
    assert llama3.encode("1234567", bos=False, eos=True) == body + [128001]
    assert llama3.encode("1234567", bos=True, eos=True) == [128000] + body + [128001]
    assert llama3.encode("", bos=True, eos=True) == [128000, 128001]


def test_special_token_text(llama3):
    plain = llama3.encode("<|eot_id|>", bos=False, eos=False)
    assert 128009 not in plain and llama3.decode(plain) == "<|eot_id|>"
    assert llama3.encode("<|eot_id|>", bos=False, eos=False, allowed_special="all") == [128009]
    assert llama3.encode("a<|eot_id|>", bos=False, eos=False, allowed_special={"<|eot_id|>"})[-1] == 128009
    with pytest.raises(ValueError):
        llama3.encode("<|eot_id|>", bos=False, eos=False, disallowed_special="all")


def test_decode_skips_padding(llama3):
    ids = llama3.encode("pad me", bos=False, eos=False)
    assert llama3.decode(ids + [llama3.pad_id, -1, -1]) == "pad me"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.decode([128256])


def math_files():
    root = shared_path("data", "math")
    files = sorted(root.rglob("*.json"))
    assert files, f"no JSON files under {root}"
    return files


def test_round_trip_math_data(llama3):
    n_texts = 0
    for path in math_files():
        for record in json.loads(path.read_text(encoding="utf-8")):
            for field in ("instruction", "output"):
                text = record[field]
                assert llama3.decode(llama3.encode(text, bos=False, eos=False)) == text, (path, field)
                n_texts += 1
    assert n_texts > 1000


def test_megabyte_without_whitespace(llama3):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*/=()"
    text = "".join(rng.choice(alphabet) for _ in range(1_000_000))
    start = time.time()
    ids = llama3.encode(text, bos=False, eos=False)
    assert time.time() - start < 60
    assert llama3.decode(ids) == text
    same_letter = "x" * 1_000_000
    assert llama3.decode(llama3.encode(same_letter, bos=False, eos=False)) == same_letter


def test_chat_format(llama3):
    chat = ChatFormat(llama3)
    user = {"role": "user", "content": " What is 2+2? "}
    header = chat.encode_header(user)
    assert header == [128006, 882, 128007, 271]  # 882 "user", 271 "\n\n"
    message = chat.encode_message(user)
    assert message[:4] == header and message[-1] == 128009
    assert llama3.decode(message[4:-1]) == "What is 2+2?"  # content is stripped
    prompt = chat.encode_dialog_prompt([user])
    assert prompt[0] == 128000 and prompt[1:-4] == message
    assert prompt[-4:] == [128006, 78191, 128007, 271]  # open "assistant" header


# ---- bad tokenizer files --------------------------------------------------------------------

def test_missing_file(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer(missing)


@pytest.mark.parametrize("contents", [
    json.dumps({"vocab": {"a": 0, "b": 1}}, indent=2).encode(),
    bytes(random.Random(1).getrandbits(8) for _ in range(4096)),
    b"",
    b"YQ== 0\nYg== 1\n",  # parses, but lacks most single bytes
], ids=["json", "garbage", "empty", "too-small"])
def test_bad_file(tmp_path, contents):
    path = tmp_path / "bad.model"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match="bad.model") as err:
        Tokenizer(path)
    assert "tiktoken BPE file" in str(err.value) and "base64 token, space, rank" in str(err.value)


def test_changed_file_is_reread(tmp_path):
    """tiktoken caches files by path; rewriting the same path must not give the old vocabulary."""
    path = tmp_path / "tok.model"
    train_bpe(["ab ab ab ab"], 257, path)
    assert Tokenizer(path).n_words == 257 + 256
    train_bpe(["ab ab ab ab cd cd cd"], 258, path)
    assert Tokenizer(path).n_words == 258 + 256


# ---- BPE trainer ----------------------------------------------------------------------------

def arithmetic_corpus(n=4000, seed=0):
    """Short word problems with their arithmetic, varied enough for a few hundred merges."""
    rng = random.Random(seed)
    names = ["Alice", "Bob", "Carmen", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal"]
    items = ["apples", "pencils", "marbles", "cookies", "tickets", "stamps", "books", "shells"]
    verbs = [("buys", "+", lambda a, b: a + b), ("finds", "+", lambda a, b: a + b),
             ("gives away", "-", lambda a, b: a - b), ("loses", "-", lambda a, b: a - b),
             ("multiplies", "*", lambda a, b: a * b)]
    lines = []
    for _ in range(n):
        name, item = rng.choice(names), rng.choice(items)
        verb, sym, fn = rng.choice(verbs)
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        lines.append(f"{name} has {a} {item} and {verb} {b}. How many {item} does {name} have now?\n"
                     f"Answer: {a} {sym} {b} = {fn(a, b)}. The answer is {fn(a, b)}.")
    return lines


@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "arith.model"
    texts = arithmetic_corpus()
    assert train_bpe(texts, 400, path) == path
    return path, texts


def test_bpe_file_loads_and_round_trips(small_bpe):
    path, texts = small_bpe
    lines = path.read_text(encoding="ascii").splitlines()
    assert len(lines) == 400
    assert [base64.b64decode(line.split()[0]) for line in lines[:256]] == [bytes([b]) for b in range(256)]
    tok = Tokenizer(path)
    assert tok.n_words == 400 + 256 and tok.bos_id == 400 and tok.eot_id == 409
    for text in texts[:200] + ["unseen words, ünïcödé and 🦙 too", "-42 * 7 = -294"]:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids[1:-1]) == text


def test_bpe_digits_are_single_tokens(small_bpe):
    path, _ = small_bpe
    tok = Tokenizer(path)
    assert tok.encode("1234567890", bos=False, eos=False) == list(b"1234567890")
    for rank, line in enumerate(path.read_text(encoding="ascii").splitlines()):
        token = base64.b64decode(line.split()[0])
        assert len(token) == 1 or not any(chr(b).isdigit() for b in token), (rank, token)


def test_bpe_merges_shorten_text(small_bpe):
    path, texts = small_bpe
    tok = Tokenizer(path)
    text = "\n".join(texts[:500])
    n_tokens = len(tok.encode(text, bos=False, eos=False))
    assert n_tokens < 0.6 * len(text.encode("utf-8"))


def naive_bpe_vocab(texts, vocab_size):
    """Reference trainer: recount every pair before each merge."""
    vocab = [bytes([b]) for b in range(256)]
    pieces = count_pieces(texts)
    words = {piece: list(piece) for piece in pieces}
    while len(vocab) < vocab_size:
        counts = Counter()
        for piece, symbols in words.items():
            for pair in mergeable_pairs(symbols):
                counts[pair] += pieces[piece]
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], vocab[p[0]], vocab[p[1]]))
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in vocab:
            vocab.append(merged)
        words = {piece: merge_pair(s, pair, vocab.index(merged)) for piece, s in words.items()}
    return vocab


def test_bpe_matches_naive_recount(tmp_path):
    texts = arithmetic_corpus(300, seed=1) + ["aaaa aaa abab ababab the then there"]
    path = train_bpe(texts, 330, tmp_path / "inc.model")
    lines = path.read_text(encoding="ascii").splitlines()
    trained = [base64.b64decode(line.split()[0]) for line in lines]
    assert len(trained) == 330
    assert trained == naive_bpe_vocab(texts, 330)
    assert not any(b in DIGIT_IDS for token in trained[256:] for b in token)


def test_bpe_is_deterministic(tmp_path):
    texts = arithmetic_corpus(500, seed=2)
    first = train_bpe(texts, 300, tmp_path / "a.model").read_bytes()
    assert train_bpe(list(reversed(texts)), 300, tmp_path / "b.model").read_bytes() == first


def test_bpe_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(["abc"], 100, tmp_path / "x.model")
