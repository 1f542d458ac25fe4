"""Several runs' routers side by side: what each chose, and how alike the choices are.

Inputs are the folders `Infer.py --save_weights` writes (type_weight.pkl, token_weight.pkl; the
structure is in Utils/plots.py), one per run, usually the same recipe with different seeds.
The similarity of two runs, each a correlation (NaN where undefined, and `undefined` in similarity.json says why):
- `mean_centred` (the headline): Pearson over the cells of their layer x type tables of mean type weights after
  each layer's mean over its types is taken away. A router's layers differ in level (layer 0 near 0.52 for every
  type, layer 1 lower, in every run), and over the raw cells that offset alone makes two runs correlate that rank
  the types of each layer differently; centred, only how each layer weighs its types against each other counts.
- `mean_rank`: Spearman's rank correlation of the types within each layer, averaged over the layers.
- `mean`: Pearson over the raw cells (the layers' offsets included), beside them for what it is.
- `per_layer`: per pair "i-j", each layer's Pearson and Spearman over its types.
- `prompt_tokens`: Pearson of the type weights of every prompt token of the examples both runs saw with the same
  prompt (generations differ between runs, prompts do not), over the expert types both routers have (Soft MoA's
  PROMPT is not Sparse MoA's): do the routers agree token by token?
Runs are labelled by every setting that differs between them: the router (method, MoA's variant) and the fields of
each run's adapter_params.json and args.json (precision, epochs, seed, lr, ...), and the precision its evaluation ran
in (scores.json); runs alike in all of these by their folders.
"""
import json
import os
import textwrap

import numpy as np

from Utils import plots, router_report  # plots sets matplotlib's Agg backend before pyplot is imported
from Utils.loss_curves import read_log, train_points
from Utils.file_io import read_json_object, write_json
from Utils.output_dirs import check_claimable, check_output_dir, record_written
from Utils.weight_pickles import TYPE_ORDER, load_pickle

import matplotlib.pyplot as plt  # noqa: E402  (isort: after Utils.plots)
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

TOOL = "compare_routers.py"
OUTPUTS = ("similarity.json", "router_comparison.png", router_report.REPORT)
REPORT_EXAMPLES = 3  # examples of each data set in the report
# where and how a run was started, not what it trained (the router names method and variant)
NOT_SETTINGS = ("output_dir", "run_id", "resume", "overwrite", "synthetic_data", "method", "variant")
MEASURES = {"mean_centred": "mean type weights within layers (centred: each layer's mean taken away)",
            "mean_rank": "mean type weights, rank (Spearman) of the types within each layer, mean over layers",
            "mean": "mean type weights over all cells (overall: the offsets between layers included)",
            "prompt_tokens": "type weights token by token over the prompts both runs saw"}


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
    aligned = np.full((table.shape[0], len(TYPE_ORDER)), np.nan)
    for j, name in enumerate(plots.type_columns(type_data)):
        if name in TYPE_ORDER:
            aligned[:, TYPE_ORDER.index(name)] = table[:, j]
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


def centred(table: np.ndarray) -> np.ndarray:
    """Each layer's (row's) mean over its finite cells taken away."""
    finite = np.isfinite(table)
    means = np.where(finite, table, 0).sum(1, keepdims=True) / np.maximum(finite.sum(1, keepdims=True), 1)
    return table - means


