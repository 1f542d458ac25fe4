"""What data parallelism across machines costs: the adapters' gradients all-reduced each step, timed over TCP
between two hosts emulated on this machine (scripts/emulated_hosts.py), against the step's compute, and the
efficiency projected from them for the math recipe at 8B on 2, 8 and 32 nodes.

sudo python bench/multinode.py [--step_seconds_8b 28.4] [--repeats 5]

Each step's all-reduce is the optimizer's (jittor.optim.Optimizer.backward): one MPI all-reduce per gradient
tensor, each after the one before, after the backward (no overlap with compute). The shapes: the demo (the
shipped tiny base, the demo recipe's adapters) and the 8B shape's adapters under the math recipe (one layer of
LLaMA-3.1-8B's shape built, its adapters' tensors taken 32 times: every layer holds the same). The demo's step
compute is timed here (one rank, the demo recipe's batch); the 8B step's is --step_seconds_8b per 300-token row
(bf16, one rank, as bench/scale.py measures it; docs/performance.md). The projection models an all-reduce of
n tensors of S bytes in all over N nodes as n * 2 * log2(N) * latency + 2 (N-1)/N * S / bandwidth
(recursive doubling for the small tensors, a ring for the bytes), beside a step of ceil(32/N) rows per node.
Prints a table and key=value pairs last.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402,F401  (before any jittor import)
from common import CONFIGS, REPO, fail  # noqa: E402  (bench/common.py, beside this script)

LINKS = {"10 Gb/s": (10e9 / 8, 30e-6), "100 Gb/s": (100e9 / 8, 10e-6)}  # bytes/s, per-message latency (assumed)
NODES = (2, 8, 32)
MATH_ROWS, LAYERS_8B = 32, 32  # the math recipe's global batch (rows of 300 tokens); LLaMA-3.1-8B's depth


def recipe_model(recipe: str, shape: dict, batch: int = 1):
    """A random model of `shape` with `recipe`'s adapters."""
    from Models.LLaMA_Adapter import LLaMA_adapter
    from Models.ModelArgs import ModelArgs
    from Utils.settings import recipe_values, setting_fields
    fields = {f.name for f in setting_fields(ModelArgs)}
    settings = {k: v for k, v in recipe_values(recipe).items() if k in fields}
    return LLaMA_adapter(ModelArgs(**shape, **settings, max_batch_size=batch))


def demo_shape() -> dict:
    with open(os.path.join(REPO, "assets", "tiny-math-base", "params.json")) as f:
        return json.load(f)


def adapter_shapes(shape: str) -> list:
    """The shapes of the adapters' gradient tensors of one training step at `shape` ('demo' or '8b')."""
    if shape == "demo":
        return [tuple(p.shape) for p in recipe_model("demo", demo_shape()).adapter_parameters().values()]
    config = {**CONFIGS["8b"], "n_layers": 1, "vocab_size": 256}  # the vocabulary holds no adapter
    model = recipe_model("math", config)
    layer = [tuple(p.shape) for name, p in model.adapter_parameters().items() if ".layers.0." in name]
    rest = [tuple(p.shape) for name, p in model.adapter_parameters().items() if ".layers." not in name]
    return layer * LAYERS_8B + rest


def demo_step_seconds(repeats: int) -> float:
    """One training step of the demo on one rank (its recipe's batch of 16 rows, 192 tokens), median."""
    import numpy as np
    import jittor as jt
    from Models.kernels.adamw import build_optimizer
    from Utils.settings import recipe_values
    params, recipe = demo_shape(), recipe_values("demo")
    model = recipe_model("demo", params, recipe["batch_size"])
    model.train()
    optimizer = build_optimizer(model, 1e-3, 0.0)
    rng = np.random.default_rng(0)
    tokens = jt.array(rng.integers(0, params["vocab_size"], (recipe["batch_size"], recipe["max_seq_len"])))
    mask = jt.ones(tokens.shape)
    times = []
    for _ in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        loss, _ = model(tokens, mask, with_logits=False)
        optimizer.step(loss)
        jt.sync_all()
        times.append(time.perf_counter() - start)
    return statistics.median_high(times[1:])


