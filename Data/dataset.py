"""LLM-Adapters data files -> padded token batches for fine-tuning.

Conventions (the training loss relies on them):
- One example is `[bos] + encode(prompt) + encode(output) + [eos]`. Prompt and
  output are encoded separately, so the prompt tokens are exactly what
  generation is fed at inference time and the mask boundary is exact (encoding
  the joined text could merge ":" and the output's leading "\\n" into one token).
- `tokens` int32 [B, L] and `loss_mask` float32 [B, L] share one index:
  `loss_mask[b, t] = 1` when `tokens[b, t]` is a target, i.e. an output or eos
  token. The loss is `cross_entropy(logits[:, :-1], tokens[:, 1:])` weighted
  by `loss_mask[:, 1:]`, so `loss_mask[:, 0]` (bos) is always 0. Prompt and
  padding positions are 0. This is an explicit mask: genuine token id 0 ("!")
  still counts, unlike the authors' label-0/ignore_index=0 scheme.
- Padding feeds token 0 (the tokenizer's pad_id -1 is never fed to the model)
  and is masked out; every row of a batch is padded to one length bucket, the
  smallest bucket that fits the batch's longest row, so Jittor compiles only a
  handful of shapes.
- Too long examples are cut from the `input` field first, then from the end
  (output tail and eos go; a cut answer must not teach the model to stop).
- Order: a permutation seeded by (seed, epoch), the same on every rank. Global
  batch `step` is `order[step*B:(step+1)*B]` and rank r takes rows r::world.
  `batches(epoch, start_step)` therefore resumes exactly from (epoch, step).
"""
import json
import os

import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt
from jittor.dataset import Dataset

from Data.prompts import format_prompt
from Utils.file_io import check_encodable, read_input

FIELDS = ("instruction", "input", "output", "answer")
TEXT_FIELDS = ("instruction", "input", "output")
PAD_TOKEN = 0  # what padding feeds the model; the mask makes it irrelevant


def load_examples(path, need_answer=True):
    """Read a JSON list of {instruction, input, output, answer}; answers become strings. Training
    (need_answer=False) reads only instruction, input and output (code instruction sets have no answer).
    Text no encoding can write (Utils/file_io.check_encodable) is refused here, naming the example."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    try:
        data = json.loads(read_input(path).decode("utf-8"))  # a FIFO is polled: Ctrl-C still ends the run
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of examples, found a {type(data).__name__}")
    if not data:
        raise ValueError(f"{path}: the list of examples is empty")
    examples = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: item {i} is a {type(item).__name__}, expected an object with fields {FIELDS}")
        for field in FIELDS if need_answer else TEXT_FIELDS:
            if field not in item:
                raise ValueError(f"{path}: item {i} is missing the field '{field}'")
        for field in TEXT_FIELDS:
            if not isinstance(item[field], str):
                raise ValueError(f"{path}: item {i} field '{field}' is a {type(item[field]).__name__}, expected a string")
        check_encodable(item, path, f"example {i}")
        examples.append({**{field: item[field] for field in TEXT_FIELDS}, "answer": str(item.get("answer", ""))})
    return examples


def split_validation(examples, val_fraction, seed=0):
    """Hold out a seeded fraction: returns (train, val), disjoint, each in the original order."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(round(len(examples) * val_fraction)))
    if n_val >= len(examples):
        raise ValueError(f"val_fraction {val_fraction} leaves no training examples out of {len(examples)}")
    is_val = np.zeros(len(examples), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(examples))[:n_val]] = True
    train = [ex for ex, v in zip(examples, is_val) if not v]
    val = [ex for ex, v in zip(examples, is_val) if v]
    return train, val


def default_buckets(max_seq_len, step=64):
    """Multiples of `step` below max_seq_len, then max_seq_len itself."""
    return list(range(step, max_seq_len, step)) + [max_seq_len]


def bucket_for(length, buckets):
    """The smallest bucket that holds `length` tokens."""
    for size in buckets:
        if size >= length:
            return size
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def encode_example(tokenizer, example, max_seq_len):
    """(tokens int32 [n], loss_mask float32 [n]) for one example, n <= max_seq_len."""
    return encode_and_cut(tokenizer, example, max_seq_len)[:2]


def encode_and_cut(tokenizer, example, max_seq_len):
    """encode_example's (tokens, loss_mask) and whether the example had to be cut to fit."""
    example = dict(example)
    prompt_ids = tokenizer.encode(format_prompt(example), bos=True, eos=False)
    output_ids = tokenizer.encode(example["output"], bos=False, eos=True)
    excess = len(prompt_ids) + len(output_ids) - max_seq_len
    cut = excess > 0
    if excess > 0 and example.get("input"):
        input_ids = tokenizer.encode(example["input"], bos=False, eos=False)
        keep = len(input_ids)
        # Re-encoding the cut text can shift a token or two, so shrink until it fits;
        # `keep` falls every round, so this ends (at worst with the input gone).
        while excess > 0 and keep > 0:
            keep = max(0, keep - excess)
            example["input"] = tokenizer.decode(input_ids[:keep])
            prompt_ids = tokenizer.encode(format_prompt(example), bos=True, eos=False)
            excess = len(prompt_ids) + len(output_ids) - max_seq_len
    tokens = (prompt_ids + output_ids)[:max_seq_len]
    mask = ([0.0] * len(prompt_ids) + [1.0] * len(output_ids))[:max_seq_len]
    return np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.float32), cut


