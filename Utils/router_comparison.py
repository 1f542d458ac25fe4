"""Several runs' routers side by side: what each chose, and how alike the choices are.

Inputs are the folders `Infer.py --save_weights` writes (type_weight.pkl, token_weight.pkl; the
structure is in Utils/plots.py), one per run, usually the same recipe with different seeds.
Two similarity figures, each a Pearson correlation between two runs:
- `mean`: of their layer x type tables of mean type weights (the type_weight heatmap), over the
  cells both runs have: do the runs favour the same types in the same layers?
- `prompt_tokens`: of the type weights of every prompt token of the examples both runs saw with
  the same prompt (generations differ between runs, prompts do not), over the expert types both
  routers have (Soft MoA's PROMPT is not Sparse MoA's): do the routers agree token by token?
A correlation without the values to define it (no shared prompt, or a run whose values do not vary)
is NaN, and `undefined` in similarity.json says why. Runs are labelled by what tells them apart:
the method (and MoA's variant) and the seed that differ between them, else their folders.
"""
import os

import numpy as np

from Utils import plots  # sets matplotlib's Agg backend before pyplot is imported
from Utils.misc import read_json_object, write_json
from Utils.output_dirs import check_claimable, check_output_dir, record_written

import matplotlib.pyplot as plt  # noqa: E402  (isort: after Utils.plots)
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

TOOL = "compare_routers.py"
OUTPUTS = ("similarity.json", "router_comparison.png")


def pearson(a: np.ndarray, b: np.ndarray) -> tuple:
    """(Pearson correlation of two arrays over the entries finite in both, None), or (NaN, why it is undefined)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    both = np.isfinite(a) & np.isfinite(b)
    if both.sum() < 2:
        return float("nan"), "fewer than two values both runs have"
    a, b = a[both] - a[both].mean(), b[both] - b[both].mean()
    if not ((a * a).sum() > 0 and (b * b).sum() > 0):
        return float("nan"), "one run's values do not vary"
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum())), None


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two arrays over the entries finite in both; NaN when undefined."""
    return pearson(a, b)[0]


def mean_table(type_data) -> np.ndarray:
    """[n_layers, len(TYPE_ORDER)] mean type weights, NaN where a type is absent (columns aligned across runs)."""
    table = plots.layer_by_type(type_data, lambda w: w.mean(0))
    aligned = np.full((table.shape[0], len(plots.TYPE_ORDER)), np.nan)
    for j, name in enumerate(plots.type_columns(type_data)):
        if name in plots.TYPE_ORDER:
            aligned[:, plots.TYPE_ORDER.index(name)] = table[:, j]
    return aligned


def prompt_weights(type_data) -> dict:
    """(dataset, index, prompt ids) -> per layer the type weights of the prompt tokens [n_prompt, n_types]."""
    return {(ex["dataset"], ex["index"], tuple(ex["token_ids"][:ex["n_prompt"]])):
            [None if w is None else w[:ex["n_prompt"]] for w in ex["weights"]] for ex in type_data["examples"]}


def prompt_token_pearson(a, b) -> tuple:
    """pearson() of two runs' type weights over the prompt tokens of the examples both saw, in the columns of the
    expert types both routers have in each layer."""
    wa, wb = prompt_weights(a), prompt_weights(b)
    shared = wa.keys() & wb.keys()
    if not shared:
        return float("nan"), "no example both runs saw with the same prompt"
    xs, ys = [], []
    for key in shared:
        for layer, (x, y) in enumerate(zip(wa[key], wb[key])):
            names_a, names_b = a["layer_types"][layer], b["layer_types"][layer]
            common = [t for t in names_a if t in names_b]
            if x is not None and y is not None and common:
                xs.append(x[:, [names_a.index(t) for t in common]].ravel())
                ys.append(y[:, [names_b.index(t) for t in common]].ravel())
    if not xs:
        return float("nan"), "no layer where both routers weigh the same expert types"
    return pearson(np.concatenate(xs), np.concatenate(ys))


def prompt_token_correlation(a, b) -> float:
    """Correlation of two runs' type weights over the prompt tokens of the examples both saw; NaN when undefined."""
    return prompt_token_pearson(a, b)[0]


