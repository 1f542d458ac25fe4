"""A training run's loss curves from its log.txt, as a PNG (matplotlib, Agg), and the one way figures are saved.

log.txt holds a JSON line every --log_interval steps; each train line carries `step_losses`, the loss of every
step since the line before it (the line's own step last), so the curve has every step however sparse the lines
are. Logs written before that field existed give one point per line.
"""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from Utils.file_io import atomic_write  # noqa: E402

TRAIN_KEYS = ("c_train_loss", "train_loss", "loss")
X_KEYS = ("step", "iteration", "epoch")


def save(fig, path):
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
    return fig


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


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def train_points(rows) -> list:
    """[(step, train loss)] of every step the log holds: a line's step_losses end at its step; a line without
    them (or without a step) is one point (x: its step, else epoch, else line number)."""
    x_key = next((k for k in X_KEYS if any(k in r for r in rows)), None)
    key = next((k for k in TRAIN_KEYS if any(k in r for r in rows)), None)
    points = {}
    for i, r in enumerate(rows):
        losses = r.get("step_losses")
        if number(r.get("step")) and isinstance(losses, list):
            points.update((r["step"] - len(losses) + 1 + k, y) for k, y in enumerate(losses) if number(y))
        elif key is not None and number(r.get(key)):
            points[r.get(x_key, i) if x_key else i] = r[key]
    return sorted(points.items())


def plot_loss_curves(log_path, path):
    """Train loss at every step the log holds (train_points) and validation loss from a run's log.txt."""
    rows = read_log(log_path)
    x_key = next((k for k in X_KEYS if any(k in r for r in rows)), None)
    val = [(r.get(x_key, i) if x_key else i, r["val_loss"]) for i, r in enumerate(rows) if number(r.get("val_loss"))]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in (("train", train_points(rows)), ("val", val)):
        if points:
            ax.plot(*zip(*points), marker="o" if label == "val" or len(points) < 20 else None, markersize=3,
                    label=f"{label} loss ({len(points)} point{'' if len(points) == 1 else 's'})")
    if not ax.lines:
        plt.close(fig)
        return None
    ax.set_xlabel(x_key or "log line")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(log_path))) or "loss")
    return save(fig, path)