def worker(repeats: int):
    """Under mpirun: time the all-reduces of each shape's gradients (and the network's latency and bandwidth);
    rank 0 prints one JSON line."""
    import jittor as jt

    def timed(grads) -> float:
        times = []
        for _ in range(repeats + 1):  # the first compiles each shape's op
            jt.sync_all()
            jt.array([0.0]).mpi_all_reduce("add").sync()  # start together
            start = time.perf_counter()
            reduced = [g.mpi_all_reduce("mean") for g in grads]
            for before, after in zip(reduced, reduced[1:]):
                after._add_dependency([before])  # one after another, as the optimizer chains them
            jt.sync(reduced)
            times.append(time.perf_counter() - start)
        return statistics.median_high(times[1:])

    report = {"ranks": jt.world_size}
    for shape in ("demo", "8b"):
        shapes = adapter_shapes(shape)
        grads = [jt.rand(s) for s in shapes]
        report[shape] = {"tensors": len(shapes), "bytes": 4 * sum(math.prod(s) for s in shapes),
                         "allreduce_s": timed(grads)}
    report["latency_s"] = timed([jt.rand(1) for _ in range(200)]) / 200
    big = 64 << 20
    report["bandwidth_Bps"] = 2 * (jt.world_size - 1) / jt.world_size * big / timed([jt.rand(big // 4)])
    if jt.rank == 0:
        print("RESULT " + json.dumps(report), flush=True)


def projection(report: dict, step_seconds_8b: float) -> list:
    """(nodes, link, efficiency, speedup) of the math recipe at 8B."""
    n, size = report["8b"]["tensors"], report["8b"]["bytes"]
    rows = []
    for link, (bandwidth, latency) in LINKS.items():
        for nodes in NODES:
            compute = math.ceil(MATH_ROWS / nodes) * step_seconds_8b
            allreduce = n * 2 * math.log2(nodes) * latency + 2 * (nodes - 1) / nodes * size / bandwidth
            one_node = MATH_ROWS * step_seconds_8b
            rows.append((nodes, link, compute / (compute + allreduce), one_node / (compute + allreduce)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step_seconds_8b", type=float, default=28.4,
                        help="one 300-token row's training step at the 8B shape, bf16, one rank (seconds; "
                             "docs/performance.md: bench/scale.py --arch llama31-8b)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions of each measure (median)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.repeats)
    from scripts import emulated_hosts
    why = emulated_hosts.usable()
    if why:
        fail(why)
    demo_step = demo_step_seconds(args.repeats)
    with emulated_hosts.Hosts(["node1", "node2"]) as hosts:
        # one OpenMP thread a rank: the emulated hosts share this machine's cores, where each rank would take them all
        command = ["mpirun", "-H", "node1:1,node2:1", "-np", "2", "--mca", "btl", "tcp,self",
                   "-x", "OMP_NUM_THREADS=1", sys.executable,
                   os.path.abspath(__file__), "--worker", "--repeats", str(args.repeats)]
        done = hosts.popen("node1", command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = done.communicate(timeout=1800)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        fail(f"the emulated hosts' run failed (exit {done.returncode}): {err.strip()[-500:]}")
    report = json.loads(lines[-1][len("RESULT "):])
    print(f"all-reduce over TCP between 2 emulated hosts (veth): latency {report['latency_s'] * 1e6:.0f} us a "
          f"message, bandwidth {report['bandwidth_Bps'] / 1e9:.2f} GB/s (ring bytes / time)")
    print(f"{'shape':6} {'tensors':>8} {'MB/step':>8} {'all-reduce s':>13} {'step s':>8} {'share':>7}")
    step = {"demo": demo_step, "8b": MATH_ROWS / 2 * args.step_seconds_8b}  # 2 ranks: 16 rows each
    for shape in ("demo", "8b"):
        r = report[shape]
        share = r["allreduce_s"] / (r["allreduce_s"] + step[shape])
        print(f"{shape:6} {r['tensors']:8d} {r['bytes'] / 1e6:8.1f} {r['allreduce_s']:13.4f} {step[shape]:8.2f} "
              f"{share:7.2%}")
    print(f"projection (math recipe, 8B, {MATH_ROWS} rows a step, {args.step_seconds_8b} s a row; assumed links: "
          + ", ".join(f"{k} with {v[1] * 1e6:.0f} us a message" for k, v in LINKS.items()) + ")")
    values = {"latency_us": report["latency_s"] * 1e6, "bandwidth_GBps": report["bandwidth_Bps"] / 1e9,
              "demo_step_s": demo_step}
    for shape in ("demo", "8b"):
        values.update({f"{shape}_{k}": v for k, v in report[shape].items()})
    for nodes, link, efficiency, speedup in projection(report, args.step_seconds_8b):
        print(f"  {nodes:2d} nodes, {link:8}: efficiency {efficiency:6.1%}, speedup {speedup:5.1f}x")
        values[f"projected_efficiency_{nodes}_{link.split()[0]}Gbps"] = round(efficiency, 4)
    for key, value in values.items():
        print(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}")


if __name__ == "__main__":
    main()
