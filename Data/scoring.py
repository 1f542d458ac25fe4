"""Answer extraction and accuracy, by the LLM-Adapters / MoA authors' rules.

Numeric sets: drop commas, take the LAST number matching `-?\\d+\\.?\\d*`,
correct when within 1e-3 of the label; no number is wrong.
AQuA: the FIRST capital letter A-E anywhere in the stripped generation (so a
leading "And" already answers "A": that is the authors' rule, kept for parity).
"""
import re

NUMERIC_SETS = ("addsub", "multiarith", "singleeq", "gsm8k", "svamp", "mawps", "synthetic")
CHOICE_SETS = ("aqua",)
NUMBER = re.compile(r"-?\d+\.?\d*")
CHOICE = re.compile(r"[A-E]")
TOLERANCE = 1e-3


def answer_kind(dataset_name):
    """Whether a data set (name matched case-insensitively) is scored by "number" or "choice"."""
    name = dataset_name.lower()
    if name in NUMERIC_SETS:
        return "number"
    if name in CHOICE_SETS:
        return "choice"
    known = ", ".join(("AddSub", "MultiArith", "SingleEq", "gsm8k", "SVAMP", "mawps", "synthetic", "AQuA"))
    raise ValueError(f"unknown data set '{dataset_name}' for answer extraction; known: {known}")


def extract_answer(dataset_name, text):
    """The predicted answer: a float, a letter, or None when there is none."""
    if answer_kind(dataset_name) == "choice":
        letters = CHOICE.findall(text.strip())
        return letters[0] if letters else None
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def is_correct(dataset_name, text, label):
    prediction = extract_answer(dataset_name, text)
    if prediction is None:
        return False
    if answer_kind(dataset_name) == "choice":
        return prediction == str(label).strip()
    return abs(prediction - float(label)) <= TOLERANCE


def score(dataset_name, generations, labels):
    """Accuracy in [0, 1] of generations against labels."""
    if len(generations) != len(labels):
        raise ValueError(f"{len(generations)} generations but {len(labels)} labels")
    if not generations:
        raise ValueError("nothing to score: no generations")
    correct = sum(is_correct(dataset_name, text, label) for text, label in zip(generations, labels))
    return correct / len(generations)
