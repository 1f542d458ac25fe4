"""Data pipeline: prompts, loading, masks, buckets, order, sharding, synthetic set, scoring."""
import json
import re

import numpy as np
import pytest

from conftest import DATA
from Data.dataset import FinetuneDataset, bucket_for, default_buckets, encode_example, load_examples, split_validation
from Data.prompts import format_prompt
from Data.scoring import extract_answer, is_correct, score, scoring_rule
from Data.synthetic import make_splits


class ByteTokenizer:
    """Stand-in for Models/Tokenizer.py: one id per UTF-8 byte, ids 0-2 special."""
    bos_id, eos_id, pad_id, n_words = 1, 2, -1, 259

    def encode(self, s, bos, eos):
        return [self.bos_id] * bos + [b + 3 for b in s.encode("utf-8")] + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="ignore")


TOK = ByteTokenizer()


def example(instruction="Add 2 and 3.", input="", output="\nA: 2 + 3 = 5. The answer is 5.", answer="5"):
    return {"instruction": instruction, "input": input, "output": output, "answer": answer}


def make_dataset(n=10, batch_size=4, **kw):
    examples = [example(instruction=f"Q{i} " + "x" * (i % 12 * 9)) for i in range(n)]
    kw.setdefault("max_seq_len", 512)
    return FinetuneDataset(examples, TOK, batch_size=batch_size, keep_numpy_array=True, **kw)


# ---- prompts ----

def test_prompt_templates_exact():
    assert format_prompt(example(instruction="Do X.")) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nDo X.\n\n### Response:")
    assert format_prompt(example(instruction="Do X.", input="ctx {1}")) == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nDo X.\n\n"
        "### Input:\nctx {1}\n\n### Response:")


# ---- loading ----

