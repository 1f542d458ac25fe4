"""Heatmaps of the router's decisions and loss curves, as PNG files (matplotlib, Agg).

`Infer.py --save_weights` writes two pickles (plain Python lists/dicts, numpy
arrays and None; nothing else) into its output directory:

    type_weight.pkl = {
        "kind": "type_weight",
        "method": "moa" | "moe" | "topk" | "adamole" | "instance" | "unipeft",
        "variant": "soft" | "sparse",     # MoA's
        "layer_types": [[str, ...], ...],  # per layer, the router's column names in order,
                                           # e.g. ["Q", "K", "V", "O", "FFN_DOWN", "PADAPTER"]
                                           # (UniPEFT: ["LORA", "PROMPT", "PADAPTER"]); [] for a
                                           # layer without experts or a method without a type router
        "examples": [                      # in input order (data files in the order given)
            {"dataset": str,               # e.g. "AddSub" or "synthetic"
             "index": int,                 # position of the example in its data file
             "tokens": [str, ...],         # text of each token (prompt then generation), n_tokens long
             "token_ids": [int, ...],      # n_tokens ids; token 0 is bos
             "n_prompt": int,              # the first n_prompt tokens are the prompt
             "generation": str,            # decoded generated text (stop token excluded)
             "weights": [np.ndarray float32 [n_tokens, n_types_of_layer] or None, ...]},  # per layer
            ...]}

    token_weight.pkl = the same, with "kind": "token_weight" and "weights" per layer
        np.ndarray float32 [n_tokens, 1]: Sparse MoA's per-token threshold Gamma, or None
        (Soft MoA, or a layer without experts).

    expert_weight.pkl (only for a model with families of several experts: MoE-LoRA, top-k,
    AdaMoLE, or expert_num > 1) = the same, with "kind": "expert_weight", "layer_types"
    listing per layer the families that mix experts, and "weights" per layer a dict
    {family: np.ndarray float32 [n_tokens, expert_num]}: the weight each expert's output got
    (top-k and AdaMoLE: 0 for an unselected expert).

Instance-level methods (instance, unipeft) decide once per sequence: their type weights
repeat the sequence's gates on every token, and the heatmaps show them per example.

Row t of a weight array belongs to token t: the values the router computed when
that token was fed to the model (a token's weights decide how the experts
process it, and thereby what comes next). type_weight is the weight w each
expert type's output is multiplied by (Sparse: 0 for an unselected expert).

Functions take the loaded dicts, write a PNG and return the matplotlib Figure. Every colour scale spans the
values drawn (after 30 steps a router's type weights may all lie within 0.50-0.51, invisible on 0-1), and the
colour bar says the span.
"""
import json
import os
import pickle

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from Utils.misc import atomic_write  # noqa: E402

