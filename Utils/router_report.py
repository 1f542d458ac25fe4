"""The router report: one self-contained HTML page (no server, no network; opens from disk) of what the router
chose, for one run (Infer.py --save_weights writes router_report.html) or several side by side
(scripts/compare_routers.py).

The page is Utils/router_report.html, a template of plain SVG and vanilla JS; the numbers go into it as one JSON
document (report_data). Token texts are user data: they travel inside that JSON, with <, > and & escaped, and the
page's script only ever sets them as text (textContent), never as HTML, so no prompt can inject markup or script.

Per run: the mean type weight per layer and expert type, the activation rate (Sparse MoA: w > 0; otherwise the
share of tokens with w >= 0.5), and per data set a few examples whose prompt and answer tokens are coloured by the
router at the layer chosen (Sparse MoA: Gamma, or the number of active experts; every router: the strongest expert
type), each with its answer's correctness from <set>_predictions.jsonl. Every quantity has ONE colour scale shared by
all runs and layers, starting at 0.
"""
import collections
import json
import os

import numpy as np

from Utils import plots
from Utils.file_io import atomic_write
from Utils.weight_pickles import family_order

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "router_report.html")
REPORT = "router_report.html"


def rounded(values, digits=4):
    """A numpy array as nested lists of floats rounded to `digits`, NaN as None (JSON null)."""
    array = np.round(np.asarray(values, np.float64), digits)
    return np.where(np.isfinite(array), array, None).tolist()


def read_predictions(folder: str) -> dict:
    """{(data set, index): prediction row} from the <set>_predictions.jsonl files Infer.py wrote into `folder`."""
    rows = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith("_predictions.jsonl"):
            path = os.path.join(folder, name)
            with open(path) as f:
                for n, line in enumerate(f, 1):
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{path}: line {n} is not JSON ({e})") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}: line {n} is not a JSON object (a prediction row)")
                    rows[(name[:-len("_predictions.jsonl")], row.get("index"))] = row
    return rows


def example_view(type_ex, token_ex, layer_columns, predictions, sparse: bool) -> dict:
    """One example's tokens and, per layer, the router's choices for each token (None for a layer without
    experts): the type weights (columns of that layer), the strongest type (its column in the run's columns), the
    number of active experts and Gamma (Sparse MoA)."""
    row = predictions.get((type_ex["dataset"], type_ex["index"]), {})
    layers = []
    for layer, w in enumerate(type_ex["weights"]):
        if w is None or not layer_columns[layer]:
            layers.append(None)
            continue
        gamma = token_ex["weights"][layer] if token_ex is not None else None
        layers.append({"w": rounded(w, 3), "top": [layer_columns[layer][j] for j in np.argmax(w, 1)],
                       "active": (w > 0).sum(1).tolist() if sparse else None,
                       "gamma": None if gamma is None else rounded(gamma[:, 0])})
    return {"dataset": type_ex["dataset"], "index": type_ex["index"], "tokens": type_ex["tokens"],
            "n_prompt": type_ex["n_prompt"], "correct": row.get("correct"), "answer": row.get("answer"),
            "prediction": row.get("prediction"), "layers": layers}


def run_view(type_data, token_data=None, predictions=None, label="", per_dataset=3) -> dict:
    """One run's part of the report: its tables and its examples (the first `per_dataset` of each data set)."""
    sparse = plots.method_title(type_data) == "sparse MoA"
    columns = plots.type_columns(type_data)
    active, rule = plots.activation_table(type_data)
    layer_columns = [[columns.index(t) for t in names] for names in type_data["layer_types"]]
    examples = [example_view(type_data["examples"][i], token_data["examples"][i] if token_data else None,
                             layer_columns, predictions or {}, sparse) for i in plots.chosen_examples(type_data, per_dataset)]
    return {"label": label, "method": plots.method_title(type_data), "sparse": sparse, "columns": columns,
            "layer_columns": layer_columns, "mean": rounded(plots.layer_by_type(type_data, lambda w: w.mean(0))),
            "active": rounded(active), "active_rule": rule, "examples": examples}


def largest(values) -> float:
    """The largest finite number in nested lists (None skipped); 0 when there is none."""
    if isinstance(values, list):
        return max([largest(v) for v in values], default=0.0)
    return 0.0 if values is None else float(values)


def shared_scales(runs: list) -> dict:
    """One colour scale per quantity for every run and layer, each from 0 to the largest value drawn."""
    gammas = [layer["gamma"] for run in runs for ex in run["examples"] for layer in ex["layers"]
              if layer is not None and layer["gamma"] is not None]
    return {"mean": [0.0, largest([run["mean"] for run in runs]) or 1.0], "active_rate": [0.0, 1.0],
            "gamma": [0.0, max([largest(g) for g in gammas] or [0.0]) or 1.0],
            "active": [0, max(len(c) for run in runs for c in run["layer_columns"])]}


def report_data(runs: list, title: str, notes=(), correlations=None) -> dict:
    """The JSON document the page draws: runs (run_view), shared scales, notes, correlations (compare_routers)."""
    columns = sorted({c for run in runs for c in run["columns"]}, key=family_order)  # one colour per type
    return {"title": title, "notes": list(notes), "runs": runs, "scales": shared_scales(runs),
            "type_colours": columns, "correlations": correlations}


def page(data: dict) -> str:
    """The HTML page with `data` embedded; <, > and & are escaped inside the JSON so that no text ends the script."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    return template.replace("__REPORT_DATA__", text)


def write_evaluation_report(folder: str, type_data, token_data, per_dataset: int, adapter: str) -> str:
    """Infer.py's router_report.html in its evaluation folder, beside the predictions it reads."""
    run = run_view(type_data, token_data, read_predictions(folder), per_dataset=per_dataset)
    counts = collections.Counter(ex["dataset"] for ex in type_data["examples"])
    return write_report(os.path.join(folder, REPORT), report_data([run], f"Router report: {adapter}", [
        "tables: over every token of " + ", ".join(f"{n} {name} examples" for name, n in counts.items()),
        f"tokens: the first {per_dataset} examples of each data set (Infer.py --plot_examples)"]))


def write_report(path: str, data: dict) -> str:
    html = page(data)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(html)
    return atomic_write(path, write)