def similarity(runs: list) -> dict:
    """{"mean": [[r]], "prompt_tokens": [[r]], "undefined": {measure: {"i-j": why}}}: runs x runs correlation
    matrices (lists; NaN where undefined, and `undefined` says why for each pair i < j)."""
    tables = [mean_table(run["type"]) for run in runs]
    n = len(runs)
    measures = {"mean": lambda i, j: pearson(tables[i], tables[j]),
                "prompt_tokens": lambda i, j: prompt_token_pearson(runs[i]["type"], runs[j]["type"])}
    report = {"undefined": {}}
    for name, measure in measures.items():
        pairs = [[measure(i, j) for j in range(n)] for i in range(n)]
        report[name] = [[r for r, _ in row] for row in pairs]
        report["undefined"][name] = {f"{i}-{j}": pairs[i][j][1] for i in range(n) for j in range(i + 1, n)
                                     if pairs[i][j][1] is not None}
    return report


def read_run(folder: str, label: str = None) -> dict:
    """One run's --save_weights folder: its label (given, else label_runs sets it), its run folder's name, the
    type/token pickles, its training log (or None) and what labels it: method (MoA's variant), seed."""
    type_path = os.path.join(folder, "type_weight.pkl")
    if not os.path.isfile(type_path):
        raise FileNotFoundError(f"{folder}: no type_weight.pkl (run Infer.py --save_weights into this folder)")
    token_path = os.path.join(folder, "token_weight.pkl")
    run_dir = os.path.dirname(os.path.abspath(folder))
    log_path = os.path.join(run_dir, "log.txt")
    args_path = os.path.join(run_dir, "args.json")
    types = plots.load_pickle(type_path, "type_weight")
    seed = read_json_object(args_path, "run settings").get("seed") if os.path.isfile(args_path) else None
    return {"label": label, "name": os.path.basename(run_dir), "type": types,
            "token": plots.load_pickle(token_path, "token_weight") if os.path.isfile(token_path) else None,
            "log": log_path if os.path.isfile(log_path) else None,
            "tells": {"method": plots.method_title(types), "seed": None if seed is None else f"seed {seed}"}}


def label_runs(runs: list):
    """Give each run without a label one from what differs between the runs: the method (with MoA's variant) and
    the seed; with nothing differing, the seed; runs alike in these carry their folder's name too."""
    differing = [k for k in ("method", "seed") if len({run["tells"][k] for run in runs}) > 1] or ["seed"]
    labels = [", ".join(str(run["tells"][k]) for k in differing if run["tells"][k] is not None) or run["name"]
              for run in runs]
    for run, label in zip(runs, labels):
        if run["label"] is None:
            run["label"] = label if labels.count(label) == 1 or label == run["name"] else f"{label} ({run['name']})"


def gamma_table(token_data, example: int):
    """[n_tokens, n_layers] Gamma of one example, or None (Soft MoA, or no such example)."""
    if token_data is None or example >= len(token_data["examples"]):
        return None
    weights = token_data["examples"][example]["weights"]
    if all(w is None for w in weights):
        return None
    n = len(token_data["examples"][example]["token_ids"])
    return np.stack([np.full(n, np.nan) if w is None else w[:, 0] for w in weights], axis=1)


