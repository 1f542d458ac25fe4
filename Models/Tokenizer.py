"""LLaMA-3 tokenizer: a tiktoken byte-level BPE plus 256 special tokens (spec section 2).

Works with any tiktoken BPE file (Meta's 128000-token one or a small one written by
Data/bpe.py); the special tokens always come right after the base vocabulary.
"""
import hashlib
import os
import re

import tiktoken
from tiktoken.load import load_tiktoken_bpe

# LLaMA-3's pre-tokenisation: contractions, words (with one leading non-letter),
# numbers in groups of at most 3 digits, punctuation runs, newlines, other spaces.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_SPECIAL_TOKENS = 256
NAMED_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
]

# tiktoken's BPE is quadratic in the length of one pre-tokenised piece and copies the
# whole text across to Rust, so huge inputs are cut into bounded pieces first.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000  # longest run of only-whitespace or only-non-whitespace kept whole
_RUN = re.compile(r"\s+|\S+")

FORMAT_HINT = "one line per token: base64 token, space, rank"


def special_token_names():
    """The 256 special token strings in LLaMA-3's order."""
    n_reserved = NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, 5 + n_reserved)]
    return NAMED_SPECIAL_TOKENS + reserved


def load_bpe_ranks(model_path):
    """The {token bytes: rank} table of a tiktoken BPE file, with clear errors for bad files."""
    model_path = str(model_path)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"tokenizer file {model_path} does not exist (expected a tiktoken BPE file, {FORMAT_HINT})")
    with open(model_path, "rb") as f:
        contents = f.read()
    # tiktoken caches files by path; the content hash makes it re-read a file that changed.
    try:
        ranks = load_tiktoken_bpe(model_path, expected_hash=hashlib.sha256(contents).hexdigest())
    except Exception as err:
        raise ValueError(f"{model_path} is not a tiktoken BPE file ({FORMAT_HINT}): {err}") from None
    problem = None
    if not ranks:
        problem = "it has no tokens"
    elif sorted(ranks.values()) != list(range(len(ranks))):
        problem = "its ranks are not the distinct numbers 0..n-1"
    elif any(bytes([b]) not in ranks for b in range(256)):
        problem = "it lacks some of the 256 single-byte tokens, so not every text can be encoded"
    if problem:
        raise ValueError(f"{model_path} is not a usable tiktoken BPE file ({FORMAT_HINT}): {problem}")
    return ranks


def split_for_encoding(text):
    """Cut text into pieces tiktoken handles quickly; concatenating them gives back text."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:
            yield chunk
            continue
        piece_start = 0
        for run in _RUN.finditer(chunk):
            # cut every MAX_RUN_CHARS characters inside an over-long run
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[piece_start:cut]
                piece_start = cut
        yield chunk[piece_start:]


class Tokenizer:
    """tiktoken BPE with LLaMA-3's regex and special tokens; ids of specials follow the base vocab."""

    pad_id = -1

    def __init__(self, model_path):
        self.model_path = str(model_path)
        mergeable_ranks = load_bpe_ranks(self.model_path)
        n_base = len(mergeable_ranks)
        self.special_tokens = {name: n_base + i for i, name in enumerate(special_token_names())}
        self.model = tiktoken.Encoding(
            name=os.path.basename(self.model_path),
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = n_base + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.stop_tokens = {self.eos_id, self.eot_id}

    def encode(self, s, *, bos, eos, allowed_special=(), disallowed_special=()):
        """Token ids of s; special-token text is plain text unless listed in allowed_special."""
        if not isinstance(s, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(s).__name__}")
        # tiktoken wants sets (or "all"), not the tuples used as defaults here
        if allowed_special != "all":
            allowed_special = set(allowed_special)
        if disallowed_special != "all":
            disallowed_special = set(disallowed_special)
        ids = [self.bos_id] if bos else []
        for piece in split_for_encoding(s):
            ids.extend(self.model.encode(piece, allowed_special=allowed_special,
                                         disallowed_special=disallowed_special))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids):
        """Text of ids, skipping padding (negative ids); invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        too_big = [i for i in ids if i >= self.n_words]
        if too_big:
            raise ValueError(f"token id {too_big[0]} is outside the vocabulary of {self.n_words}")
        return self.model.decode([i for i in ids if i >= 0])


class ChatFormat:
    """LLaMA-3 chat layout: <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_header(self, message):
        tok = self.tokenizer
        return ([tok.special_tokens["<|start_header_id|>"]]
                + tok.encode(message["role"], bos=False, eos=False)
                + [tok.special_tokens["<|end_header_id|>"]]
                + tok.encode("\n\n", bos=False, eos=False))

    def encode_message(self, message):
        content = self.tokenizer.encode(message["content"].strip(), bos=False, eos=False)
        return self.encode_header(message) + content + [self.tokenizer.eot_id]

    def encode_dialog_prompt(self, dialog):
        """bos, every message, then an open assistant header for the model to complete."""
        ids = [self.tokenizer.bos_id]
        for message in dialog:
            ids.extend(self.encode_message(message))
        ids.extend(self.encode_header({"role": "assistant", "content": ""}))
        return ids
