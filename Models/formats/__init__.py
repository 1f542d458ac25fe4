"""The checkpoint and adapter file formats, each read and written in one module of this package.

Every format refuses a bad file with the one error below, whose message names the file (and the
tensor or field where there is one); the entry points print it as one line.
"""


class CheckpointError(ValueError):
    """A checkpoint that is malformed, unsupported or unsafe; the message names the file."""