def comparison_figure(runs: list, sims: dict, example: int = 0):
    """One figure (not yet saved): each run's type weights (top) and Gamma on one example (middle, Sparse MoA), the
    loss curves and the similarity matrix (bottom)."""
    n = len(runs)
    gammas = [gamma_table(run["token"], example) for run in runs]
    rows = 3 if any(g is not None for g in gammas) else 2
    fig, axes = plt.subplots(rows, n, squeeze=False, figsize=(3.8 * n + 1.5, 3.4 * rows), layout="constrained")
    columns = list(plots.TYPE_ORDER)
    tables = [mean_table(run["type"]) for run in runs]
    keep = [j for j in range(len(columns)) if any(np.isfinite(t[:, j]).any() for t in tables)]
    # each run its own colour scale, fitted to its values: runs far apart would leave one of them a single colour
    for k, (ax, run, table) in enumerate(zip(axes[0], runs, tables)):
        image = plots.heatmap(ax, table[:, keep], [columns[j] for j in keep],
                              [f"layer {i}" for i in range(table.shape[0])] if k == 0 else [])
        ax.set_title(f"{run['label']}: mean type weight", fontsize=10)
        fig.colorbar(image, ax=ax, label="colour scale {:.4g} to {:.4g}".format(*image.get_clim()))
    if rows == 3:
        for ax, run, g in zip(axes[1], runs, gammas):
            if g is None:
                ax.axis("off")
                continue
            image = plots.heatmap(ax, g, [f"L{i}" for i in range(g.shape[1])], [""] * g.shape[0], cmap="magma",
                                  annotate=False)
            ax.set_yticks([])
            ax.set_ylabel(f"tokens of example {example}" if ax is axes[1][0] else "")
            ax.set_title(f"{run['label']}: Gamma per token", fontsize=10)
            fig.colorbar(image, ax=ax, label="colour scale {:.4g} to {:.4g}".format(*image.get_clim()))
    bottom = axes[-1]
    for run in runs:
        log = plots.read_log(run["log"]) if run["log"] else []
        points = [(r["step"], r["train_loss"]) for r in log if isinstance(r.get("train_loss"), (int, float))
                  and isinstance(r.get("step"), (int, float))]
        if points:
            bottom[0].plot(*zip(*points), label=run["label"], linewidth=1.0)
    bottom[0].set_xlabel("step")
    bottom[0].set_ylabel("train loss")
    bottom[0].set_yscale("log")
    bottom[0].yaxis.set_major_formatter(FormatStrFormatter("%g"))
    bottom[0].yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    bottom[0].grid(alpha=0.3)
    if bottom[0].lines:
        bottom[0].legend(fontsize=8)
    labels = [run["label"] for run in runs]
    if n > 1:
        matrix = np.array(sims["mean"], dtype=np.float64)
        plots.heatmap(bottom[1], matrix, labels, labels, cmap="coolwarm", vmin=-1.0, vmax=1.0)
        for i, j in zip(*np.nonzero(np.isnan(matrix))):
            bottom[1].text(j, i, "undefined", ha="center", va="center", fontsize=6)
        bottom[1].set_title("correlation of mean type weights", fontsize=10)
    for ax in bottom[2 if n > 1 else 1:]:
        ax.axis("off")
    return fig


def compare(folders: list, out_dir: str, labels=None, example: int = 0) -> dict:
    """Read the runs, write router_comparison.png and similarity.json into out_dir; returns the similarity.
    out_dir is written as every tool writes (Utils/output_dirs.py): a name it writes that no manifest lists
    is the user's and refused, and its manifest records both before they are written."""
    check_output_dir(out_dir)
    check_claimable(out_dir, OUTPUTS)
    runs = [read_run(f, label) for f, label in zip(folders, labels or [None] * len(folders))]
    layers = {len(run["type"]["layer_types"]) for run in runs}
    if len(layers) > 1:
        raise ValueError(f"the runs have {' and '.join(map(str, sorted(layers)))} layers ("
                         + ", ".join(f"{f}: {len(r['type']['layer_types'])}" for f, r in zip(folders, runs))
                         + "): runs of different bases cannot be compared layer by layer")
    fewest = min(runs, key=lambda run: len(run["type"]["examples"]))
    if example >= len(fewest["type"]["examples"]):
        raise ValueError(f"--example {example}: {folders[runs.index(fewest)]} holds {len(fewest['type']['examples'])} "
                         "examples (counted from 0)")
    label_runs(runs)
    sims = similarity(runs)
    figure = comparison_figure(runs, sims, example)  # drawn before anything is written: a failure leaves out_dir
    os.makedirs(out_dir, exist_ok=True)
    record_written(out_dir, TOOL, OUTPUTS)
    report = {"runs": [{"label": r["label"], "folder": os.path.abspath(f)} for r, f in zip(runs, folders)], **sims}
    undefined_as_null = {k: [[None if np.isnan(r) else r for r in row] for row in sims[k]] for k in ("mean",
                                                                                                     "prompt_tokens")}
    write_json({**report, **undefined_as_null}, os.path.join(out_dir, "similarity.json"))
    plt.close(plots.save(figure, os.path.join(out_dir, "router_comparison.png")))
    return report