TYPE_ORDER = ("Q", "K", "V", "PROMPT", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER")


def weight_pickles(test_sets, tok, results, model):
    """The --save_weights dicts (the structure above) from Infer.py's results: type_weight and
    token_weight, and expert_weight or None when no family mixes several experts."""
    base = {"method": model.args.method, "variant": model.args.variant,
            "layer_types": [list(layer.router_columns) for layer in model.llama.layers]}
    type_data = {"kind": "type_weight", **base, "examples": []}
    token_data = {"kind": "token_weight", **base, "examples": []}
    families = [sorted(layer["expert_weight"], key=family_order) for layer in results[0]["records"]] if results else []
    expert_data = {"kind": "expert_weight", **base, "layer_types": families, "examples": []}
    for name, _, _, first, count in test_sets:
        for i in range(first, first + count):
            r = results[i]
            common = {"dataset": name, "index": i - first, "token_ids": r["token_ids"],
                      "tokens": [tok.decode([t]) if t < tok.n_words else f"<id {t}>" for t in r["token_ids"]],
                      "n_prompt": r["n_prompt"],
                      "generation": r["generation"]}
            type_data["examples"].append({**common, "weights": [layer["type_weight"] for layer in r["records"]]})
            token_data["examples"].append({**common, "weights": [layer["token_weight"] for layer in r["records"]]})
            expert_data["examples"].append({**common, "weights": [layer["expert_weight"] for layer in r["records"]]})
    return type_data, token_data, (expert_data if any(families) else None)


def family_order(name: str) -> int:
    return TYPE_ORDER.index(name) if name in TYPE_ORDER else len(TYPE_ORDER)


class WeightsUnpickler(pickle.Unpickler):
    """Plain unpickling would call whatever a crafted file names: these pickles are read through an
    allow-list, numpy arrays (and their dtypes and scalars) besides the containers pickle builds itself."""
    ALLOWED = {(f"numpy.{core}.{module}", name) for core in ("core", "_core")  # numpy 1 and 2
               for module, name in [("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                                    ("numeric", "_frombuffer")]} | {("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a --save_weights pickle never holds")
        return super().find_class(module, name)


def load_pickle(path, kind: str = None):
    """A --save_weights pickle; with `kind` (type_weight, token_weight) its structure is checked against
    the one above, so a damaged file, or one of another kind under this name, is a ValueError naming it."""
    with open(path, "rb") as f:
        try:
            data = WeightsUnpickler(f).load()
        except Exception as e:  # whatever a damaged or crafted file makes the unpickler raise
            raise ValueError(f"{path}: not a --save_weights pickle ({type(e).__name__}: {e})") from None
    if kind is not None:
        check_weights(data, path, kind)
    return data


class NonFiniteWeights(ValueError):
    """A --save_weights pickle whose router weights hold NaN or inf (exit 3, as other non-finite numbers)."""


def check_weights(data, path, kind: str):
    """Refuse a type_weight or token_weight dict that is not the structure above, naming the file and where: every
    weight array real numbers of its shape, finite (else NonFiniteWeights), and what keys an example (dataset,
    index, token_ids) of its kind."""
    def bad(where, what):
        raise ValueError(f"{path}: {where} {what}, not the {kind} structure Infer.py --save_weights writes")
    if not isinstance(data, dict) or data.get("kind") != kind:
        bad("is", f"kind {data.get('kind') if isinstance(data, dict) else type(data).__name__!r}")
    if not (isinstance(data.get("method", "moa"), str) and isinstance(data.get("variant", ""), str)
            and (data.get("method", "moa") != "moa" or "variant" in data)):
        bad("its method and variant", "are not names (MoA's with its variant)")
    layers = data.get("layer_types")
    if not (isinstance(layers, list) and all(isinstance(n, list) and all(isinstance(t, str) for t in n) for n in layers)):
        bad("its layer_types", "are not per layer a list of type names")
    if not isinstance(data.get("examples"), list):
        bad("its examples", "are not a list")
    for i, ex in enumerate(data["examples"]):
        ids = ex.get("token_ids") if isinstance(ex, dict) else None
        if not (isinstance(ids, list) and all(type(t) is int for t in ids) and type(ex.get("n_prompt")) is int
                and 0 <= ex["n_prompt"] <= len(ids) and isinstance(ex.get("weights"), list)
                and len(ex["weights"]) == len(layers) and isinstance(ex.get("dataset"), str)
                and type(ex.get("index")) is int):
            bad(f"example {i}", f"has no dataset name, index, integer token_ids, n_prompt within them and weights "
                                f"for each of {len(layers)} layers")
        for layer, (names, w) in enumerate(zip(layers, ex["weights"])):
            columns = len(names) if kind == "type_weight" else 1
            if w is None:
                continue
            if not (isinstance(w, np.ndarray) and w.shape == (len(ids), columns)):
                bad(f"example {i} layer {layer}", f"weights {getattr(w, 'shape', type(w).__name__)}, expected "
                                                  f"[{len(ids)} tokens, {columns}]")
            if w.dtype.kind not in "fiu":  # complex, bool, strings, objects: no router weighs with them
                bad(f"example {i} layer {layer}", f"weights of dtype {w.dtype}, not real numbers")
            if not np.isfinite(w).all():
                raise NonFiniteWeights(f"{path}: example {i} layer {layer}: the weights hold NaN or inf")


def type_columns(data) -> list:
    """The union of expert types over layers, in the router's fixed order."""
    present = {name for names in data["layer_types"] for name in names}
    return [t for t in TYPE_ORDER if t in present] + sorted(present - set(TYPE_ORDER))


def stacked_tokens(data, layer: int):
    """All examples' weights of one layer joined over tokens: [sum n_tokens, n_types] or None."""
    arrays = [ex["weights"][layer] for ex in data["examples"] if ex["weights"][layer] is not None]
    return np.concatenate(arrays, 0) if arrays else None


def layer_by_type(data, statistic) -> np.ndarray:
    """[n_layers, n_columns] of statistic(weights [N, n_types]) -> [n_types]; NaN where a type is absent."""
    columns = type_columns(data)
    table = np.full((len(data["layer_types"]), len(columns)), np.nan)
    for layer, names in enumerate(data["layer_types"]):
        weights = stacked_tokens(data, layer)
        if weights is None or not names:
            continue
        values = statistic(weights)
        for j, name in enumerate(names):
            table[layer, columns.index(name)] = values[j]
    return table


def colour_range(*tables) -> tuple:
    """(low, high) of the finite values of `tables`, the span a colour scale fits; (0, 1) when there are none."""
    values = np.concatenate([np.asarray(t, np.float64).ravel() for t in tables])
    values = values[np.isfinite(values)]
    if not values.size:
        return 0.0, 1.0
    low, high = float(values.min()), float(values.max())
    return (low, high) if high > low else (low - 0.5e-3, high + 0.5e-3)  # one value: a scale around it


def scale_label(name: str, low: float, high: float) -> str:
    return f"{name}\n(colour scale {low:.4g} to {high:.4g})"


def heatmap(ax, table, x_labels, y_labels, cmap="viridis", annotate=True, vmin=None, vmax=None):
    """imshow of `table` (NaN blank), colours from vmin to vmax (the values' span when not given), the values
    written in the cells of a small table with as many decimals as their span needs."""
    if vmin is None or vmax is None:
        low, high = colour_range(table)
        vmin, vmax = low if vmin is None else vmin, high if vmax is None else vmax
    image = ax.imshow(np.ma.masked_invalid(table), aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                      interpolation="nearest")
    ax.set_xticks(range(len(x_labels)))
    ax.set_xticklabels(x_labels, rotation=45, ha="right")
    ax.set_yticks(range(len(y_labels)))
    ax.set_yticklabels(y_labels)
    if annotate and table.size <= 400:
        digits = int(np.clip(1 - np.floor(np.log10(vmax - vmin)), 2, 4))
        for (i, j), value in np.ndenumerate(table):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.{digits}f}", ha="center", va="center", fontsize=7, color="w")
    return image


def save(fig, path):
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
    return fig


def plot_type_weight(type_data, path):
    """Layers x expert types: the mean type weight over every token of every example."""
    table = layer_by_type(type_data, lambda w: w.mean(0))
    if not np.isfinite(table).any():
        return None
    columns = type_columns(type_data)
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(columns), 1.5 + 0.4 * table.shape[0]))
    image = heatmap(ax, table, columns, [f"layer {i}" for i in range(table.shape[0])])
    fig.colorbar(image, ax=ax, label=scale_label("mean type weight", *image.get_clim()))
    ax.set_xlabel("expert type")
    ax.set_ylabel("layer")
    ax.set_title(f"{method_title(type_data)}: type weights (mean over {len(type_data['examples'])} examples)")
    return save(fig, path)


def method_title(data) -> str:
    method = data.get("method", "moa")  # pickles written before the baselines carry no method
    return f"{data['variant']} MoA" if method == "moa" else method


def plot_expert_weight(expert_data, path):
    """(layer, family) x expert: the mean weight each expert got over every token of every example."""
    rows = [(layer, family) for layer, families in enumerate(expert_data["layer_types"]) for family in families]
    if not rows:
        return None
    n_experts = max(expert_data["examples"][0]["weights"][layer][family].shape[1] for layer, family in rows)
    table = np.full((len(rows), n_experts), np.nan)
    for r, (layer, family) in enumerate(rows):
        stacked = np.concatenate([ex["weights"][layer][family] for ex in expert_data["examples"]], 0)
        table[r, :stacked.shape[1]] = stacked.mean(0)
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * n_experts, 1.5 + 0.3 * len(rows)))
    image = heatmap(ax, table, [f"expert {e}" for e in range(n_experts)],
                    [f"layer {layer} {family}" for layer, family in rows])
    fig.colorbar(image, ax=ax, label=scale_label("mean expert weight", *image.get_clim()))
    ax.set_title(f"{method_title(expert_data)}: expert weights (mean over {len(expert_data['examples'])} examples)")
    return save(fig, path)


