"""The soak of the fused kernels against their plain references: `python tests/kernel_soak.py --cases 5000`.

Cases round-robin over the builders of tests/kernel_cases.py and their value kinds, each with a seed of its
own, the denormal modes alternating (tests/test_kernel_pairs.py's rule); prints the count and the worst
forward and gradient error of each kernel over its tolerance, and every failing case; exit 1 on a failure.
Most of a first run is Jittor compiling its own ops for each new shape (about a second a case).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import Utils.jittor_env  # noqa: F401,E402  (must precede the jittor import)
import numpy as np  # noqa: E402

import kernel_cases  # noqa: E402
from kernel_inputs import VALUES, denormal_mode  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5000, help="how many cases in all")
    parser.add_argument("--seed", type=int, default=1, help="the soak's seed (each case's is drawn from it)")
    args = parser.parse_args()
    worst, failures, start = {}, [], time.time()
    builders, kinds = kernel_cases.BUILDERS, VALUES
    for i in range(args.cases):
        builder, kind, flush = builders[i % len(builders)], kinds[(i // len(builders)) % len(kinds)], i % 2 == 1
        with denormal_mode(flush) as set_again:
            case = builder(np.random.default_rng([args.seed, i]), kind)
            if not flush:  # compiled first, which flushes in the compiling thread
                kernel_cases.run(case, seed=i)
                set_again()
            forward, backward = kernel_cases.run(case, seed=i)
        over = kernel_cases.over_tolerance(case, forward, backward)
        count, top, where = worst.get(case.name, (0, 0.0, ""))
        worst[case.name] = (count + 1, max(top, over), where if top >= over else f"{kind} {case.describe}")
        if over > 1:
            failures.append(f"case {i}: {case.name} {kind} {'flushed' if flush else 'denormals'} {case.describe}: "
                            f"forward {forward}, gradients {backward}")
            print(failures[-1], flush=True)
        if (i + 1) % 250 == 0:
            print(f"{i + 1} cases, {len(failures)} failed, {time.time() - start:.0f} s", flush=True)
    print(f"\n{args.cases} cases (seed {args.seed}), {len(failures)} failed, {time.time() - start:.0f} s")
    print(f"{'kernel':20} {'cases':>6}  worst error / tolerance  (its case)")
    for name, (count, top, where) in sorted(worst.items()):
        print(f"{name:20} {count:6}  {top:.3g}  ({where})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
