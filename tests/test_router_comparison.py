"""Router pictures: scripts/compare_routers.py's runs side by side (labelled by what differs between them) and their
similarity (over the expert types both have; an undefined one said so), and Utils/plots.py's heatmaps (colour
scales fitted to the values, a long example's prompt and answer both drawn)."""
import json
import os
import pickle

import numpy as np
import pytest

from scripts import compare_routers
from Utils import loss_curves, plots, router_comparison
from Utils.weight_pickles import load_pickle

TYPES = [["Q", "V", "FFN_DOWN"], ["Q", "V", "FFN_DOWN", "PADAPTER"]]


def fake_run(folder, seed, weights_of, n_examples=3, n_prompt=5, n_tokens=8, variant="sparse", types=TYPES,
             prompt_shift=0, settings=None):
    """A run folder as Math.py + Infer.py --save_weights leave it: args.json (seed and `settings`), log.txt,
    eval/*.pkl."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "eval"))
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"seed": seed, "output_dir": folder, **(settings or {})}, f)
    with open(os.path.join(folder, "log.txt"), "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"event": "train", "step": step, "train_loss": 2.0 / step + seed * 1e-3}) + "\n")
    examples, gammas = [], []
    for i in range(n_examples):
        ids = list(range(10 + i + prompt_shift, 10 + i + n_prompt + prompt_shift))
        ids += rng.integers(0, 99, n_tokens - n_prompt).tolist()
        common = {"dataset": "synthetic", "index": i, "token_ids": ids, "tokens": [str(t) for t in ids],
                  "n_prompt": n_prompt, "generation": ""}
        examples.append({**common, "weights": [weights_of(i, layer, n_tokens, len(names))
                                               for layer, names in enumerate(types)]})
        gammas.append({**common, "weights": [np.full((n_tokens, 1), 0.1 * (layer + 1), np.float32)
                                             for layer in range(len(types))] if variant == "sparse" else
                       [None] * len(types)})
    base = {"method": "moa", "variant": variant, "layer_types": types}
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


def with_prompt_column(i, layer, n_tokens, n_types):
    """Soft MoA's weights: the pattern's for the types Sparse MoA has, and a column of noise for PROMPT (third)."""
    w = pattern(i, layer, n_tokens, n_types - 1)
    noise = np.random.default_rng(10 * i + layer).random((n_tokens, 1)).astype(np.float32)
    return np.concatenate([w[:, :2], noise, w[:, 2:]], 1)


def test_runs_are_labelled_by_what_differs_and_compared_on_the_types_they_share(tmp_path, capsys):
    """A Sparse and a Soft run of seed 0 and a Sparse run of seed 7 on other prompts: labelled by variant and seed
    (not "seed 0" twice); Sparse and Soft correlate token by token over the types both have (Soft's PROMPT
    aside), and the pair without a shared prompt is undefined, with the reason in similarity.json and printed."""
    soft_types = [names[:2] + ["PROMPT"] + names[2:] for names in TYPES]
    folders = [fake_run(str(tmp_path / "a"), 0, pattern), fake_run(str(tmp_path / "b"), 0, with_prompt_column,
                                                                   variant="soft", types=soft_types),
               fake_run(str(tmp_path / "c"), 7, pattern, prompt_shift=50)]
    compare_routers.main([*folders, "--output_dir", str(tmp_path / "out")])
    saved = json.load(open(tmp_path / "out" / "similarity.json"))
    assert [r["label"] for r in saved["runs"]] == ["sparse MoA, seed 0", "soft MoA, seed 0", "sparse MoA, seed 7"]
    assert saved["prompt_tokens"][0][1] == pytest.approx(1.0) and saved["mean"][0][1] == pytest.approx(1.0)
    assert saved["prompt_tokens"][0][2] is None and saved["prompt_tokens"][1][2] is None
    why = "no example both runs saw with the same prompt"
    assert saved["undefined"]["prompt_tokens"] == {"0-2": why, "1-2": why} and saved["undefined"]["mean"] == {}
    assert f"sparse MoA, seed 0 ~ sparse MoA, seed 7: undefined ({why})" in capsys.readouterr().out


def test_colour_scales_fit_the_values(tmp_path):
    """Type weights that all lie within 0.500-0.510 (a router after a few dozen steps) get a scale of that span,
    said on the colour bar, not 0-1; Gamma likewise."""
    weights = lambda i, layer, n, k: (0.5 + 0.01 * pattern(i, layer, n, k)).astype(np.float32)  # noqa: E731
    types = load_pickle(os.path.join(fake_run(str(tmp_path / "a"), 0, weights), "type_weight.pkl"))
    fig = plots.plot_type_weight(types, str(tmp_path / "t.png"))
    low, high = fig.axes[0].get_images()[0].get_clim()
    table = plots.layer_by_type(types, lambda w: w.mean(0))
    assert (low, high) == (np.nanmin(table), np.nanmax(table)) and 0.5 < low < high < 0.51
    assert f"colour scale {low:.4g} to {high:.4g}" in fig.axes[1].get_ylabel()
    pngs = plots.plot_all(str(tmp_path), type_data=types)
    assert pngs["type_weight"] == (str(tmp_path / "type_weight.png"), (low, high))


def test_a_long_examples_prompt_and_answer_are_both_drawn(tmp_path):
    """150 prompt tokens and a 200-token answer in 96 rows: the prompt's last 32 and the answer's first 64 (not
    the answer's last 96), a line between them, the colours spanning the Gamma drawn."""
    n_prompt, n = 150, 350
    gamma = np.linspace(0.11, 0.13, n, dtype=np.float32)[:, None]
    example = {"dataset": "synthetic", "index": 0, "tokens": [f"t{k}" for k in range(n)], "token_ids": list(range(n)),
               "n_prompt": n_prompt, "generation": "", "weights": [gamma, 2 * gamma]}
    data = {"kind": "token_weight", "method": "moa", "variant": "sparse", "layer_types": [["Q"], ["Q"]],
            "examples": [example]}
    assert plots.token_window(n_prompt, n, 96) == (118, 214) and plots.token_window(5, 8, 96) == (0, 8)
    fig = plots.plot_token_weight(data, str(tmp_path / "g.png"), max_tokens=96)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"t{k}" for k in range(118, 214)]
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [150 - 118 - 0.5]
    assert ax.get_images()[0].get_clim() == (0.0, float(2 * gamma[213, 0]))  # from 0: the values span 0.12-0.26


