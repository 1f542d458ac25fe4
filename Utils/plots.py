"""Heatmaps of the router's decisions as PNG files (matplotlib, Agg; the loss curve: Utils/loss_curves.py; the
interactive page: Utils/router_report.py).

The pickles' structure, and how they are read: Utils/weight_pickles.py.

Functions take the loaded dicts, write a PNG and return the matplotlib Figure. A colour scale starts at 0 unless
the values all lie within 5% of the largest (after 30 steps a router's type weights may lie within 0.50-0.51, one
colour from 0), and the colour bar says its span and why. Cell text is black or white by the cell's luminance.
The per-token figures draw the first --plot_examples examples of each data set: Sparse MoA's Gamma, and for every
router the strongest expert type per token.
"""
import collections
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from Utils.loss_curves import plot_loss_curves, save  # noqa: E402
from Utils.weight_pickles import TYPE_ORDER  # noqa: E402



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


NARROW = 0.05  # values within 5% of the largest would be one colour on a scale from 0


Scale = collections.namedtuple("Scale", "low high why", defaults=(None,))  # why: why it does not start at 0


def colour_range(*tables) -> Scale:
    """The colour scale of the finite values of `tables`: from 0 (or the lowest value, when negative) to the
    largest; fitted to the values' span, saying why, when they all lie within NARROW of the largest (a router
    after a few dozen steps weighs every type 0.500-0.510), which a scale from 0 would draw as one colour."""
    values = np.concatenate([np.asarray(t, np.float64).ravel() for t in tables])
    values = values[np.isfinite(values)]
    if not values.size:
        return Scale(0.0, 1.0)
    low, high = float(values.min()), float(values.max())
    if high == low:  # one value: a scale around it
        return Scale(low - 0.5e-3, high + 0.5e-3, "one value")
    if low > 0 and high - low < NARROW * high:
        return Scale(low, high, f"fitted: all values within {high - low:.2g} of each other")
    return Scale(min(low, 0.0), high)


def scale_label(name: str, scale: Scale) -> str:
    low, high, why = scale
    return f"{name}\n(colour scale {low:.4g} to {high:.4g}" + (f";\n{why})" if why else ")")


def text_colour(rgba) -> str:
    """Black on a light cell, white on a dark one: the cell's relative luminance against 0.179, where the two
    contrast alike."""
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return "k" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.179 else "w"


def heatmap(ax, table, x_labels, y_labels, cmap="viridis", annotate=True, scale=None):
    """imshow of `table` (NaN blank), colours on `scale` (colour_range of the table when not given), the values
    written in the cells of a small table, as many decimals as the scale's span needs, black or white by the cell."""
    low, high, _ = scale or colour_range(table)
    image = ax.imshow(np.ma.masked_invalid(table), aspect="auto", cmap=cmap, vmin=low, vmax=high,
                      interpolation="nearest")
    ax.set_xticks(range(len(x_labels)))
    ax.set_xticklabels(x_labels, rotation=45, ha="right")
    ax.set_yticks(range(len(y_labels)))
    ax.set_yticklabels(y_labels)
    if annotate and table.size <= 400:
        digits = int(np.clip(1 - np.floor(np.log10(high - low)), 2, 4))
        for (i, j), value in np.ndenumerate(table):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.{digits}f}", ha="center", va="center", fontsize=7,
                        color=text_colour(image.cmap(image.norm(value))))
    return image


def plot_type_weight(type_data, path):
    """Layers x expert types: the mean type weight over every token of every example."""
    table = layer_by_type(type_data, lambda w: w.mean(0))
    if not np.isfinite(table).any():
        return None
    columns = type_columns(type_data)
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(columns), 1.5 + 0.4 * table.shape[0]))
    scale = colour_range(table)
    image = heatmap(ax, table, columns, [f"layer {i}" for i in range(table.shape[0])], scale=scale)
    fig.colorbar(image, ax=ax, label=scale_label("mean type weight", scale))
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
    scale = colour_range(table)
    image = heatmap(ax, table, [f"expert {e}" for e in range(n_experts)],
                    [f"layer {layer} {family}" for layer, family in rows], scale=scale)
    fig.colorbar(image, ax=ax, label=scale_label("mean expert weight", scale))
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


def chosen_examples(data, per_dataset: int) -> list:
    """Positions of the first `per_dataset` examples of each data set, in input order."""
    taken, chosen = {}, []
    for i, ex in enumerate(data["examples"]):
        if taken.get(ex["dataset"], 0) < per_dataset:
            taken[ex["dataset"]] = taken.get(ex["dataset"], 0) + 1
            chosen.append(i)
    return chosen


