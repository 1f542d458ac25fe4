"""Infer.py: the results of one evaluation, whole; inputs and the context checked before any token."""
import errno
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO, one_error_line

import Infer
from Data.synthetic import make_splits
from Models.Tokenizer import Tokenizer
from Utils import misc


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Two tiny data sets, math-scored, under names of their own folders."""
    root = tmp_path_factory.mktemp("sets")
    paths = {}
    for i, name in enumerate(("AddSub", "SVAMP")):
        (root / name).mkdir()
        paths[name] = str(root / name / "test.json")
        with open(paths[name], "w") as f:
            json.dump(make_splits(4, 0, 2, seed=i)[2], f)
    return paths


def infer(tiny_base, out, *extra):
    return Infer.main(["--no_adapter", "--llama_path", tiny_base, "--output_dir", str(out), "--max_gen_len", "2",
                       "--batch_size", "2", "--plot_examples", "0", *map(str, extra)])


def exit_code(call):
    with pytest.raises(SystemExit) as info:
        call()
    return info.value.code


def contents(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


def test_results_are_replaced_whole_never_mixed(tiny_base, sets, tmp_path, capsys):
    out = tmp_path / "eval"
    summary = infer(tiny_base, out, "--data_path", sets["AddSub"], sets["SVAMP"])
    assert sorted(summary["datasets"]) == ["AddSub", "SVAMP"]
    assert sorted(os.listdir(out)) == [".manifest.json", "AddSub_predictions.jsonl", "SVAMP_predictions.jsonl",
                                       "scores.json"]
    summary = infer(tiny_base, out, "--data_path", sets["AddSub"])
    # the earlier evaluation's SVAMP results go with it: scores.json and the predictions always agree
    assert sorted(os.listdir(out)) == [".manifest.json", "AddSub_predictions.jsonl", "scores.json"]
    assert json.loads((out / ".manifest.json").read_text()) == {
        "tool": "Infer.py", "written": ["AddSub_predictions.jsonl", "scores.json"]}
    assert sorted(json.loads((out / "scores.json").read_text())["datasets"]) == ["AddSub"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(misc.TMP_PREFIX)]  # no staging left

    (out / "notes.txt").write_text("mine")
    before = contents(out)
    assert exit_code(lambda: infer(tiny_base, out, "--data_path", sets["SVAMP"])) == 2
    one_error_line(capsys.readouterr().err, str(out), "notes.txt", "not an evaluation's results")
    assert contents(out) == before


def test_a_failed_write_keeps_the_earlier_results(tiny_base, sets, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    infer(tiny_base, out, "--data_path", sets["AddSub"])
    before = contents(out)
    real_fsync = os.fsync

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("scores.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", full_disk)
    capsys.readouterr()
    assert exit_code(lambda: infer(tiny_base, out, "--data_path", sets["AddSub"], sets["SVAMP"])) == 4
    one_error_line(capsys.readouterr().err, "scores.json", "No space left on device")
    assert contents(out) == before  # the SVAMP predictions already written stayed in the staging folder
    assert not [n for n in os.listdir(tmp_path) if n.startswith(misc.TMP_PREFIX)]


def test_generation_is_bounded_by_the_context(tiny_base, sets, tmp_path):
    summary = infer(tiny_base, tmp_path / "eval", "--data_path", sets["AddSub"], "--max_gen_len", 1000000,
                    "--max_seq_len", 200)
    assert summary["max_seq_len"] == 200  # not prompt + 1000000
    rows = [json.loads(line) for line in open(tmp_path / "eval" / "AddSub_predictions.jsonl")]
    assert len(rows) == 2


def test_bad_input_table(tiny_base, sets, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    n_words = Tokenizer(os.path.join(tiny_base, "tokenizer.model")).n_words

    def edited_base(name, **params):
        copy = tmp_path / name
        copy.mkdir()
        for entry in os.listdir(tiny_base):
            if entry != "params.json":
                os.symlink(os.path.join(tiny_base, entry), copy / entry)
        with open(os.path.join(tiny_base, "params.json")) as f:
            (copy / "params.json").write_text(json.dumps({**json.load(f), **params}))
        return str(copy)
    data = ["--data_path", sets["AddSub"]]
    cases = [
        (["--output_dir", str(a_file)], 2, [str(a_file), "is a file"]),
        (["--output_dir", str(a_file / "eval")], 2, ["which is a file"]),
        (["--llama_path", edited_base("str_dim", dim="128")], 2, ["params.json", "dim"]),
        (["--llama_path", edited_base("small_vocab", vocab_size=n_words - 1)], 2,
         ["tokenizer.model", f"{n_words} token ids", f"vocab_size {n_words - 1}"]),
        (["--max_seq_len", "40"], 2, [sets["AddSub"], "example 0 of data set 'AddSub'", "max_seq_len 40",
                                      "2 prompt(s)"]),
        # about 300 GB of keys and values: refused before a byte is allocated
        (["--max_seq_len", "100000000", "--max_gen_len", "10000000", "--batch_size", "64"], 2,
         ["KV cache", "--batch_size 64", "GiB available"]),
    ]
    for extra, code, needles in cases:
        out = tmp_path / "eval"
        assert exit_code(lambda: infer(tiny_base, out, *data, *extra)) == code, extra  # later flags win
        one_error_line(capsys.readouterr().err, *needles)
        assert not out.exists()


def test_help_says_what_the_moa_flags_do():
    text = Infer.get_args_parser().format_help()
    assert "a flag that differs from them is refused" in " ".join(text.split())
    assert "override" not in text


def test_sigint_stops_between_batches_and_writes_nothing(tiny_base, tmp_path):
    data = tmp_path / "synthetic" / "test.json"
    data.parent.mkdir()
    data.write_text(json.dumps(make_splits(4, 0, 60, seed=3)[2]))
    out = tmp_path / "eval"
    proc = subprocess.Popen([sys.executable, str(REPO / "Infer.py"), "--no_adapter", "--llama_path", tiny_base,
                             "--data_path", str(data), "--output_dir", str(out), "--max_gen_len", "40",
                             "--batch_size", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        seen = []
        for line in proc.stdout:  # the model is loaded and generation starts: SIGINT lands between batches
            seen.append(line)
            if line.startswith("[infer]"):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert "stopped by SIGINT" in output and "Traceback" not in output and "quick exit" not in output
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(misc.TMP_PREFIX)]
