"""Answer extraction and accuracy, by the LLM-Adapters / MoA authors' rules.

Numeric sets: drop commas, take the LAST number matching `-?\\d+\\.?\\d*`,
correct when within 1e-3 of the label; no number is wrong.
AQuA: the FIRST capital letter A-E anywhere in the stripped generation (so a
leading "And" already answers "A": that is the authors' rule, kept for parity).
Commonsense sets: the FIRST match of the set's keywords (boolq: true|false, piqa:
solution1|solution2, hellaswag: ending1..4, winogrande: option1|option2, the
others answer1..5), case-sensitive and with no word boundary as the authors
match (so "untrue" answers "true" and "True" answers nothing); correct when it
equals the label exactly.
"""
import re

NUMERIC_SETS = ("addsub", "multiarith", "singleeq", "gsm8k", "svamp", "mawps", "synthetic")
CHOICE_SETS = ("aqua",)
# The authors' keyword per commonsense set, as a regex alternation in their order.
KEYWORD_SETS = {
    "boolq": re.compile(r"true|false"),
    "piqa": re.compile(r"solution1|solution2"),
    "social_i_qa": re.compile(r"answer1|answer2|answer3|answer4|answer5"),
    "arc-challenge": re.compile(r"answer1|answer2|answer3|answer4|answer5"),
    "arc-easy": re.compile(r"answer1|answer2|answer3|answer4|answer5"),
    "openbookqa": re.compile(r"answer1|answer2|answer3|answer4|answer5"),
    "hellaswag": re.compile(r"ending1|ending2|ending3|ending4"),
    "winogrande": re.compile(r"option1|option2"),
}
NUMBER = re.compile(r"-?\d+\.?\d*")
CHOICE = re.compile(r"[A-E]")
TOLERANCE = 1e-3
KNOWN = ("AddSub", "MultiArith", "SingleEq", "gsm8k", "SVAMP", "mawps", "synthetic", "AQuA", "boolq", "piqa",
         "social_i_qa", "hellaswag", "winogrande", "ARC-Challenge", "ARC-Easy", "openbookqa")


def answer_kind(dataset_name):
    """How a data set (name matched case-insensitively) is scored: "number", "choice" or "keyword"."""
    name = dataset_name.lower()
    if name in NUMERIC_SETS:
        return "number"
    if name in CHOICE_SETS:
        return "choice"
    if name in KEYWORD_SETS:
        return "keyword"
    raise ValueError(f"unknown data set '{dataset_name}' for answer extraction; known: {', '.join(KNOWN)}")


def scoring_rule(dataset_name, labels, source=None):
    """The data set whose rule scores `dataset_name`: itself when known; for another name,
    "aqua" when every label is a letter A-E, "synthetic" when every label is a number.
    Anything else is an error naming the set, to be raised before any generation."""
    try:
        answer_kind(dataset_name)
        return dataset_name
    except ValueError:
        pass
    labels = [str(label).strip() for label in labels]
    if labels and all(CHOICE.fullmatch(label) for label in labels):
        return "aqua"
    if labels and all(NUMBER.fullmatch(label.replace(",", "")) for label in labels):
        return "synthetic"
    where = f" ({source})" if source else ""
    raise ValueError(f"data set '{dataset_name}'{where}: no scoring rule: its name is none of {', '.join(KNOWN)} "
                     "and its answers are neither all numbers nor all letters A-E; name its folder or file "
                     "after the data set it is")


LABEL_FORMS = {"number": "a number such as 12, -2.5 or 1,234", "choice": "one letter A-E"}


def checked_labels(rule, labels, source, name):
    """The labels of data set `name` (file `source`) in the form `rule` compares them in, checked before any
    generation. Known variants of the authors' data are normalised: thousands separators in numbers
    ("1,234"), lower-case letters for AQuA ("b"), keywords in another case (boolq's JSON booleans load as
    "True"/"False"); any other label is an error naming the file and the example."""
    kind = answer_kind(rule)
    keywords = KEYWORD_SETS[rule.lower()].pattern.split("|") if kind == "keyword" else ()
    checked = []
    for i, label in enumerate(labels):
        text = str(label).strip()
        if kind == "number":
            fixed = text.replace(",", "")
            ok = NUMBER.fullmatch(fixed) is not None
        elif kind == "choice":
            fixed = text.upper()
            ok = CHOICE.fullmatch(fixed) is not None
        else:
            fixed = next((k for k in keywords if k.lower() == text.lower()), text)
            ok = fixed in keywords
        if not ok:
            form = LABEL_FORMS.get(kind) or "one of " + ", ".join(keywords)
            raise ValueError(f"{source}: example {i} of data set '{name}' has the label {label!r}, which its scoring "
                             f"rule ({rule}) cannot match: expected {form}")
        checked.append(fixed)
    return checked


def extract_answer(dataset_name, text):
    """The predicted answer: a float, a letter, a keyword, or None when there is none."""
    kind = answer_kind(dataset_name)
    if kind == "keyword":
        found = KEYWORD_SETS[dataset_name.lower()].search(text.strip())
        return found.group(0) if found else None
    if kind == "choice":
        letters = CHOICE.findall(text.strip())
        return letters[0] if letters else None
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def is_correct(dataset_name, text, label):
    prediction = extract_answer(dataset_name, text)
    if prediction is None:
        return False
    kind = answer_kind(dataset_name)
    if kind == "keyword":
        return prediction == str(label)  # exact, as the authors compare
    if kind == "choice":
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
