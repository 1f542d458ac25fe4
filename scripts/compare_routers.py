"""Several runs' routers side by side, with how alike they are.

    python Infer.py --adapter_path out/s0/adapter --save_weights     # each run: out/s0/eval/
    python scripts/compare_routers.py out/s0/eval out/s125/eval out/s1225/eval --output_dir out/seeds

Writes router_report.html (the router report of Utils/router_report.py for the runs side by side, one colour
scale per quantity for all of them; opens from disk), router_comparison.png (each run's mean type weights,
Sparse MoA's per-token Gamma on one example, the training loss at every logged step, the runs' correlation
matrix; one colour scale per quantity) and similarity.json. The headline correlation is within layers (each
layer's mean taken away), beside the rank (Spearman) one and the overall one, whose offsets between layers make
runs that rank the types of a layer differently correlate highly (Utils/router_comparison.py). Runs are labelled
by every setting that differs between them (their args.json, adapter_params.json, scores.json).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.weight_pickles import NonFiniteWeights  # noqa: E402
from Utils.router_comparison import MEASURES, compare  # noqa: E402
from Utils.router_report import REPORT  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402


def example_index(text: str) -> int:
    """--example: an example's position in the runs' pickles, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an example's position (0 or more), got {text!r}")
    return int(text)


def main(argv=None):
    p = ArgumentParser(prog="python scripts/compare_routers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="Infer.py --save_weights output folders, one per run")
    p.add_argument("--output_dir", required=True, help="where router_comparison.png and similarity.json go")
    p.add_argument("--labels", help="comma list of run labels (default: every setting that differs between the "
                   "runs: router, precision, epochs, seed, ...)")
    p.add_argument("--example", type=example_index, default=0, help="the example whose per-token Gamma is drawn")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.folders):
        p.error(f"--labels names {len(labels)} runs, {len(args.folders)} folders given")
    try:
        report = compare(args.folders, args.output_dir, labels, args.example)
    except NonFiniteWeights as e:
        p.exit(3, f"error: {e}\n")
    except (OSError, ValueError) as e:
        p.exit(2, f"error: {e}\n")
    for key, name in MEASURES.items():  # the headline first: within layers
        matrix, undefined = report[key], report["undefined"][key]
        pairs = [f"{report['runs'][i]['label']} ~ {report['runs'][j]['label']}: "
                 + (f"undefined ({undefined[f'{i}-{j}']})" if f"{i}-{j}" in undefined else f"{matrix[i][j]:.3f}")
                 for i in range(len(matrix)) for j in range(i + 1, len(matrix))]
        print(f"[compare_routers] correlation of {name}: " + ("; ".join(pairs) or "one run"))
    print(f"[compare_routers] wrote {args.output_dir}/router_comparison.png, similarity.json, {REPORT}")

if __name__ == "__main__":
    main()
