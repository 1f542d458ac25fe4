"""scripts/compare_routers.py: several runs' router maps side by side and their similarity."""
import json
import os
import pickle

import numpy as np
import pytest

from scripts import compare_routers
from Utils import router_comparison

TYPES = [["Q", "V", "FFN_DOWN"], ["Q", "V", "FFN_DOWN", "PADAPTER"]]


def fake_run(folder, seed, weights_of, n_examples=3, n_prompt=5, n_tokens=8):
    """A run folder as Math.py + Infer.py --save_weights leave it: args.json, log.txt, eval/*.pkl."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "eval"))
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"seed": seed}, f)
    with open(os.path.join(folder, "log.txt"), "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"event": "train", "step": step, "train_loss": 2.0 / step + seed * 1e-3}) + "\n")
    examples, gammas = [], []
    for i in range(n_examples):
        ids = list(range(10 + i, 10 + i + n_prompt)) + rng.integers(0, 99, n_tokens - n_prompt).tolist()
        common = {"dataset": "synthetic", "index": i, "token_ids": ids, "tokens": [str(t) for t in ids],
                  "n_prompt": n_prompt, "generation": ""}
        examples.append({**common, "weights": [weights_of(i, layer, n_tokens, len(names))
                                               for layer, names in enumerate(TYPES)]})
        gammas.append({**common, "weights": [np.full((n_tokens, 1), 0.1 * (layer + 1), np.float32)
                                             for layer in range(len(TYPES))]})
    base = {"method": "moa", "variant": "sparse", "layer_types": TYPES}
    for kind, rows in (("type_weight", examples), ("token_weight", gammas)):
        with open(os.path.join(folder, "eval", f"{kind}.pkl"), "wb") as f:
            pickle.dump({"kind": kind, **base, "examples": rows}, f)
    return os.path.join(folder, "eval")


def pattern(i, layer, n_tokens, n_types):
    t = np.arange(n_tokens)[:, None] + 3 * np.arange(n_types)[None, :] + 5 * layer + i
    return (0.05 + 0.9 * (t % 7) / 7).astype(np.float32)


def test_similarity_of_equal_opposite_and_unrelated_runs(tmp_path):
    noise = np.random.default_rng(0)
    a = fake_run(str(tmp_path / "a"), 0, pattern)
    b = fake_run(str(tmp_path / "b"), 125, pattern)  # the same router decisions
    c = fake_run(str(tmp_path / "c"), 1225, lambda *k: 1.0 - pattern(*k))  # the opposite ones
    d = fake_run(str(tmp_path / "d"), 7, lambda i, layer, n, k: noise.random((n, k)).astype(np.float32))
    report = router_comparison.compare([a, b, c, d], str(tmp_path / "out"))
    mean, tokens = np.array(report["mean"]), np.array(report["prompt_tokens"])
    np.testing.assert_allclose(np.diag(mean), 1.0, atol=1e-12)
    assert mean[0, 1] == pytest.approx(1.0) and mean[0, 2] == pytest.approx(-1.0)
    assert tokens[0, 1] == pytest.approx(1.0) and tokens[0, 2] == pytest.approx(-1.0)
    # the unrelated run: the prompt-token correlation computed independently over the same entries
    runs = [router_comparison.read_run(f) for f in (a, d)]
    xs = np.concatenate([ex["weights"][layer][:5].ravel() for ex in runs[0]["type"]["examples"] for layer in (0, 1)])
    ys = np.concatenate([ex["weights"][layer][:5].ravel() for ex in runs[1]["type"]["examples"] for layer in (0, 1)])
    assert tokens[0, 3] == pytest.approx(np.corrcoef(xs, ys)[0, 1]) and abs(tokens[0, 3]) < 0.5
    saved = json.load(open(tmp_path / "out" / "similarity.json"))
    assert [r["label"] for r in saved["runs"]] == ["seed 0", "seed 125", "seed 1225", "seed 7"]
    assert np.allclose(saved["mean"], mean)


def test_prompts_that_differ_are_not_compared(tmp_path):
    a = router_comparison.read_run(fake_run(str(tmp_path / "a"), 0, pattern))
    b = router_comparison.read_run(fake_run(str(tmp_path / "b"), 1, pattern))
    for ex in b["type"]["examples"]:
        ex["token_ids"] = [t + 1000 for t in ex["token_ids"]]
    assert np.isnan(router_comparison.prompt_token_correlation(a["type"], b["type"]))
    assert router_comparison.similarity([a, b])["mean"][0][1] == pytest.approx(1.0)


def test_command_draws_the_figure(tmp_path, capsys):
    folders = [fake_run(str(tmp_path / f"r{s}"), s, pattern) for s in (0, 125)]
    compare_routers.main([*folders, "--output_dir", str(tmp_path / "out"), "--labels", "first,second"])
    png = tmp_path / "out" / "router_comparison.png"
    import matplotlib.image
    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600 and pixels[..., :3].std() > 0.05  # drawn, not blank
    assert "first ~ second: 1.000" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        compare_routers.main([str(tmp_path), "--output_dir", str(tmp_path / "x")])
    assert info.value.code == 2 and "no type_weight.pkl" in capsys.readouterr().err