def test_the_headline_is_within_layers_beside_rank_and_overall(tmp_path, capsys):
    """Two runs whose layers differ in level alike (layer 0 near 0.52 for every type, layer 1 near 0.2) but that
    rank the types of each layer oppositely: overall (over the raw cells) they correlate above 0.95, within layers
    -1, by rank -1; the headline, printed first and drawn, is the within-layer one, and per layer is recorded."""
    ramp = np.linspace(-0.01, 0.01, 4)
    level = {0: 0.52, 1: 0.2}
    types = [["Q", "V", "FFN_DOWN", "PADAPTER"]] * 2
    a = fake_run(str(tmp_path / "a"), 0, lambda i, layer, n, k: np.tile(level[layer] + ramp, (n, 1)).astype(np.float32),
                 types=types)
    b = fake_run(str(tmp_path / "b"), 1, lambda i, layer, n, k: np.tile(level[layer] - ramp, (n, 1)).astype(np.float32),
                 types=types)
    compare_routers.main([a, b, "--output_dir", str(tmp_path / "out")])
    saved = json.load(open(tmp_path / "out" / "similarity.json"))
    assert saved["mean"][0][1] > 0.95
    assert saved["mean_centred"][0][1] == pytest.approx(-1.0) and saved["mean_rank"][0][1] == pytest.approx(-1.0)
    assert saved["per_layer"]["0-1"] == {"pearson": [pytest.approx(-1.0)] * 2, "spearman": [pytest.approx(-1.0)] * 2}
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[compare_routers] correlation of mean type weights within layers (centred: each layer's mean "
                        "taken away): seed 0 ~ seed 1: -1.000")
    assert "over all cells (overall: the offsets between layers included)" in lines[2]


