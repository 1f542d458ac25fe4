"""Tokenizers: LLaMA-3's (a tiktoken byte-level BPE plus 256 special tokens, spec section 2) for Meta's
tokenizer.model, and HFTokenizer for a Hugging Face folder's tokenizer.json; one interface.

Tokenizer works with any tiktoken BPE file (Meta's 128000-token one or a small one written by
Data/bpe.py); the special tokens always come right after the base vocabulary.
"""
import hashlib
import os
import re

import tiktoken
import tokenizers
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
        return self.model.decode(known_ids(ids, self.n_words))


def known_ids(ids, n_words: int) -> list:
    """ids as ints without padding (negative ids); an id past the vocabulary is an error."""
    ids = [int(i) for i in ids]
    too_big = [i for i in ids if i >= n_words]
    if too_big:
        raise ValueError(f"token id {too_big[0]} is outside the vocabulary of {n_words}")
    return [i for i in ids if i >= 0]


def decode_until_unknown(tokenizer, ids) -> tuple:
    """(text of `ids` up to the first id outside the tokenizer's vocabulary, that id or None): a generation
    keeps its text should a model still produce such an id."""
    ids = [int(i) for i in ids]
    unknown = next((i for i in ids if i >= tokenizer.n_words), None)
    return tokenizer.decode(ids if unknown is None else ids[:ids.index(unknown)]), unknown


class HFTokenizer:
    """A Hugging Face tokenizer.json through the `tokenizers` library, with Tokenizer's interface. The
    folder's files name its special ids (Models/formats/hf.open_tokenizer calls use_special_ids);
    text that spells a special token stays plain text, as in Tokenizer.encode."""

    def __init__(self, path):
        self.model_path = str(path)
        try:
            self.model = tokenizers.Tokenizer.from_file(self.model_path)
        except Exception as err:  # the library raises a bare Exception for any file it cannot read
            raise ValueError(f"{path} is not a tokenizer.json of the tokenizers library: {err}") from None
        self.model.encode_special_tokens = True
        ids = self.model.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(f"{path}: its vocabulary (model.vocab and added_tokens) is empty")
        self.n_words = max(ids) + 1
        self.bos_id = self.eos_id = None
        self.pad_id = -1
        self.stop_tokens = set()

    def token_id(self, text: str):
        """The id of a token's text, or None."""
        return self.model.token_to_id(text)

    def use_special_ids(self, bos_id, eos_id: int, pad_id, stop_tokens: set):
        """BOS (None: sequences start without one, as Qwen3's), EOS, pad (None: -1) and the ids that end
        a generation."""
        self.bos_id, self.eos_id, self.stop_tokens = bos_id, eos_id, set(stop_tokens)
        self.pad_id = -1 if pad_id is None else pad_id

    def encode(self, s, *, bos, eos):
        """Token ids of s, with BOS first (if the tokenizer has one) and EOS last when asked."""
        if not isinstance(s, str):
            raise TypeError(f"HFTokenizer.encode expects a str, got {type(s).__name__}")
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        ids.extend(self.model.encode(s, add_special_tokens=False).ids)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids):
        """Text of ids, skipping padding (negative ids); special tokens are written out."""
        return self.model.decode(known_ids(ids, self.n_words), skip_special_tokens=False)


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
