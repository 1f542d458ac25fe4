"""Several runs' routers side by side: what each chose, and how alike the choices are.

Inputs are the folders `Infer.py --save_weights` writes (type_weight.pkl, token_weight.pkl; the
structure is in Utils/plots.py), one per run, usually the same recipe with different seeds.
Two similarity figures, each a Pearson correlation between two runs:
- `mean`: of their layer x type tables of mean type weights (the type_weight heatmap), over the
  cells both runs have: do the runs favour the same types in the same layers?
- `prompt_tokens`: of the type weights of every prompt token of the examples both runs saw with
  the same prompt (generations differ between runs, prompts do not): do the routers agree token
  by token?
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


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two arrays over the entries finite in both; NaN when undefined."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    both = np.isfinite(a) & np.isfinite(b)
    if both.sum() < 2:
        return float("nan")
    a, b = a[both] - a[both].mean(), b[both] - b[both].mean()
    denominator = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denominator) if denominator > 0 else float("nan")


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


def prompt_token_correlation(a, b) -> float:
    """Correlation of two runs' type weights over the prompt tokens of the examples both saw."""
    wa, wb = prompt_weights(a), prompt_weights(b)
    xs, ys = [], []
    for key in wa.keys() & wb.keys():
        for layer, (x, y) in enumerate(zip(wa[key], wb[key])):
            if x is not None and y is not None and a["layer_types"][layer] == b["layer_types"][layer]:
                xs.append(x.ravel())
                ys.append(y.ravel())
    return correlation(np.concatenate(xs), np.concatenate(ys)) if xs else float("nan")


def similarity(runs: list) -> dict:
    """{"mean": [[r]], "prompt_tokens": [[r]]}: runs x runs correlation matrices (lists, JSON-ready)."""
    tables = [mean_table(run["type"]) for run in runs]
    n = len(runs)
    mean = [[correlation(tables[i], tables[j]) for j in range(n)] for i in range(n)]
    tokens = [[prompt_token_correlation(runs[i]["type"], runs[j]["type"]) for j in range(n)] for i in range(n)]
    return {"mean": mean, "prompt_tokens": tokens}


def read_run(folder: str, label: str = None) -> dict:
    """One run's --save_weights folder: its label, type/token pickles and its training log (or None)."""
    type_path = os.path.join(folder, "type_weight.pkl")
    if not os.path.isfile(type_path):
        raise FileNotFoundError(f"{folder}: no type_weight.pkl (run Infer.py --save_weights into this folder)")
    token_path = os.path.join(folder, "token_weight.pkl")
    run_dir = os.path.dirname(os.path.abspath(folder))
    log_path = os.path.join(run_dir, "log.txt")
    if label is None:
        args_path = os.path.join(run_dir, "args.json")
        seed = read_json_object(args_path, "run settings").get("seed") if os.path.isfile(args_path) else None
        label = f"seed {seed}" if seed is not None else os.path.basename(run_dir)
    return {"label": label, "type": plots.load_pickle(type_path, "type_weight"),
            "token": plots.load_pickle(token_path, "token_weight") if os.path.isfile(token_path) else None,
            "log": log_path if os.path.isfile(log_path) else None}


def gamma_table(token_data, example: int):
    """[n_tokens, n_layers] Gamma of one example, or None (Soft MoA, or no such example)."""
    if token_data is None or example >= len(token_data["examples"]):
        return None
    weights = token_data["examples"][example]["weights"]
    if all(w is None for w in weights):
        return None
    n = len(token_data["examples"][example]["token_ids"])
    return np.stack([np.full(n, np.nan) if w is None else w[:, 0] for w in weights], axis=1)


def plot_comparison(runs: list, sims: dict, path: str, example: int = 0):
    """One figure: each run's type weights (top) and Gamma on one example (middle, Sparse MoA), the
    loss curves and the similarity matrix (bottom)."""
    n = len(runs)
    gammas = [gamma_table(run["token"], example) for run in runs]
    rows = 3 if any(g is not None for g in gammas) else 2
    fig, axes = plt.subplots(rows, n, squeeze=False, figsize=(3.8 * n + 1.5, 3.4 * rows), layout="constrained")
    columns = list(plots.TYPE_ORDER)
    tables = [mean_table(run["type"]) for run in runs]
    keep = [j for j in range(len(columns)) if any(np.isfinite(t[:, j]).any() for t in tables)]
    for k, (ax, run, table) in enumerate(zip(axes[0], runs, tables)):
        image = plots.heatmap(ax, table[:, keep], [columns[j] for j in keep],
                              [f"layer {i}" for i in range(table.shape[0])] if k == 0 else [], vmin=0.0, vmax=1.0)
        ax.set_title(f"{run['label']}: mean type weight", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="mean type weight")
    if rows == 3:
        top = max(np.nanmax(g) for g in gammas if g is not None)
        for ax, run, g in zip(axes[1], runs, gammas):
            if g is None:
                ax.axis("off")
                continue
            image = plots.heatmap(ax, g, [f"L{i}" for i in range(g.shape[1])], [""] * g.shape[0], cmap="magma",
                                  annotate=False, vmin=0.0, vmax=top)
            ax.set_yticks([])
            ax.set_ylabel(f"tokens of example {example}" if ax is axes[1][0] else "")
            ax.set_title(f"{run['label']}: Gamma per token", fontsize=10)
        fig.colorbar(image, ax=axes[1].tolist(), label="Gamma (token threshold)")
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
        bottom[1].set_title("correlation of mean type weights", fontsize=10)
    for ax in bottom[2 if n > 1 else 1:]:
        ax.axis("off")
    return plots.save(fig, path)


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
    sims = similarity(runs)
    os.makedirs(out_dir, exist_ok=True)
    record_written(out_dir, TOOL, OUTPUTS)
    report = {"runs": [{"label": r["label"], "folder": os.path.abspath(f)} for r, f in zip(runs, folders)], **sims}
    write_json(report, os.path.join(out_dir, "similarity.json"))
    plt.close(plot_comparison(runs, sims, os.path.join(out_dir, "router_comparison.png"), example))
    return report