def test_labels_name_every_setting_that_differs_and_panels_share_one_scale(tmp_path):
    """Runs alike in seed but not in precision and epochs are labelled by both (not by folder); the three runs'
    type-weight panels and Gamma panels each share one colour scale from 0."""
    folders = [fake_run(str(tmp_path / name), 0, lambda i, layer, n, k, s=scale: (s * pattern(i, layer, n, k)),
                        settings={"precision": precision, "epochs": epochs, "lr": 1e-3})
               for name, scale, precision, epochs in (("a", 1.0, "bf16", 3), ("b", 0.5, "fp32", 3),
                                                      ("c", 0.25, "fp32", 5))]
    runs = [router_comparison.read_run(f) for f in folders]
    router_comparison.label_runs(runs)
    assert [r["label"] for r in runs] == ["epochs 3, precision bf16", "epochs 3, precision fp32",
                                          "epochs 5, precision fp32"]
    fig = router_comparison.comparison_figure(runs, router_comparison.similarity(runs))
    scales = [ax.get_images()[0].get_clim() for ax in fig.axes if ax.get_images()]
    tables = [router_comparison.mean_table(r["type"]) for r in runs]
    assert scales[:3] == [(0.0, float(np.nanmax(tables[0])))] * 3 and scales[3:6] == [(0.0, pytest.approx(0.2))] * 3


def test_cell_text_is_black_on_light_cells_and_scales_start_at_0_or_say_why(tmp_path):
    """router_stats' Blues: the lowest share (a light cell) is written in black, the highest in white; weights
    within 0.92-1.0 get a scale from 0, weights within 0.500-0.510 one fitted to them, its colour bar saying why."""
    shares = lambda i, layer, n, k: (np.arange(n)[:, None] < 2 * np.arange(1, k + 1)).astype(np.float32)  # noqa: E731
    types = load_pickle(os.path.join(fake_run(str(tmp_path / "a"), 0, shares), "type_weight.pkl"))
    fig = plots.plot_router_stats(types, str(tmp_path / "r.png"))
    cells = {t.get_text(): t.get_color() for t in fig.axes[0].texts}
    active, _ = plots.activation_table(types)
    assert cells[f"{np.nanmin(active):.2f}"] == "k" and cells[f"{np.nanmax(active):.2f}"] == "w"
    for low, expected in ((0.92, 0.0), (0.5, None)):
        weights = lambda i, layer, n, k, b=low: np.tile(b + (0.08 if b > 0.9 else 0.01) * np.linspace(0, 1, k),  # noqa
                                                         (n, 1)).astype(np.float32)
        data = load_pickle(os.path.join(fake_run(str(tmp_path / f"w{low}"), 0, weights), "type_weight.pkl"))
        fig = plots.plot_type_weight(data, str(tmp_path / "t.png"))
        clim, label = fig.axes[0].get_images()[0].get_clim(), fig.axes[1].get_ylabel()
        if expected is not None:
            assert clim[0] == expected and "fitted" not in label
        else:
            assert clim == pytest.approx((0.5, 0.51)) and "fitted: all values within 0.01 of each other" in label


def test_token_figures_draw_each_data_set_and_soft_moa(tmp_path):
    """Two examples of each of two data sets in the per-token figures; Soft MoA, without Gamma, gets the strongest
    type per token; the loss curve has every step of step_losses, not only the logged lines."""
    soft_types = [names[:2] + ["PROMPT"] + names[2:] for names in TYPES]
    data = load_pickle(os.path.join(fake_run(str(tmp_path / "s"), 0, with_prompt_column, n_examples=4,
                                                   variant="soft", types=soft_types), "type_weight.pkl"))
    for k, ex in enumerate(data["examples"]):
        ex["dataset"], ex["index"] = ("AddSub", "AQuA")[k // 2], k % 2
    pngs = plots.plot_all(str(tmp_path), type_data=data, per_dataset=2)
    assert "token_types" in pngs and "token_weight" not in pngs
    fig = plots.plot_token_types(data, str(tmp_path / "t.png"), plots.chosen_examples(data, 1))
    assert [ax.get_title().split("\n")[0] for ax in fig.axes if ax.get_images()] == ["AddSub #0", "AQuA #0"]
    assert [t.get_text() for t in fig.axes[-1].get_yticklabels()] == plots.type_columns(data)
    log = tmp_path / "log.txt"
    log.write_text("".join(json.dumps(r) + "\n" for r in (
        {"event": "train", "step": 1, "train_loss": 3.0, "step_losses": [3.0]},
        {"event": "train", "step": 100, "train_loss": 1.0, "step_losses": [3.0 - 0.02 * s for s in range(2, 101)]},
        {"event": "step_losses", "step": 130, "step_losses": [1.0] * 30})))
    fig = loss_curves.plot_loss_curves(str(log), str(tmp_path / "l.png"))
    assert len(fig.axes[0].get_lines()[0].get_xdata()) == 130
