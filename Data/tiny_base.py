"""Tiny LLaMA-3 bases in Meta's directory format, made by the project itself.

`write_random_base` gives a randomly initialised one (tests, smoke runs); the
demo's pretrained base is shipped in assets/ and rebuilt by scripts/build_base.py.
"""
import json
import os

import numpy as np

from Data.bpe import train_bpe
from Data.synthetic import make_splits

from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.pth import save_pth

N_SPECIAL = 256  # LLaMA-3's special tokens follow the BPE vocabulary


def synthetic_corpus(n_examples: int = 2000, seed: int = 0) -> list:
    train, _, _ = make_splits(n_examples, 0, 0, seed=seed)
    return [f"{ex['instruction']} {ex['output']}" for ex in train]


def write_tokenizer(out_dir: str, bpe_vocab: int = 512, seed: int = 0) -> Tokenizer:
    path = os.path.join(out_dir, "tokenizer.model")
    train_bpe(synthetic_corpus(seed=seed), bpe_vocab, path)
    return Tokenizer(path)


def params_for(n_words: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, multiple_of: int) -> dict:
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=n_words,
                multiple_of=multiple_of, norm_eps=1e-5, rope_theta=500000.0)


def random_base_weights(args: ModelArgs, seed: int) -> dict:
    """Meta-named fp32 weights: N(0, 1/fan_in) matrices, unit norms, N(0,1) embeddings."""
    rng = np.random.default_rng(seed)
    D, F, hd = args.dim, args.ffn_hidden_dim, args.head_dim

    def matrix(out_features, in_features):
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)

    weights = {"tok_embeddings.weight": rng.standard_normal((args.vocab_size, D)).astype(np.float32),
               "norm.weight": np.ones(D, np.float32), "output.weight": matrix(args.vocab_size, D)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        weights.update({
            p + "attention.wq.weight": matrix(args.n_heads * hd, D),
            p + "attention.wk.weight": matrix(args.n_kv_heads * hd, D),
            p + "attention.wv.weight": matrix(args.n_kv_heads * hd, D),
            p + "attention.wo.weight": matrix(D, args.n_heads * hd),
            p + "feed_forward.w1.weight": matrix(F, D),
            p + "feed_forward.w2.weight": matrix(D, F),
            p + "feed_forward.w3.weight": matrix(F, D),
            p + "attention_norm.weight": np.ones(D, np.float32),
            p + "ffn_norm.weight": np.ones(D, np.float32)})
    return weights


def write_random_base(out_dir: str, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                      multiple_of: int = 16, bpe_vocab: int = 384, seed: int = 0) -> str:
    """params.json, tokenizer.model (BPE on synthetic math) and a random consolidated.00.pth."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = write_tokenizer(out_dir, bpe_vocab, seed)
    params = params_for(tokenizer.n_words, dim, n_layers, n_heads, n_kv_heads, multiple_of)
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump(params, f, indent=2)
    save_pth(random_base_weights(ModelArgs(**params), seed), os.path.join(out_dir, "consolidated.00.pth"))
    return out_dir


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BASE_DIR = os.path.join(REPO_ROOT, "assets", "tiny-math-base")


def ensure_default_base(path: str = DEFAULT_BASE_DIR) -> str:
    """The demo's pretrained base directory (shipped in the repository)."""
    if not os.path.isfile(os.path.join(path, "consolidated.00.pth")):
        raise FileNotFoundError(f"{path}: the demo base is missing; restore it with `git checkout -- assets` "
                                "or rebuild it with `python scripts/build_base.py` (about 45 minutes)")
    return path
