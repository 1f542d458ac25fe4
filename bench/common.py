"""What the benchmarks of both sides share: the shapes, the timing schedule, the optimizer's
description and the one-line error. It imports neither Jittor nor torch, so bench.py (our venv),
peft_bench.py (the reference venv) and side_by_side.py (no framework) all read it.
"""
import sys

CONFIGS = {  # as ../shared/ref/ref_bench.py builds the authors' model
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64),
    "medium": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=8192, multiple_of=128),
}
TRAIN_BATCH, TRAIN_SEQ = 8, 256
WARMUP_STEPS, TIMED_STEPS = 2, 5  # training: the median of the timed steps
DECODE_BATCH, PROMPT_LEN, NEW_TOKENS = 4, 32, 64
DECODE_RUNS = 3  # decoding: the median of these, after one warm-up run
LR, WEIGHT_DECAY = 1e-4, 0.05  # Math.py's optimizer with ref_bench.py's decay


def describe_optimizer(name: str, groups) -> str:
    """One token naming what an optimizer updates and how: `groups` holds one
    (elements, lr, (beta1, beta2), eps, weight_decay) per parameter group; both sides print it
    and side_by_side.py compares the two."""
    return name + "".join(f":{n}@lr{lr:g},b{b1:g},{b2:g},eps{eps:g},wd{wd:g}"
                          for n, lr, (b1, b2), eps, wd in groups)


def fail(message: str):
    """The project's error contract for these scripts: one `error:` line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