def token_label(text: str) -> str:
    """A token's text as a tick label: escapes visible, no mathtext."""
    label = repr(text)[1:-1]
    label = label if len(label) <= 16 else label[:14] + ".."
    return label.replace("$", r"\$") or "''"


def token_window(n_prompt: int, n_tokens: int, max_tokens: int) -> tuple:
    """(start, stop) of the tokens of an example drawn in at most max_tokens rows: all of them when they fit,
    else the end of the prompt (at least a third of the rows, more when the answer is short) and the answer
    from its start."""
    if n_tokens <= max_tokens:
        return 0, n_tokens
    prompt_rows = min(n_prompt, max(max_tokens // 3, max_tokens - (n_tokens - n_prompt)))
    return n_prompt - prompt_rows, n_prompt - prompt_rows + max_tokens


def plot_token_weight(token_data, path, examples=(0,), max_tokens=160):
    """Tokens x layers of Sparse MoA's threshold Gamma for a few examples: the prompt's end and the answer
    (token_window), a line between them."""
    examples = [i for i in examples if i < len(token_data["examples"])]
    n_layers = len(token_data["layer_types"])
    chosen = [token_data["examples"][i] for i in examples
              if any(w is not None for w in token_data["examples"][i]["weights"])]
    if not chosen:
        return None  # Soft MoA or no experts: there is no Gamma
    windows = [token_window(ex["n_prompt"], len(ex["tokens"]), max_tokens) for ex in chosen]
    tables = []
    for ex, (start, stop) in zip(chosen, windows):
        tables.append(np.stack([np.full(stop - start, np.nan) if w is None else w[start:stop, 0]
                                for w in ex["weights"]], axis=1))
    low, high = colour_range(*tables)  # one scale for the examples side by side
    width, height = (2.5 + 0.5 * n_layers) * len(chosen) + 1.0, 1.5 + 0.16 * max(len(t) for t in tables)
    fig, axes = plt.subplots(1, len(chosen), squeeze=False, figsize=(width, height))
    fig.subplots_adjust(wspace=0.9)
    for ax, ex, (start, stop), table in zip(axes[0], chosen, windows, tables):
        labels = [token_label(t) for t in ex["tokens"][start:stop]]
        image = heatmap(ax, table, [f"L{i}" for i in range(n_layers)], labels, cmap="magma", annotate=False,
                        vmin=low, vmax=high)
        for tick in ax.get_yticklabels():
            tick.set_fontsize(6)
        if start < ex["n_prompt"] < stop:  # a line between the prompt and the answer
            ax.axhline(ex["n_prompt"] - start - 0.5, color="c", linewidth=1.0)
        ax.set_xlabel("layer")
        shown = "" if (start, stop) == (0, len(ex["tokens"])) else f", tokens {start}-{stop - 1} of {len(ex['tokens'])}"
        ax.set_title(f"{ex['dataset']} #{ex['index']} ({ex['n_prompt']} prompt tokens{shown})", fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=min(1.0, 6.0 / height),
                 label=scale_label("Gamma (token threshold)", low, high))
    return save(fig, path)


def plot_router_stats(type_data, path):
    """Per layer: how often each expert type is active, and the spread of weights across types."""
    sparse = method_title(type_data) == "sparse MoA"
    cut = 0.0 if sparse else 0.5
    active = layer_by_type(type_data, lambda w: (w > cut).mean(0) if sparse else (w >= cut).mean(0))
    if not np.isfinite(active).any():
        return None
    columns = type_columns(type_data)
    n_layers = active.shape[0]
    spread = np.full(n_layers, np.nan)
    for layer in range(n_layers):
        weights = stacked_tokens(type_data, layer)
        if weights is not None and weights.shape[1] > 1:
            spread[layer] = weights.std(1).mean()
    fig, (left, right) = plt.subplots(1, 2, figsize=(3.0 + 1.2 * len(columns), 1.8 + 0.4 * n_layers),
                                      gridspec_kw={"width_ratios": [2, 1]})
    image = heatmap(left, active, columns, [f"layer {i}" for i in range(n_layers)], cmap="Blues")
    fig.colorbar(image, ax=left, label=scale_label("share of tokens", *image.get_clim()))
    left.set_title("activation rate (w > 0)" if sparse else "share of tokens with w >= 0.5")
    left.set_xlabel("expert type")
    right.plot(spread, np.arange(n_layers), marker="o")
    right.set_yticks(range(n_layers))
    right.set_yticklabels([f"layer {i}" for i in range(n_layers)])
    right.invert_yaxis()
    right.set_xlabel("std of weights across expert types\n(mean over tokens)")
    right.grid(alpha=0.3)
    fig.suptitle(f"{method_title(type_data)} router statistics", y=1.06)
    return save(fig, path)


TRAIN_KEYS = ("c_train_loss", "train_loss", "loss")
X_KEYS = ("step", "iteration", "epoch")


def read_log(log_path):
    """JSON lines of a run's log.txt; lines that are not JSON objects are skipped."""
    rows = []
    with open(log_path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def plot_loss_curves(log_path, path):
    """Train and validation loss from a run's log.txt (x: step, else epoch, else line number)."""
    rows = read_log(log_path)
    x_key = next((k for k in X_KEYS if any(k in r for r in rows)), None)
    fig, ax = plt.subplots(figsize=(6, 4))
    plotted = False
    train_key = next((k for k in TRAIN_KEYS if any(k in r for r in rows)), None)
    for label, key in (("train", train_key), ("val", "val_loss")):
        points = [(r.get(x_key, i) if x_key else i, r.get(key)) for i, r in enumerate(rows)]
        points = [(x, y) for x, y in points if isinstance(y, (int, float)) and np.isfinite(y)]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if label == "val" else None, markersize=3, label=f"{label} loss")
            plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel(x_key or "log line")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(log_path))) or "loss")
    return save(fig, path)


def plot_all(out_dir, type_data=None, token_data=None, log_path=None, examples=(0, 1, 2), expert_data=None,
             max_tokens=160):
    """Every plot that has data; returns {name: (png path, (low, high) of its colour scale, or None)}."""
    jobs = [("expert_weight", plot_expert_weight, (expert_data,))] if expert_data is not None else []
    if type_data is not None:
        jobs += [("type_weight", plot_type_weight, (type_data,)), ("router_stats", plot_router_stats, (type_data,))]
    if token_data is not None:
        jobs.append(("token_weight", lambda d, p: plot_token_weight(d, p, examples, max_tokens), (token_data,)))
    if log_path and os.path.isfile(log_path):
        jobs.append(("loss_curves", plot_loss_curves, (log_path,)))
    written = {}
    for name, fn, inputs in jobs:
        path = os.path.join(out_dir, f"{name}.png")
        fig = fn(*inputs, path)
        if fig is not None:
            scales = [image.get_clim() for ax in fig.axes for image in ax.get_images()]  # one per figure
            written[name] = (path, scales[0] if scales else None)
            plt.close(fig)
    return written
