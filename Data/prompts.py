"""The Alpaca prompt templates used by LLM-Adapters and MoA (spec section 5).

The output field of the math data starts with a newline ("\\nA: ..."), so the
training text is simply prompt + output, with nothing in between.
"""

PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)


def format_prompt(example):
    """The prompt for one example (a dict with "instruction" and optionally "input")."""
    if example.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=example["instruction"], input=example["input"])
    return PROMPT_NO_INPUT.format(instruction=example["instruction"])