def pad_to_bucket(rows, buckets):
    """Stack (tokens, mask) rows into [B, L] arrays, L the bucket of the longest row."""
    length = bucket_for(max(len(tokens) for tokens, _ in rows), buckets)
    tokens = np.full((len(rows), length), PAD_TOKEN, dtype=np.int32)
    mask = np.zeros((len(rows), length), dtype=np.float32)
    for i, (row_tokens, row_mask) in enumerate(rows):
        tokens[i, :len(row_tokens)] = row_tokens
        mask[i, :len(row_mask)] = row_mask
    return tokens, mask


EMPTY_ROW = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32))


class FinetuneDataset(Dataset):
    """Tokenised examples, served as (tokens, loss_mask) batches for this rank.

    `batch_size` is the GLOBAL batch size (as in jittor.dataset.Dataset); each of
    `world_size` ranks gets `batch_size // world_size` rows. We order and shard
    explicitly instead of using Jittor's built-in shuffle, whose RNG is stateful
    (not resumable from (epoch, step)) and whose last-batch split is uneven.
    With drop_last=False the final global batch is filled with empty rows (all
    padding, mask 0), so every rank sees the same number of equally sized
    batches; reduce the loss as sum(mask * ce) / sum(mask) over all ranks.
    `len(ds)` is the number of batches per epoch (the same on every rank).
    """

    def __init__(self, examples, tokenizer, max_seq_len, batch_size, buckets=None, shuffle=True,
                 drop_last=True, seed=0, rank=None, world_size=None, keep_numpy_array=False):
        super().__init__(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                         num_workers=0, keep_numpy_array=keep_numpy_array)
        self.rank = jt.rank if rank is None else rank
        self.world_size = jt.world_size if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if batch_size % self.world_size:
            raise ValueError(f"global batch_size {batch_size} is not divisible by world_size {self.world_size}")
        self.local_batch_size = batch_size // self.world_size
        self.max_seq_len = max_seq_len
        self.buckets = sorted(buckets) if buckets else default_buckets(max_seq_len)
        if self.buckets[-1] < max_seq_len:
            raise ValueError(f"largest bucket {self.buckets[-1]} is shorter than max_seq_len {max_seq_len}")
        self.seed, self.epoch, self.start_step = seed, 0, 0

        encoded = [encode_and_cut(tokenizer, ex, max_seq_len) for ex in examples]
        self.encoded = [(tokens, mask) for tokens, mask, _ in encoded]
        self.n_cut = sum(cut for _, _, cut in encoded)  # examples longer than max_seq_len
        self.n_targets = int(sum(mask[1:].sum() for _, mask in self.encoded))  # what the loss counts
        self.total_len = len(self.encoded)
        if self.total_len == 0 or (drop_last and self.total_len < batch_size):
            raise ValueError(f"{self.total_len} examples cannot fill one global batch of {batch_size}")
        self.n_unlearnable = sum(1 for _, mask in self.encoded if not mask.any())  # a prompt of max_seq_len+ tokens

    def __len__(self):
        full, rest = divmod(self.total_len, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __getitem__(self, index):
        return self.encoded[index]

    def set_epoch(self, epoch, start_step=0):
        """Choose the epoch's order, and the global batch to start from when resuming."""
        self.epoch, self.start_step = epoch, start_step

    def epoch_order(self, epoch):
        if not self.shuffle:
            return np.arange(self.total_len)
        return np.random.default_rng([self.seed, epoch]).permutation(self.total_len)

    def global_batch_indices(self, epoch, step):
        """Example indices of global batch `step`; -1 marks a filler row."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is outside the {len(self)} batches of an epoch")
        indices = self.epoch_order(epoch)[step * self.batch_size:(step + 1) * self.batch_size]
        return np.pad(indices, (0, self.batch_size - len(indices)), constant_values=-1)

    def local_batch_indices(self, epoch, step):
        """This rank's share of global batch `step`: rows rank::world_size."""
        return self.global_batch_indices(epoch, step)[self.rank::self.world_size]

    def collate_batch(self, batch):
        return pad_to_bucket(batch, self.buckets)

    def batches(self, epoch, start_step=0):
        """Yield this rank's (tokens, loss_mask) for steps start_step.. of `epoch`."""
        for step in range(start_step, len(self)):
            rows = [self[int(i)] if i >= 0 else EMPTY_ROW for i in self.local_batch_indices(epoch, step)]
            yield self.to_jittor(self.collate_batch(rows))

    def __iter__(self):
        yield from self.batches(self.epoch, self.start_step)