def write(tmp_path, text, name="d.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_examples_ok(tmp_path):
    path = write(tmp_path, json.dumps([example(answer=5)]))
    assert load_examples(path) == [example(answer="5")]


@pytest.mark.parametrize("text, pattern", [
    ('[{"instruction": "a",\n  "input": }]', r"d\.json: malformed JSON at line 2, column 12"),
    ('{"instruction": "a"}', r"d\.json: expected a JSON list"),
    ("[]", r"d\.json: the list of examples is empty"),
    ('[{"instruction": "a", "input": "", "output": "b", "answer": "1"}, '
     '{"instruction": "a", "input": "", "answer": "1"}]', r"d\.json: item 1 is missing the field 'output'"),
    ('[{"instruction": 3, "input": "", "output": "b", "answer": "1"}]', r"d\.json: item 0 field 'instruction'"),
    ('["just text"]', r"d\.json: item 0 is a str"),
])
def test_load_examples_errors(tmp_path, text, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_examples(write(tmp_path, text))


def test_load_examples_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_examples(tmp_path / "nope.json")


def test_load_math_samples():
    """tests/data/math: the first examples of each math set, as the real files have them."""
    files = sorted((DATA / "math").rglob("*.json"))
    assert len(files) == 6
    for path in files:
        examples = load_examples(path)
        assert examples and all(ex["instruction"] and ex["answer"] for ex in examples), path


# Rows in the layout of the authors' training files (github.com/DCDmllm/MoA, datasets/<name>/train.json and
# validation.json): a JSON list, indented as they publish it, of instruction, input, output and, but for
# CodeAlpaca, an answer string (math: a float's text, "576.0"; commonsense: "answer3"). Written here, not copied.
AUTHORS_LAYOUT = {
    "math_14k": (4, [{"instruction": "Ann has 3 boxes of 12 pens. How many pens does she have?", "input": "",
                      "output": "\nA: 3 boxes of 12 pens is 3 * 12 = 36 pens. The answer is 36.", "answer": "36.0"}]),
    "commonsense_15k": (4, [{"instruction": "Please choose the correct answer to the question: Ice is\n\nAnswer1: "
                                            "hot. Answer2: cold.\n\nAnswer format: answer1/answer2", "input": "",
                             "output": "the correct answer is answer2", "answer": "answer2"}]),
    "codealpaca20k": (6, [{"instruction": "Sum the given list in Python.", "input": "xs = [1, 2, 3]",
                           "output": "total = sum(xs)"},
                          {"instruction": "Write a function that returns 1.", "input": "",
                           "output": "def one():\n    return 1"}]),
}


@pytest.mark.parametrize("name", AUTHORS_LAYOUT)
def test_reads_the_authors_training_files_as_published(tmp_path, name):
    """Each file trains as it is (need_answer=False: CodeAlpaca has none), its answer kept as the string it is;
    the prompt takes the input where there is one, and the target is the output exactly, eos after it."""
    indent, rows = AUTHORS_LAYOUT[name]
    (tmp_path / name).mkdir()
    path = tmp_path / name / "train.json"
    path.write_text(json.dumps(rows, indent=indent, ensure_ascii=False))
    examples = load_examples(path, need_answer=False)
    assert examples == [{**row, "answer": row.get("answer", "")} for row in rows]
    if name != "codealpaca20k":  # the math and commonsense files carry what scoring reads
        assert load_examples(path) == examples
    dataset = FinetuneDataset(examples, TOK, batch_size=len(rows), keep_numpy_array=True, max_seq_len=512)
    tokens, mask = next(iter(dataset.batches(0, 0)))
    for row, ids, targets in zip(rows, tokens, mask):
        prompt = format_prompt(row)
        assert ("### Input:\n" + row["input"] in prompt) == bool(row["input"])
        learned = [int(t) for t, m in zip(ids, targets) if m]
        assert TOK.decode(learned[:-1]) == row["output"] and learned[-1] == TOK.eos_id


def test_split_validation():
    examples = [example(instruction=f"q{i}") for i in range(100)]
    train, val = split_validation(examples, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert {e["instruction"] for e in train}.isdisjoint(e["instruction"] for e in val)
    assert split_validation(examples, 0.1, seed=3) == (train, val)
    assert split_validation(examples, 0.1, seed=4)[1] != val
    with pytest.raises(ValueError):
        split_validation(examples, 1.0)


# ---- encoding, masks, truncation ----

def test_mask_covers_output_and_eos_only():
    ex = example()
    tokens, mask = encode_example(TOK, ex, max_seq_len=512)
    prompt = TOK.encode(format_prompt(ex), bos=True, eos=False)
    output = TOK.encode(ex["output"], bos=False, eos=True)
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    assert tokens.tolist() == prompt + output
    assert tokens[0] == TOK.bos_id and tokens[-1] == TOK.eos_id
    assert mask.tolist() == [0.0] * len(prompt) + [1.0] * len(output)


def test_truncation_cuts_input_first_then_output_end():
    ex = example(input="context " * 40)
    full_prompt = len(TOK.encode(format_prompt(ex), bos=True, eos=False))
    n_output = len(TOK.encode(ex["output"], bos=False, eos=True))
    limit = full_prompt + n_output - 100
    tokens, mask = encode_example(TOK, ex, max_seq_len=limit)
    text = TOK.decode(tokens.tolist())
    assert len(tokens) <= limit
    assert ex["output"] in text and tokens[-1] == TOK.eos_id  # output kept whole
    assert "### Input:\ncontext" in text and mask.sum() == n_output
    # with no input left to cut, the output's end goes (eos first)
    short = example()
    n_prompt = len(TOK.encode(format_prompt(short), bos=True, eos=False))
    tokens, mask = encode_example(TOK, short, max_seq_len=n_prompt + 5)
    assert len(tokens) == n_prompt + 5 and TOK.eos_id not in tokens.tolist()
    assert TOK.decode(tokens[n_prompt:].tolist()) == short["output"][:5] and mask.sum() == 5


def test_truncation_can_drop_whole_input():
    ex = example(input="y" * 500)
    no_input = len(TOK.encode(format_prompt(example()), bos=True, eos=True)) + len(ex["output"])
    tokens, _ = encode_example(TOK, ex, max_seq_len=no_input)
    text = TOK.decode(tokens.tolist())
    assert "### Input" not in text and "yy" not in text and text.endswith(ex["output"])


# ---- buckets and batches ----

def test_buckets():
    assert default_buckets(300) == [64, 128, 192, 256, 300]
    assert default_buckets(128) == [64, 128]
    assert bucket_for(1, [64, 128]) == 64 and bucket_for(65, [64, 128]) == 128
    with pytest.raises(ValueError):
        bucket_for(129, [64, 128])


def test_batch_padded_to_one_bucket():
    ds = make_dataset(n=8, batch_size=4, shuffle=False, max_seq_len=256, buckets=[100, 200, 256])
    for step, (tokens, mask) in enumerate(ds):
        rows = [ds[i] for i in ds.local_batch_indices(0, step)]
        longest = max(len(t) for t, _ in rows)
        assert tokens.dtype == np.int32 and mask.dtype == np.float32
        assert tokens.shape == mask.shape == (4, bucket_for(longest, ds.buckets))
        for b, (row_tokens, row_mask) in enumerate(rows):
            assert tokens[b, :len(row_tokens)].tolist() == row_tokens.tolist()
            assert (tokens[b, len(row_tokens):] == 0).all() and (mask[b, len(row_mask):] == 0).all()
            assert mask[b].sum() == row_mask.sum() and mask[b, 0] == 0


def test_seeded_order_reproducible_and_per_epoch():
    a, b = make_dataset(n=40, seed=1), make_dataset(n=40, seed=1)
    assert (a.epoch_order(0) == b.epoch_order(0)).all()
    assert not (a.epoch_order(0) == a.epoch_order(1)).all()
    assert not (a.epoch_order(0) == make_dataset(n=40, seed=2).epoch_order(0)).all()
    assert sorted(a.epoch_order(3)) == list(range(40))
    a.set_epoch(2)
    b.set_epoch(2)
    for (ta, ma), (tb, mb) in zip(a, b):
        assert (ta == tb).all() and (ma == mb).all()


def test_rank_sharding_partitions_global_batch():
    world = 4
    ranks = [make_dataset(n=50, batch_size=8, seed=5, rank=r, world_size=world) for r in range(world)]
    assert len({len(ds) for ds in ranks}) == 1 and len(ranks[0]) == 50 // 8
    for step in range(len(ranks[0])):
        global_rows = ranks[0].global_batch_indices(1, step)
        local = [ds.local_batch_indices(1, step) for ds in ranks]
        assert all(len(rows) == 2 for rows in local)
        assert sorted(np.concatenate(local)) == sorted(global_rows)
        for r in range(world):
            assert (local[r] == global_rows[r::world]).all()
    with pytest.raises(ValueError, match="not divisible"):
        make_dataset(batch_size=6, rank=0, world_size=4)


def test_drop_last_false_fills_with_empty_rows():
    ranks = [make_dataset(n=10, batch_size=4, drop_last=False, shuffle=False, rank=r, world_size=2)
             for r in range(2)]
    assert len(ranks[0]) == 3
    last = [list(ds.batches(0))[-1] for ds in ranks]
    assert all(tokens.shape[0] == 2 for tokens, _ in last)
    # global batch [8, 9, filler, filler]: each rank gets one real row and one all-padding row
    assert [ds.local_batch_indices(0, 2).tolist() for ds in ranks] == [[8, -1], [9, -1]]
    for tokens, mask in last:
        assert mask[0].sum() > 0 and mask[1].sum() == 0 and (tokens[1] == 0).all()
    seen = np.concatenate([ds.local_batch_indices(0, s) for ds in ranks for s in range(3)])
    assert sorted(i for i in seen if i >= 0) == list(range(10))


def test_resume_from_epoch_and_step():
    ds = make_dataset(n=30, batch_size=4)
    full = list(ds.batches(epoch=3))
    ds.set_epoch(3, start_step=4)
    resumed = list(ds)
    assert len(resumed) == len(full) - 4
    for (ta, ma), (tb, mb) in zip(full[4:], resumed):
        assert (ta == tb).all() and (ma == mb).all()


def test_jittor_vars_by_default():
    import jittor as jt
    examples = [example() for _ in range(4)]
    tokens, mask = next(iter(FinetuneDataset(examples, TOK, max_seq_len=256, batch_size=4)))
    assert isinstance(tokens, jt.Var) and tokens.dtype == "int32" and mask.dtype == "float32"


# ---- synthetic data ----

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+)(?: ([-+]) (\d+))? = (\d+)")


def test_synthetic_splits_disjoint_and_consistent():
    train, val, test = make_splits(300, 50, 50, seed=0)
    assert (len(train), len(val), len(test)) == (300, 50, 50)
    sets = [{ex["instruction"] for ex in split} for split in (train, val, test)]
    assert all(len(s) == n for s, n in zip(sets, (300, 50, 50)))
    assert sets[0].isdisjoint(sets[1]) and sets[0].isdisjoint(sets[2]) and sets[1].isdisjoint(sets[2])
    assert make_splits(300, 50, 50, seed=0) == (train, val, test)
    for ex in train + val + test:
        assert set(ex) == {"instruction", "input", "output", "answer"} and ex["input"] == ""
        assert ex["output"].endswith(f"The answer is {ex['answer']}.")
        equations = EQUATION.findall(ex["output"])
        assert equations, ex["output"]
        for a, op, b, op2, c, result in equations:
            expression = f"{a} {op} {b}" + (f" {op2} {c}" if op2 else "")
            assert eval(expression) == int(result), ex["output"]
        assert int(equations[-1][-1]) == int(ex["answer"]) >= 0
        assert all(num in re.findall(r"\d+", ex["instruction"]) for num in equations[0][0:3:2])
        assert is_correct("synthetic", ex["output"], ex["answer"])


def test_synthetic_cli(tmp_path, monkeypatch):
    import sys
    from Data import synthetic
    monkeypatch.setattr(sys, "argv", ["synthetic", "--out", str(tmp_path), "--n_train", "20",
                                      "--n_val", "5", "--n_test", "5"])
    synthetic.main()
    assert [len(load_examples(tmp_path / f"{s}.json")) for s in ("train", "val", "test")] == [20, 5, 5]


# ---- scoring ----

@pytest.mark.parametrize("text, expected", [
    ("The total is 1,234 apples.", 1234.0),
    ("It dropped to -7 degrees.", -7.0),
    ("It costs $3.50 in all.", 3.5),
    ("First 2, then 5, so the answer is 12.", 12.0),
    ("I do not know.", None),
])
def test_extract_numbers(text, expected):
    assert extract_answer("AddSub", text) == expected


def test_numeric_correctness():
    assert is_correct("gsm8k", "The answer is 1,234.", "1234.0")
    assert is_correct("MultiArith", "so 3.50 dollars", 3.5)
    assert is_correct("singleeq", "x = 2.0004", "2")
    assert not is_correct("SingleEq", "x = 2.01", "2")
    assert not is_correct("SVAMP", "no idea", "0")
    assert is_correct("mawps", "answer -3", "-3")
    assert score("AddSub", ["it is 4", "it is 5", "none", "1, 2, 3"], ["4", "4", "1", "3"]) == 0.5


def test_aqua_letters():
    assert extract_answer("AQuA", "  the answer is (c), not B or D") == "B"  # lowercase c skipped
    assert extract_answer("aqua", "\nAnswer: (D)") == "A"  # first capital A-E wins, as the authors do
    assert extract_answer("AQuA", "no capitals here") is None
    assert is_correct("AQuA", "(E) 12", "E") and not is_correct("AQuA", "xyz", "A")


# (data set, generation, label, the authors' prediction, correct): their rule is the first match of the
# set's keywords in the stripped generation, case-sensitive, no word boundary, compared exactly to the label
COMMONSENSE_CASES = [
    ("boolq", "the correct answer is true", "true", "true", True),
    ("boolq", "false, not true", "true", "false", False),  # the first match decides
    ("boolq", "The answer is True", "true", None, False),  # case-sensitive
    ("boolq", "untrue", "true", "true", True),  # no word boundary
    ("piqa", "the correct answer is solution2", "solution2", "solution2", True),
    ("piqa", "Solution1 looks better", "solution1", None, False),
    ("social_i_qa", "answer3 or answer1", "answer1", "answer3", False),
    ("ARC-Challenge", "the correct answer is answer4", "answer4", "answer4", True),
    ("ARC-Easy", "answer5", "answer5", "answer5", True),
    ("openbookqa", "answer 2", "answer2", None, False),
    ("hellaswag", "ending3 then ending1", "ending3", "ending3", True),
    ("winogrande", "the correct answer is option1", "option2", "option1", False),
    ("winogrande", "option2", "option2", "option2", True),
    ("boolq", "no keyword here", "false", None, False),
]


@pytest.mark.parametrize("dataset, text, label, prediction, correct", COMMONSENSE_CASES)
def test_commonsense_authors_rules(dataset, text, label, prediction, correct):
    assert extract_answer(dataset, text) == prediction
    assert is_correct(dataset, text, label) == correct


def test_scoring_rule_is_chosen_or_refused():
    assert scoring_rule("boolq", ["true"]) == "boolq" and scoring_rule("AddSub", ["3"]) == "AddSub"
    assert scoring_rule("mymath", ["3", "1,000", "-2.5"]) == "synthetic"
    assert scoring_rule("mychoice", ["A", " C"]) == "aqua"
    with pytest.raises(ValueError, match=r"data set 'mystery' \(x/test.json\): no scoring rule"):
        scoring_rule("mystery", ["true", "false"], "x/test.json")


def test_scoring_errors():
    with pytest.raises(ValueError, match="unknown data set 'MATH500'"):
        score("MATH500", ["1"], ["1"])
    with pytest.raises(ValueError, match="2 generations but 1 labels"):
        score("AddSub", ["1", "2"], ["1"])


def test_token_zero_still_counts_and_unlearnable_examples_are_counted():
    class BangIsZero(ByteTokenizer):
        def encode(self, s, bos, eos):
            return [0 if i == ord("!") + 3 else i for i in super().encode(s, bos, eos)]
    tokens, mask = encode_example(BangIsZero(), example(output="\nA: 5!"), max_seq_len=512)
    assert tokens[-2] == 0 and mask[-2] == 1.0  # an explicit mask, not label 0 = ignore
    dataset = FinetuneDataset([example(), example(instruction="w" * 300)], TOK, max_seq_len=256, batch_size=2)
    assert (dataset.n_cut, dataset.n_unlearnable) == (1, 1)
