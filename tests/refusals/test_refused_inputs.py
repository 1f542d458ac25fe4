"""Inputs, refused before the first token with one line naming the file, field, example or flag (exit 2), and
nothing written: Math.py's and Infer.py's bad flags, data sets and labels (each scored by its rule or refused),
adapters and bases (a tensor in several shards is one tensor), sizes checked before a byte is read, the KV cache
checked against memory and generation bounded by the context (the bench scripts' arguments: tests/test_bench.py)."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import (DATA, assert_refused, edited_base, infer_base_alone, make_entries, math_refuses, one_error_line,
                      python_program, train, write_samples)

import Infer
from Data import test_sets
from Data.prompts import format_prompt
from Data.synthetic import make_splits
from Data.tiny_base import write_random_base
from Models.ModelArgs import ModelArgs
from Models.Tokenizer import Tokenizer
from Models.formats.pth import load_pth
from Models.formats.pth_writer import save_pth


def write(path, text):
    path.write_text(text)
    return str(path)


# ---- bad flags and files: one line, exit 2, nothing written -----------------------------------------------

def test_math_refuses_bad_input(tiny_base, synthetic_data, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    n_words = Tokenizer(os.path.join(tiny_base, "tokenizer.model")).n_words
    cases = [  # (how to break it, what the one line must name)
        (lambda: ["--llama_path", edited_base(tiny_base, tmp_path / "str_dim", dim="128")],
         ["params.json", "dim", "'128'"]),
        (lambda: ["--output_dir", str(a_file)], [str(a_file), "is a file"]),
        (lambda: ["--output_dir", str(a_file / "run")], [str(a_file / "run"), "which is a file"]),
        (lambda: ["--llama_path", edited_base(tiny_base, tmp_path / "small_vocab", vocab_size=n_words - 1)],
         ["tokenizer.model", f"{n_words} token ids", f"vocab_size {n_words - 1}", "params.json"]),
        (lambda: ["--max_seq_len", "100"], ["validation set", synthetic_data["val"], "no example keeps a target token",
                                            "--max_seq_len 100"]),
        (lambda: ["--overwrite", "--resume", "auto"], ["--overwrite", "--resume"]),
        (lambda: ["--data_path", str(tmp_path / "missing.json")], ["missing.json"]),
        (lambda: ["--data_path", write(tmp_path / "broken.json", '[{"instruction": "x",\n oops}]')],
         ["broken.json: malformed JSON at line 2"]),
        (lambda: ["--data_path", write(tmp_path / "empty.json", "[]")], ["empty.json: the list of examples is empty"]),
        (lambda: ["--batch_size", "100"], ["cannot fill one global batch of 100"]),
        (lambda: ["--lora_layers", "0-9"], ["reaches past the model's 2 layers"]),
        (lambda: ["--accum_iter", "0"], ["--accum_iter must be at least 1"]),
    ]
    for make, needles in cases:  # later flags win; nothing written before the input is known to be good
        math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, make(), needles)
        assert not (tmp_path / "out").exists()


def test_infer_refuses_bad_input(tiny_base, addsub, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    n_words = Tokenizer(os.path.join(tiny_base, "tokenizer.model")).n_words
    data = ["--data_path", addsub]
    cases = [
        (["--output_dir", str(a_file)], 2, [str(a_file), "is a file"]),
        (["--output_dir", str(a_file / "eval")], 2, ["which is a file"]),
        (["--llama_path", edited_base(tiny_base, tmp_path / "str_dim", dim="128")], 2, ["params.json", "dim"]),
        (["--llama_path", edited_base(tiny_base, tmp_path / "small_vocab", vocab_size=n_words - 1)], 2,
         ["tokenizer.model", f"{n_words} token ids", f"vocab_size {n_words - 1}"]),
        (["--max_seq_len", "40"], 2, [addsub, "example 0 of data set 'AddSub'", "max_seq_len 40",
                                      "2 prompt(s)"]),
        # about 300 GB of keys and values: refused before a byte is allocated
        (["--max_seq_len", "100000000", "--max_gen_len", "10000000", "--batch_size", "64"], 2,
         ["KV cache", "--batch_size 64", "GiB available"]),
        (["--save_weights"], 2, ["--save_weights", "--no_adapter", "no router"]),
    ]
    for extra, code, needles in cases:  # later flags win; nothing written
        out = tmp_path / "eval"
        assert_refused(capsys, lambda: infer_base_alone(tiny_base, out, *data, *extra), *needles, code=code)
        assert not out.exists()


def test_infer_refuses_a_bad_adapter_or_data_set(capsys, tmp_path, tiny_run, addsub):
    adapter = ["--adapter_path", str(tiny_run / "adapter"), "--output_dir", str(tmp_path / "eval")]
    data = ["--data_path", addsub]
    other_base = write_random_base(str(tmp_path / "other_base"), dim=32, n_layers=2)
    missing_field = tmp_path / "bad" / "test.json"
    make_entries(tmp_path / "bad", "test.json", text=json.dumps([{"instruction": "q", "input": "", "output": "a"}]))
    make_entries(tmp_path, "empty.json", text="[]")
    wide = tmp_path / "wide"  # adapter settings past the base's layers: the file is named
    shutil.copytree(tiny_run, wide)
    config = json.loads((wide / "adapter" / "adapter_params.json").read_text())
    (wide / "adapter" / "adapter_params.json").write_text(json.dumps({**config, "lora_layers": "0-99"}))
    odd = {}  # a tensor past fp32's range (float64 1e300 rounds to inf), a complex one
    for kind, value in [("float64", 1e300), ("complex64", 1j)]:
        shutil.copytree(tiny_run, tmp_path / kind)
        odd[kind] = tmp_path / kind / "adapter"
        arrays = load_pth(odd[kind] / "adapter.pth")
        first = sorted(arrays)[0]
        arrays[first] = np.full(arrays[first].shape, value, kind)
        save_pth(arrays, odd[kind] / "adapter.pth")
    cases = [(adapter + data + ["--variant", "soft"], ["adapter from another configuration"]),
             (["--adapter_path", str(odd["float64"]), *data], ["adapter.pth", "past float32's range", first]),
             (["--adapter_path", str(odd["complex64"]), *data], ["adapter.pth", f"'{first}' is complex64"]),
             (["--adapter_path", str(wide / "adapter"), *data], ["lora_layers='0-99'",
                                                                 str(wide / "adapter" / "adapter_params.json")]),
             (adapter + data + ["--llama_path", other_base], ["adapter trained on another base"]),
             (adapter + ["--data_path", str(missing_field)], ["missing the field 'answer'"]),
             (adapter + ["--data_path", str(tmp_path / "empty.json")], ["empty"]),
             (adapter + ["--data_path", str(tmp_path / "nope.json")], ["no such test file"]),
             (["--adapter_path", str(tmp_path / "none"), *data], ["no such adapter"]),
             (["--output_root", str(tmp_path / "no_runs"), *data], ["no adapter under"])]
    for argv, needles in cases:
        assert_refused(capsys, lambda: Infer.main(argv), *needles)
        assert not (tmp_path / "eval").exists()


def test_missing_recorded_test_split_is_an_error(tiny_run, tmp_path, capsys):
    """Never a regenerated test set, which could overlap the training data."""
    run = tmp_path / "run2"
    shutil.copytree(tiny_run, run)
    os.remove(run / "data" / "test.json")
    assert_refused(capsys, lambda: Infer.main(["--adapter_path", str(run / "adapter"), "--output_dir",
                                               str(tmp_path / "eval")]), "no recorded test split")
    assert not os.path.exists(tmp_path / "eval" / "scores.json")


def test_unknown_scoring_rule_fails_before_generation(monkeypatch, capsys, tiny_base, tmp_path):
    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran before the scoring rule was checked")
    monkeypatch.setattr(Infer, "generate", no_generation)
    make_entries(tmp_path / "mystery", "test.json", text=json.dumps([{"instruction": "Is the sky green?", "input": "",
                                                                        "output": "false", "answer": "false"}]))
    assert_refused(capsys, lambda: infer_base_alone(tiny_base, tmp_path / "eval", "--data_path",
                                                    tmp_path / "mystery" / "test.json"), "data set 'mystery'")


@pytest.mark.slow
def test_bad_input_from_the_command_line(tmp_path, tiny_run):
    """The real process: one line on stderr, exit status 2, no stack trace."""
    proc = subprocess.run(python_program("Infer.py", "--adapter_path", tiny_run / "adapter", "--data_path",
                                         tmp_path / "missing.json"), capture_output=True, text=True, cwd=str(tmp_path),
                          timeout=120)
    assert proc.returncode == 2
    one_error_line(proc.stderr, "no such test file")


@pytest.mark.slow
def test_generation_is_bounded_by_the_context(tiny_base, addsub, tmp_path):
    summary = infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", addsub, "--max_gen_len", 1000000,
                               "--max_seq_len", 200)
    assert summary["max_seq_len"] == 200  # not prompt + 1000000
    rows = [json.loads(line) for line in open(tmp_path / "eval" / "AddSub_predictions.jsonl")]
    assert len(rows) == 2


def test_a_samples_file_is_checked_before_any_program_runs(capsys, tmp_path):
    code = DATA / "code"  # the first 3 problems of HumanEval and of MBPP
    out = ["--output_dir", str(tmp_path / "eval")]
    good = write_samples(tmp_path / "good.jsonl", [(f"HumanEval/{i}", "    pass\n") for i in range(3)])
    unknown = write_samples(tmp_path / "unknown.jsonl", [("HumanEval/999", "pass")])
    partial = write_samples(tmp_path / "partial.jsonl", [("HumanEval/0", "pass"), ("HumanEval/2", "pass")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "HumanEval/0", "completion": 3}\n')
    twins = [tmp_path / "twins" / name / "test.jsonl" for name in ("first", "second")]  # the same task_ids
    for twin in twins:
        twin.parent.mkdir(parents=True)
        twin.write_bytes((code / "humaneval" / "test.jsonl").read_bytes())
    cases = [(["--data_path", code, "--samples", good], "needs --data_path"),
             (["--data_path", code, "--samples", unknown, *out], "line 1: task_id 'HumanEval/999'"),
             (["--data_path", code, "--samples", partial, *out], "the first: HumanEval/1"),
             (["--data_path", code, "--samples", bad, *out], "line 1: expected an object"),
             (["--data_path", DATA / "math" / "AddSub", "--samples", good, *out], "code data sets"),
             (["--data_path", code, "--samples", good, *out, "--exec_timeout", "0"], "--exec_timeout"),
             (["--data_path", tmp_path / "twins", "--samples", good, *out], str(twins[0]), str(twins[1]),
              "HumanEval/0")]
    for argv, *messages in cases:
        assert_refused(capsys, lambda: Infer.main([*map(str, argv)]), *messages)
    assert not (tmp_path / "eval").exists()


# ---- data sets: every set and label scored by its rule, or refused before the first token -----------------

def test_labels_are_normalised_or_refused_by_their_rule():
    from Data.scoring import checked_labels
    good = [("boolq", ["True", "false", " FALSE ", "true"], ["true", "false", "false", "true"]),
            ("AQuA", ["b", " C", "E"], ["B", "C", "E"]),
            ("gsm8k", ["1,234", " 5 ", "-2.5", "3.0", "1,000,000"], ["1234", "5", "-2.5", "3.0", "1000000"]),
            ("piqa", ["solution2", "Solution1"], ["solution2", "solution1"]),
            ("winogrande", ["option1"], ["option1"]), ("synthetic", ["42"], ["42"])]
    for rule, labels, expected in good:
        assert checked_labels(rule, labels, "f.json", rule) == expected
    bad = [("boolq", ["true", "yes"], 1), ("piqa", ["solution1", "1"], 1), ("AQuA", ["A", "F"], 1),
           ("AQuA", ["AB"], 0), ("AddSub", ["3", "twelve"], 1), ("gsm8k", ["1.2.3"], 0), ("SVAMP", [""], 0),
           ("winogrande", ["option3"], 0), ("ARC-Easy", ["answer1", "A"], 1), ("hellaswag", ["ending5"], 0)]
    for rule, labels, index in bad:
        with pytest.raises(ValueError, match=f"f.json: example {index} of data set 'x' has the label"):
            checked_labels(rule, labels, "f.json", "x")


def test_text_no_encoding_can_write_is_refused_as_it_is_read(tiny_base, tiny_qwen3, synthetic_data, tmp_path,
                                                            monkeypatch, capsys):
    """A lone surrogate (JSON's escape \\ud800) in a test set, a training set or a samples file: refused naming the
    file and the example or line, before a token is generated or trained on, on either layout of base."""
    def no_generation(*args, **kwargs):
        raise AssertionError("generation started on text that cannot be encoded")
    monkeypatch.setattr(Infer, "generate", no_generation)
    rows = make_splits(4, 0, 2, seed=0)[2]
    rows[1]["instruction"] += " \ud800"
    make_entries(tmp_path / "AddSub", "test.json", text=json.dumps(rows))  # json writes it as the escape
    bad_test = str(tmp_path / "AddSub" / "test.json")
    for base in (tiny_base, tiny_qwen3):
        assert_refused(capsys, lambda: infer_base_alone(base, tmp_path / "eval", "--data_path", bad_test), bad_test,
                       "example 1 field 'instruction' holds a lone surrogate ('\\ud800')")
    with open(synthetic_data["train"]) as f:
        train_rows = json.load(f)
    train_rows[5]["output"] = "\udc80" + train_rows[5]["output"]
    bad_train = tmp_path / "train.json"
    bad_train.write_text(json.dumps(train_rows))
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--data_path", str(bad_train)],
                 [str(bad_train), "example 5 field 'output'"])
    samples = write_samples(tmp_path / "samples.jsonl", [(f"HumanEval/{i}", "    return 1\n" + "\ud800" * (i == 1))
                                                         for i in range(3)])
    assert_refused(capsys, lambda: Infer.main(["--data_path", str(DATA / "code"), "--samples", samples,
                                               "--output_dir", str(tmp_path / "eval")]),
                   samples, "line 2 field 'completion'")
    assert not (tmp_path / "eval").exists()


def test_two_data_sets_of_one_name_are_refused(tmp_path):
    make_entries(tmp_path, "a.json", "a/test.json", "a_2.json", "b/test.json", "root/b/test.json", "c/d/test.json",
                 "d.json", text=json.dumps([{"instruction": "q", "input": "", "output": "o", "answer": "1"}]))
    for paths, first, second in [(["a.json", "a", "a_2.json"], "a.json", "a/test.json"),
                                 (["b", "root"], "b/test.json", "root/b/test.json"),
                                 (["d.json", "c"], "d.json", "c/d/test.json"), (["a.json", "a.json"], "a.json", "a.json")]:
        with pytest.raises(ValueError, match="are both data set") as info:
            test_sets.load_test_sets(test_sets.data_files([str(tmp_path / p) for p in paths]), None)
        assert str(tmp_path / first) in str(info.value) and str(tmp_path / second) in str(info.value)
    found = test_sets.data_files([str(tmp_path / p) for p in ("a.json", "a_2.json", "b")])
    examples, sets = test_sets.load_test_sets(found, 1)
    assert [s.name for s in sets] == ["a", "a_2", "b"] and len(examples) == 3


def test_labels_are_checked_before_the_first_token_and_scored_normalised(tiny_base, tmp_path, monkeypatch, capsys):

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran before the labels were checked")
    monkeypatch.setattr(Infer, "generate", no_generation)
    rows = lambda name, *answers: json.dumps([{"instruction": f"{name} q{i}", "input": "", "output": "o",  # noqa: E731
                                               "answer": a} for i, a in enumerate(answers)])
    for name, answers, index in [("boolq", [True, "maybe"], 1), ("piqa", ["solution1", 1], 1), ("AQuA", ["F"], 0),
                                 ("AddSub", ["1,2,3.4.5"], 0)]:
        make_entries(tmp_path / "bad", f"{name}/test.json", text=rows(name, *answers))
        assert_refused(capsys, lambda: infer_base_alone(tiny_base, tmp_path / "eval", "--data_path",
                                                        tmp_path / "bad" / name),
                       str(tmp_path / "bad" / name / "test.json"), f"example {index}", f"data set '{name}'")
    # the authors' known variants, scored by what they mean: JSON booleans, a lower-case letter, "1,234"
    sets = {"boolq": ([True, False], "true"), "AQuA": (["b", "B"], "B"), "AddSub": (["1,234", "7"], "1234")}
    for name, (answers, _) in sets.items():
        make_entries(tmp_path / "good", f"{name}/test.json", text=rows(name, *answers))
    monkeypatch.setattr(Infer, "generate", lambda model, tok, prompts, *a, **k: [  # one answer to both questions
        tok.encode(next(said for name, (_, said) in sets.items() if f"\n{name} q" in tok.decode(p)), bos=False,
                   eos=False) for p in prompts])
    summary = infer_base_alone(tiny_base, tmp_path / "eval", "--data_path", *(tmp_path / "good" / n for n in sets))
    assert {n: s["correct"] for n, s in summary["datasets"].items()} == {"boolq": 1, "AQuA": 2, "AddSub": 1}


def test_a_training_set_without_a_target_token_is_refused(tiny_base, synthetic_data, tmp_path, capsys):
    long = tmp_path / "long.json"
    long.write_text(json.dumps([{"instruction": "many words " * 200, "input": "", "output": "x", "answer": "1"}] * 8))
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys, ["--data_path", str(long)],
                 ["training set", str(long), "no example keeps a target token", "--max_seq_len 256"])
    math_refuses(tiny_base, synthetic_data, tmp_path / "out", capsys,
                 ["--data_path", str(long), "--val_data_path", str(long)], ["validation set", str(long)])


@pytest.mark.slow
def test_cut_examples_are_counted(tiny_base, synthetic_data, tmp_path, capsys):
    tok = Tokenizer(os.path.join(tiny_base, "tokenizer.model"))
    with open(synthetic_data["train"]) as f:
        rows = json.load(f)
    lengths = [len(tok.encode(format_prompt(r), bos=True, eos=False)) + len(tok.encode(r["output"], bos=False, eos=True))
               for r in rows]
    longer = sum(n > 180 for n in lengths)
    assert 0 < longer < len(rows)  # the data straddles the limit, so the count means something
    assert train(tiny_base, synthetic_data, str(tmp_path / "run"), "--max_steps", 1, "--max_seq_len", 180) == 0
    assert f"training: {longer} of {len(rows)} examples are longer than --max_seq_len 180" in capsys.readouterr().out


# ---- bases, and bounded reading: sizes checked before a byte is read --------------------------------------

def test_duplicate_tensors_across_shards(tiny_meta, tmp_path):
    from Models.formats.base_model import build_model
    from Models.formats import CheckpointError
    full = load_pth(tiny_meta / "consolidated.00.pth")
    runtime = dict(max_seq_len=16, max_batch_size=1, precision="fp32")
    single = build_model(str(tiny_meta), ModelArgs.from_params_json(str(tiny_meta), **runtime))

    def base(name, shards):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "params.json").write_text((tiny_meta / "params.json").read_text())
        for i, shard in enumerate(shards):
            save_pth(shard, folder / f"consolidated.0{i}.pth", bf16=True)
        return str(folder)
    same = build_model(base("same", [full, dict(full)]), single.args)  # two equal copies: read once
    assert all(np.array_equal(v.numpy(), same.base_parameters()[n].numpy()) for n, v in single.base_parameters().items())
    other = {**full, "layers.1.attention.wv.weight": full["layers.1.attention.wv.weight"] + 1}
    halves = [{k: (v if "norm" in k else np.array_split(v, 2, axis=0)[i]) for k, v in full.items()} for i in range(2)]
    halves[1]["norm.weight"] = halves[1]["norm.weight"] * 2  # a replicated norm that differs between the shards
    for name, shards, tensor in [("other", [full, other], "layers.1.attention.wv.weight"),
                                 ("three", [full, full, other], "layers.1.attention.wv.weight"),
                                 ("split", halves, "norm.weight")]:
        folder = base(name, shards)
        with pytest.raises(CheckpointError, match=f"hold different copies of '{tensor}'") as info:
            build_model(folder, single.args)
        assert os.path.join(folder, "consolidated.00.pth") in str(info.value)


def rezipped(source, target, deflate=(), replace=None):
    """`source` (a torch zip) copied to `target`, the records named in `deflate` compressed and those in
    `replace` ({name suffix: bytes}) swapped for other bytes."""
    import zipfile
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = next((v for k, v in (replace or {}).items() if info.filename.endswith(k)), None)
            data = src.read(info) if data is None else data
            method = zipfile.ZIP_DEFLATED if any(info.filename.endswith(d) for d in deflate) else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), data, compress_type=method)
    return str(target)


def test_a_records_declared_size_is_checked_before_it_is_read(tmp_path):
    import tracemalloc
    from Models.formats import CheckpointError
    plain = tmp_path / "plain.pth"
    save_pth({"w": np.zeros(16 << 20, np.float32)}, plain)  # 64 MB of zeros: deflate makes them about 64 KB
    import pickle
    huge_pickle = b"\x80\x02" + pickle.dumps("x" * (64 << 20), protocol=2)[2:]  # a 64 MB string as data.pkl
    cases = [(rezipped(plain, tmp_path / "bomb.pth", deflate=["data/0"]), "storage '0' declares", False),
             (rezipped(plain, tmp_path / "bomb.pth", deflate=["data/0"]), "data/0' is compressed, where torch", True),
             (rezipped(plain, tmp_path / "pkl.pth", deflate=["data.pkl"], replace={"data.pkl": huge_pickle}),
              "data.pkl' declares", False),
             (rezipped(plain, tmp_path / "order.pth", replace={"byteorder": b"little" * 4096}),
              "byteorder' declares 24576 bytes", False),
             (rezipped(plain, tmp_path / "short.pth", replace={"data/0": b"\0" * 64}), "has 64 bytes, expected", False)]
    for path, message, lazy in cases:
        tracemalloc.start()
        with pytest.raises(CheckpointError, match=message) as info:
            load_pth(path, lazy=lazy)["w"].numpy() if lazy else load_pth(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert path in str(info.value) and peak < 8 << 20, (message, peak)  # never the 64 MB it declares
    fifo = tmp_path / "fifo.pth"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):  # no writer: an open would block
        load_pth(fifo)
