"""Tiny bases made by the project itself: LLaMA-3 in Meta's directory format, Qwen3 or LLaMA-3 in Hugging Face's.

`write_random_base` and `write_random_hf_base` give randomly initialised ones (tests, smoke runs);
the demo's pretrained base is shipped in assets/ and rebuilt by scripts/build_base.py.
"""
import json
import os

import numpy as np

from Data.bpe import train_bpe, train_hf_bpe
from Data.synthetic import make_splits

from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.hf import write_hf_base
from Models.formats.meta import meta_shapes
from Models.formats.pth_writer import save_pth
from Utils.file_io import write_json

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
    """Meta-named fp32 weights (meta_shapes): N(0, 1/fan_in) matrices, unit norms, N(0,1) embeddings
    (N(0, 1/dim) when they are the output matrix too)."""
    rng = np.random.default_rng(seed)
    shapes = meta_shapes(args)
    first = ["tok_embeddings.weight", "output.weight"]  # drawn first, then the layers in order
    weights = {}
    for name in first + [n for n in shapes if n not in first]:
        shape = shapes.get(name)
        if shape is None:
            continue
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
        elif name == "tok_embeddings.weight":
            scale = 1 / np.sqrt(args.dim) if args.tied_embeddings else 1.0
            weights[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
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


# the special tokens of a tiny Hugging Face base, with the conventions of its family: Qwen3 has no BOS,
# <|im_end|> ends a turn and <|endoftext|> pads; LLaMA-3 starts with <|begin_of_text|>, has no pad
HF_TOKENS = {"qwen3": dict(special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos="<|im_end|>",
                           pad="<|endoftext|>", ends=("<|im_end|>", "<|endoftext|>")),
             "llama": dict(special=("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"), bos="<|begin_of_text|>",
                           eos="<|end_of_text|>", pad=None, ends=("<|end_of_text|>", "<|eot_id|>"))}


def write_random_hf_base(out_dir: str, architecture: str = "qwen3", dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                         n_kv_heads: int = 2, head_dim: int = None, ffn_dim: int = 160, tied: bool = True,
                         bpe_vocab: int = 384, seed: int = 0, max_shard_bytes: int = None,
                         vocab_size: int = None) -> str:
    """A random Qwen3ForCausalLM (or LlamaForCausalLM) folder as the hub has them: config.json, bf16
    safetensors (sharded above max_shard_bytes), a byte-level BPE tokenizer.json (the `tokenizers`
    library, trained on synthetic math), tokenizer_config.json and generation_config.json (HF_TOKENS).
    vocab_size: the embedding table's rows (config.json), when more than the tokenizer's tokens: the rest
    pad it, as Qwen3's 151,936 rows do its 151,669 tokens."""
    tokens = HF_TOKENS[architecture]
    tokenizer = train_hf_bpe(synthetic_corpus(seed=seed), bpe_vocab, os.path.join(out_dir, "tokenizer.json"),
                             tokens["special"])
    write_json({"bos_token": tokens["bos"], "eos_token": tokens["eos"], "pad_token": tokens["pad"]},
               os.path.join(out_dir, "tokenizer_config.json"))
    ends = [tokenizer.token_to_id(t) for t in tokens["ends"]]
    write_json({"eos_token_id": ends}, os.path.join(out_dir, "generation_config.json"))
    qwen3 = architecture == "qwen3"
    args = ModelArgs(architecture=architecture, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     head_dim=head_dim, ffn_dim=ffn_dim, vocab_size=vocab_size or tokenizer.get_vocab_size(),
                     norm_eps=1e-6 if qwen3 else 1e-5, rope_theta=1e6 if qwen3 else 500000.0,
                     use_scaled_rope=not qwen3, qk_norm=qwen3, tied_embeddings=tied)
    write_hf_base(out_dir, args, random_base_weights(args, seed), max_shard_bytes, bf16=True)
    return out_dir


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BASE_DIR = os.path.join(REPO_ROOT, "assets", "tiny-math-base")


def ensure_default_base(path: str = DEFAULT_BASE_DIR) -> str:
    """The demo's pretrained base directory (shipped in the repository)."""
    if not os.path.isfile(os.path.join(path, "consolidated.00.pth")):
        raise FileNotFoundError(f"{path}: the demo base is missing; restore it with `git checkout -- assets` "
                                "or rebuild it with `python scripts/build_base.py` (about 45 minutes)")
    return path
