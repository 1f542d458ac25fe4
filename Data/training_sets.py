"""The sets a training run (Math.py) learns from: the data files given, a seeded fraction held out for
validation unless a validation file is, or the seeded synthetic demo splits, which the run's folder keeps with
the test split Infer.py evaluates (disjoint by instruction); batched into FinetuneDatasets, how many examples
--max_seq_len cuts said, and a set left with no target token refused (a ValueError naming it)."""
import os

from Data.dataset import FinetuneDataset, load_examples, split_validation
from Data.synthetic import make_splits
from Utils.file_io import write_json
from Utils.misc import print_main

# The demo data; the held-out test split is written beside it for Infer.py (disjoint by instruction).
SYNTHETIC = dict(n_train=20000, n_val=200, n_test=300, seed=0)


def load_data(data_path, val_data_path, val_fraction, seed):
    """(train, val or None) example lists; the seeded synthetic splits when `data_path` is None."""
    if data_path is None:
        train_set, val, _ = make_splits(SYNTHETIC["n_train"], SYNTHETIC["n_val"], 0, seed=SYNTHETIC["seed"])
        return train_set, val
    train_set = load_examples(data_path, need_answer=False)
    if val_data_path:
        return train_set, load_examples(val_data_path, need_answer=False)
    if val_fraction == 0:
        return train_set, None
    return split_validation(train_set, val_fraction, seed=seed)


def write_synthetic(data_dir, examples):
    """The synthetic splits a run trains on (`examples`: train, val) and the test split, as data_dir/*.json."""
    test = make_splits(SYNTHETIC["n_train"], SYNTHETIC["n_val"], SYNTHETIC["n_test"], seed=SYNTHETIC["seed"])[2]
    for name, split in zip(("train.json", "val.json", "test.json"), (*examples, test)):
        write_json(split, os.path.join(data_dir, name))


def training_sets(examples, tokenizer, cfg, max_seq_len, buckets, data_path, val_data_path) -> tuple:
    """(train, val or None) FinetuneDatasets of the examples (train, val or None) under the TrainArgs `cfg`, their
    lengths checked (check_lengths), the training set able to fill one optimizer step."""
    train_ds = FinetuneDataset(examples[0], tokenizer, max_seq_len, cfg.batch_size, buckets=buckets,
                               shuffle=True, drop_last=True, seed=cfg.seed, keep_numpy_array=True)
    val_ds = None
    if examples[1] is not None:
        val_ds = FinetuneDataset(examples[1], tokenizer, max_seq_len, cfg.batch_size, buckets=buckets,
                                 shuffle=False, drop_last=False, keep_numpy_array=True)
    check_lengths(train_ds, val_ds, max_seq_len, data_path, val_data_path)
    if len(train_ds) < cfg.accum_iter:
        raise ValueError(f"{len(train_ds)} batches per epoch cannot fill one optimizer step of --accum_iter "
                         f"{cfg.accum_iter}")
    return train_ds, val_ds


def check_lengths(train_ds, val_ds, max_seq_len, data_path, val_data_path):
    """Say how many examples --max_seq_len cuts; refuse a training or validation set with no target token
    left: its loss would read 0.0, training nothing or 'improving' forever."""
    sources = {"training": data_path or "synthetic",
               "validation": val_data_path or (f"--val_fraction of {data_path}" if data_path else "synthetic")}
    for what, ds in (("training", train_ds), ("validation", val_ds)):
        if ds is not None and ds.n_cut:
            print_main(f"{what}: {ds.n_cut} of {ds.total_len} examples are longer than --max_seq_len {max_seq_len} "
                       "tokens and are cut (their input first, then the answer's end)"
                       + (f"; {ds.n_unlearnable} of them keep no answer token to learn from (a prompt of "
                          f"{max_seq_len}+ tokens)" if ds.n_unlearnable else ""))
    for what, ds in (("validation", val_ds), ("training", train_ds)):
        if ds is not None and ds.n_targets == 0:
            raise ValueError(f"{what} set ({sources[what]}): no example keeps a target token within --max_seq_len "
                             f"{max_seq_len} (every prompt fills it): raise --max_seq_len")
