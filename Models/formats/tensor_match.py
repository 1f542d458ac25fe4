"""A file's tensors matched against the model's parameters, by name and shape: every format (Meta's, Hugging
Face's, adapters, peft exports) refuses a missing, unexpected or mis-shaped tensor with the same message."""
from ..kernels.precision import matrix_shape
from . import CheckpointError

IGNORED_META_KEYS = ("rope.freqs",)  # in Meta's files, recomputed here


def check_strict(params: dict, shapes: dict, source: str, what: str):
    """A missing, unexpected or mis-shaped tensor (name -> shape in `shapes`) is an error naming `source`."""
    missing = sorted(set(params) - set(shapes))
    unexpected = sorted(set(shapes) - set(params) - set(IGNORED_META_KEYS))
    problems = []
    if missing:
        problems.append(f"missing {what} tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    misshaped = [f"'{name}' has shape {list(shapes[name])}, the model expects {list(matrix_shape(params[name]))}"
                 for name in sorted(set(params) & set(shapes))
                 if tuple(shapes[name]) != matrix_shape(params[name])]
    problems += misshaped[:4] + ([f"... and {len(misshaped) - 4} more mis-shaped"] if len(misshaped) > 4 else [])
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