def on_shared_cells(a: np.ndarray, b: np.ndarray) -> tuple:
    """Both tables with NaN where either has none: a layer is centred on the types both runs have."""
    shared = np.isfinite(a) & np.isfinite(b)
    return np.where(shared, a, np.nan), np.where(shared, b, np.nan)


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank."""
    order = np.empty(len(values))
    order[np.argsort(values, kind="stable")] = np.arange(len(values))
    for value in np.unique(values):
        order[values == value] = order[values == value].mean()
    return order


def layer_correlations(a: np.ndarray, b: np.ndarray) -> tuple:
    """(per layer Pearson, per layer Spearman) of two tables over the types both have (NaN where undefined)."""
    pearsons, spearmans = [], []
    for x, y in zip(a, b):
        both = np.isfinite(x) & np.isfinite(y)
        pearsons.append(pearson(x, y)[0])
        spearmans.append(pearson(ranks(x[both]), ranks(y[both]))[0] if both.sum() >= 2 else float("nan"))
    return pearsons, spearmans


def mean_rank(a: np.ndarray, b: np.ndarray) -> tuple:
    """(mean over layers of the within-layer Spearman correlation, None), or (NaN, why)."""
    defined = [r for r in layer_correlations(a, b)[1] if np.isfinite(r)]
    return (float(np.mean(defined)), None) if defined else (float("nan"), "no layer whose types both runs rank")


def similarity(runs: list) -> dict:
    """{measure: [[r]] for each of MEASURES, "per_layer": {"i-j": {"pearson": [...], "spearman": [...]}},
    "undefined": {measure: {"i-j": why}}}: runs x runs correlation matrices (lists; NaN where undefined, and
    `undefined` says why for each pair i < j)."""
    tables = [mean_table(run["type"]) for run in runs]
    n = len(runs)
    measures = {"mean_centred": lambda i, j: pearson(*(centred(t) for t in on_shared_cells(tables[i], tables[j]))),
                "mean_rank": lambda i, j: mean_rank(tables[i], tables[j]),
                "mean": lambda i, j: pearson(tables[i], tables[j]),
                "prompt_tokens": lambda i, j: prompt_token_pearson(runs[i]["type"], runs[j]["type"])}
    report = {"undefined": {}}
    for name, measure in measures.items():
        pairs = [[measure(i, j) for j in range(n)] for i in range(n)]
        report[name] = [[r for r, _ in row] for row in pairs]
        report["undefined"][name] = {f"{i}-{j}": pairs[i][j][1] for i in range(n) for j in range(i + 1, n)
                                     if pairs[i][j][1] is not None}
    report["per_layer"] = {f"{i}-{j}": dict(zip(("pearson", "spearman"), layer_correlations(tables[i], tables[j])))
                           for i in range(n) for j in range(i + 1, n)}
    return report


def read_run(folder: str, label: str = None) -> dict:
    """One run's --save_weights folder: its label (given, else label_runs sets it), its run folder's name, the
    type/token pickles, its predictions, its training log (or None) and its settings (run_settings)."""
    type_path = os.path.join(folder, "type_weight.pkl")
    if not os.path.isfile(type_path):
        raise FileNotFoundError(f"{folder}: no type_weight.pkl (run Infer.py --save_weights into this folder)")
    token_path = os.path.join(folder, "token_weight.pkl")
    run_dir = os.path.dirname(os.path.abspath(folder))
    log_path = os.path.join(run_dir, "log.txt")
    types = load_pickle(type_path, "type_weight")
    return {"label": label, "name": os.path.basename(run_dir), "type": types,
            "token": load_pickle(token_path, "token_weight") if os.path.isfile(token_path) else None,
            "predictions": router_report.read_predictions(folder),
            "log": log_path if os.path.isfile(log_path) else None,
            "settings": {"router": plots.method_title(types), **run_settings(folder, run_dir)}}


def run_settings(folder: str, run_dir: str) -> dict:
    """What a run trained with: its adapter's adapter_params.json, then its args.json (both where present), less
    NOT_SETTINGS; and the precision its evaluation ran in (scores.json), as `eval precision`."""
    settings = {}
    for path in (os.path.join(run_dir, "adapter", "adapter_params.json"), os.path.join(run_dir, "args.json"),
                 os.path.join(folder, "scores.json")):
        if os.path.isfile(path):
            recorded = read_json_object(path, "run settings")
            settings.update({"eval precision": recorded.get("precision")} if path.endswith("scores.json")
                            else recorded)
    return {k: v for k, v in settings.items() if k not in NOT_SETTINGS and v is not None}


def shown(value) -> str:
    """A setting's value in a label: a path by its last part."""
    return os.path.basename(value.rstrip("/")) if isinstance(value, str) and "/" in value else str(value)


def label_runs(runs: list):
    """Give each run without a label one naming every setting that differs between the runs (the router first);
    runs alike in all of them carry their folder's name."""
    keys = sorted({k for run in runs for k in run["settings"]}, key=lambda k: (k != "router", k))
    differing = [k for k in keys if len({json.dumps(run["settings"].get(k), sort_keys=True) for run in runs}) > 1]
    labels = [", ".join(f"{k} {shown(run['settings'].get(k))}" if k != "router" else run["settings"][k]
                        for k in differing) or run["name"] for run in runs]
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


def wrapped(text: str, width: int = 34) -> str:
    """A title or label in lines of at most `width` characters: the panels side by side keep apart."""
    return "\n".join(textwrap.wrap(text, width))