def token_panels(data, examples, max_tokens, cell, cmap, scale, bar_label, ticks=None):
    """Tokens x layers, one panel per example of `examples` that has values, a row of panels per data set:
    cell(layer, its weights of the tokens drawn) is a layer's column (NaN where it has none), the prompt's end and
    the answer drawn (token_window), a line between them; one colour scale for the panels. The figure, or None when
    no example has values."""
    n_layers = len(data["layer_types"])
    chosen = [data["examples"][i] for i in examples if i < len(data["examples"])
              and any(w is not None for w in data["examples"][i]["weights"])]
    if not chosen:
        return None
    windows = [token_window(ex["n_prompt"], len(ex["tokens"]), max_tokens) for ex in chosen]
    tables = [np.stack([np.full(stop - start, np.nan) if w is None else cell(layer, w[start:stop])
                        for layer, w in enumerate(ex["weights"])], axis=1) for ex, (start, stop) in zip(chosen, windows)]
    scale = scale or colour_range(*tables)
    datasets = list(dict.fromkeys(ex["dataset"] for ex in chosen))
    places = [(datasets.index(ex["dataset"]), sum(e["dataset"] == ex["dataset"] for e in chosen[:k]))
              for k, ex in enumerate(chosen)]
    n_columns = max(column for _, column in places) + 1
    height = (1.8 + 0.16 * max(len(t) for t in tables)) * len(datasets)
    fig, axes = plt.subplots(len(datasets), n_columns, squeeze=False, layout="constrained",
                             figsize=((2.4 + 0.45 * n_layers) * n_columns + 1.5, height))
    for ax in axes.ravel():
        ax.axis("off")  # but the panels drawn
    for (row, column), ex, (start, stop), table in zip(places, chosen, windows, tables):
        ax = axes[row, column]
        ax.axis("on")
        image = heatmap(ax, table, [f"L{i}" for i in range(n_layers)],
                        [token_label(t) for t in ex["tokens"][start:stop]], cmap=cmap, annotate=False, scale=scale)
        for tick in ax.get_yticklabels():
            tick.set_fontsize(6)
        if start < ex["n_prompt"] < stop:  # a line between the prompt and the answer
            ax.axhline(ex["n_prompt"] - start - 0.5, color="c", linewidth=1.0)
        ax.set_xlabel("layer")
        shown = "" if (start, stop) == (0, len(ex["tokens"])) else f"\ntokens {start}-{stop - 1} of {len(ex['tokens'])}"
        ax.set_title(f"{ex['dataset']} #{ex['index']}\n{ex['n_prompt']} prompt tokens{shown}", fontsize=8)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=min(1.0, 6.0 / height), label=bar_label(scale))
    if ticks:
        bar.set_ticks(range(len(ticks)), labels=ticks)
    return fig


def plot_token_weight(token_data, path, examples=(0,), max_tokens=160):
    """Tokens x layers of Sparse MoA's threshold Gamma for the examples at positions `examples`."""
    fig = token_panels(token_data, examples, max_tokens, lambda _, w: w[:, 0], "magma", None,
                       lambda scale: scale_label("Gamma (token threshold)", scale))
    return None if fig is None else save(fig, path)  # Soft MoA or no experts: there is no Gamma


def plot_token_types(type_data, path, examples=(0,), max_tokens=160):
    """Tokens x layers: the expert type each token weighs most (every router's, Soft MoA's too)."""
    columns = type_columns(type_data)

    def strongest(layer, w):
        names = type_data["layer_types"][layer]
        return np.array([columns.index(names[j]) for j in np.argmax(w, 1)], np.float64)
    cmap = matplotlib.colors.ListedColormap(plt.get_cmap("tab10").colors[:len(columns)])
    fig = token_panels(type_data, examples, max_tokens, strongest, cmap, Scale(-0.5, len(columns) - 0.5),
                       lambda _: "the expert type of the largest weight", ticks=columns)
    if fig is not None:
        fig.suptitle(f"{method_title(type_data)}: the strongest expert type per token")
    return None if fig is None or not columns else save(fig, path)


def activation_table(type_data) -> tuple:
    """(layers x types share of tokens whose type is active, the rule): Sparse MoA's w > 0 (selected), another
    router's w >= 0.5 (it never weighs a type 0)."""
    if method_title(type_data) == "sparse MoA":
        return layer_by_type(type_data, lambda w: (w > 0).mean(0)), "w > 0"
    return layer_by_type(type_data, lambda w: (w >= 0.5).mean(0)), "w >= 0.5"


def plot_router_stats(type_data, path):
    """Per layer: how often each expert type is active, and the spread of weights across types."""
    active, rule = activation_table(type_data)
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
    scale = Scale(0.0, 1.0)  # a share: its whole range
    image = heatmap(left, active, columns, [f"layer {i}" for i in range(n_layers)], cmap="Blues", scale=scale)
    fig.colorbar(image, ax=left, label=scale_label("share of tokens", scale))
    left.set_title(f"activation rate (share of tokens with {rule})")
    left.set_xlabel("expert type")
    right.plot(spread, np.arange(n_layers), marker="o")
    right.set_yticks(range(n_layers))
    right.set_yticklabels([f"layer {i}" for i in range(n_layers)])
    right.invert_yaxis()
    right.set_xlabel("std of weights across expert types\n(mean over tokens)")
    right.grid(alpha=0.3)
    fig.suptitle(f"{method_title(type_data)} router statistics", y=1.06)
    return save(fig, path)


def plot_all(out_dir, type_data=None, token_data=None, log_path=None, per_dataset=3, expert_data=None,
             max_tokens=160):
    """Every plot that has data, the per-token ones of the first `per_dataset` examples of each data set; returns
    {name: (png path, (low, high) of its colour scale, or None)}."""
    jobs = [("expert_weight", plot_expert_weight, (expert_data,))] if expert_data is not None else []
    if type_data is not None:
        examples = chosen_examples(type_data, per_dataset)
        jobs += [("type_weight", plot_type_weight, (type_data,)), ("router_stats", plot_router_stats, (type_data,)),
                 ("token_types", lambda d, p: plot_token_types(d, p, examples, max_tokens), (type_data,))]
    if token_data is not None:
        examples = chosen_examples(token_data, per_dataset)
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