def comparison_figure(runs: list, sims: dict, example: int = 0):
    """One figure (not yet saved): each run's type weights (top) and Gamma on one example (middle, Sparse MoA), one
    colour scale per quantity for every run; the loss curves and the runs' within-layer correlations (bottom)."""
    n = len(runs)
    gammas = [gamma_table(run["token"], example) for run in runs]
    rows = 3 if any(g is not None for g in gammas) else 2
    fig, axes = plt.subplots(rows, n, squeeze=False, figsize=(3.8 * n + 1.5, 3.4 * rows), layout="constrained")
    columns = list(TYPE_ORDER)
    tables = [mean_table(run["type"]) for run in runs]
    keep = [j for j in range(len(columns)) if any(np.isfinite(t[:, j]).any() for t in tables)]
    scale = plots.colour_range(*tables)  # one scale for every run: equal colours are equal weights
    for k, (ax, run, table) in enumerate(zip(axes[0], runs, tables)):
        image = plots.heatmap(ax, table[:, keep], [columns[j] for j in keep],
                              [f"layer {i}" for i in range(table.shape[0])] if k == 0 else [], scale=scale)
        ax.set_title(wrapped(f"{run['label']}: mean type weight"), fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label=plots.scale_label("mean type weight, every run", scale))
    if rows == 3:
        scale = plots.colour_range(*[g for g in gammas if g is not None])
        for ax, run, g in zip(axes[1], runs, gammas):
            if g is None:
                ax.axis("off")
                continue
            image = plots.heatmap(ax, g, [f"L{i}" for i in range(g.shape[1])], [""] * g.shape[0], cmap="magma",
                                  annotate=False, scale=scale)
            ax.set_yticks([])
            ax.set_ylabel(f"tokens of example {example}" if ax is axes[1][0] else "")
            ax.set_title(wrapped(f"{run['label']}: Gamma per token"), fontsize=9)
        fig.colorbar(image, ax=axes[1].tolist(), label=plots.scale_label("Gamma, every run", scale))
    bottom = axes[-1]
    for run in runs:
        points = train_points(read_log(run["log"])) if run["log"] else []
        if points:
            bottom[0].plot(*zip(*points), label=run["label"], linewidth=1.0)
    bottom[0].set_xlabel("step")
    bottom[0].set_ylabel("train loss")
    bottom[0].set_yscale("log")
    bottom[0].yaxis.set_major_formatter(FormatStrFormatter("%g"))
    bottom[0].yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    bottom[0].grid(alpha=0.3)
    if bottom[0].lines:
        bottom[0].legend(fontsize=7)
    labels = [run["label"] for run in runs]
    if n > 1:
        matrix, overall = (np.array(sims[k], dtype=np.float64) for k in ("mean_centred", "mean"))
        names = [wrapped(label, 24) for label in labels]
        image = plots.heatmap(bottom[1], matrix, names, names, cmap="coolwarm", annotate=False, scale=plots.Scale(-1, 1))
        for (i, j), r in np.ndenumerate(matrix):
            bottom[1].text(j, i, "undefined" if np.isnan(r) else f"{r:.2f}\n(overall {overall[i, j]:.2f})",
                           ha="center", va="center", fontsize=6,
                           color="k" if np.isnan(r) else plots.text_colour(image.cmap(image.norm(r))))
        bottom[1].set_title("correlation of mean type weights within layers\n(each layer's mean taken away; "
                            "overall, offsets included, in brackets)", fontsize=8)
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
    report = {"runs": [{"label": r["label"], "folder": os.path.abspath(f), "settings": r["settings"]}
                       for r, f in zip(runs, folders)], "measures": MEASURES, **sims}
    undefined_as_null = {k: [[None if np.isnan(r) else r for r in row] for row in sims[k]] for k in MEASURES}
    per_layer = {pair: {k: [None if np.isnan(r) else r for r in rs] for k, rs in layers.items()}
                 for pair, layers in sims["per_layer"].items()}
    write_json({**report, **undefined_as_null, "per_layer": per_layer}, os.path.join(out_dir, "similarity.json"))
    plt.close(plots.save(figure, os.path.join(out_dir, "router_comparison.png")))
    correlations = {"labels": [r["label"] for r in runs],
                    "measures": [{"name": MEASURES[k] + (" (the headline)" if k == "mean_centred" else ""),
                                  "matrix": undefined_as_null[k]} for k in MEASURES]}
    views = [router_report.run_view(r["type"], r["token"], r["predictions"], r["label"], REPORT_EXAMPLES) for r in runs]
    router_report.write_report(os.path.join(out_dir, router_report.REPORT), router_report.report_data(
        views, f"Routers of {len(runs)} runs", [f"{r['label']}: {os.path.abspath(f)}" for r, f in zip(runs, folders)],
        correlations))
    return report
