"""Seeded synthetic math word problems in the LLM-Adapters schema.

Three families, echoing the math test sets, with small non-negative integers
so that a tiny model can learn them:
- AddSub-like: one addition or subtraction;
- SingleEq-like: one equation, a * b or a + b - c;
- MultiArith-like: two operations, (a + b) * c, a * b - c or (a + b) / c.
Each output is a short chain of thought ending "The answer is N." and the
answer field is "N".

    python -m Data.synthetic --out data/synthetic --n_train 2000 --n_val 200 --n_test 200
"""
import argparse
import json
import os
import random

NAMES = ["Tom", "Mary", "Sam", "Lena", "Omar", "Priya", "Jack", "Mei", "Carlos", "Nina",
         "Ben", "Aisha", "Leo", "Sara", "Ivan", "Zoe", "Raj", "Emma", "Kofi", "Lucy"]
OBJECTS = ["apples", "marbles", "books", "pencils", "stickers", "cookies", "balloons", "shells",
           "cards", "toy cars", "oranges", "stamps", "flowers", "crayons", "coins", "buttons"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"),
              ("packet", "packets"), ("tray", "trays")]
GAIN_VERBS = ["bought", "found", "picked", "got", "won", "made"]
LOSS_VERBS = ["gave away", "lost", "sold", "ate", "used", "gave"]


def answer_text(steps, n):
    return "\nA: " + " ".join(steps) + f" The answer is {n}."


def add_sub(rng):
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a = rng.randint(1, 20)
    if rng.random() < 0.5:
        b, past = rng.randint(1, 20), rng.choice(GAIN_VERBS)
        n = a + b
        question = f"{name} had {a} {obj}. Then {name} {past} {b} more {obj}. How many {obj} does {name} have now?"
        steps = [f"{name} had {a} {obj} and {past} {b} more, so {name} has {a} + {b} = {n} {obj}."]
    else:
        b, verb = rng.randint(0, a), rng.choice(LOSS_VERBS)
        n = a - b
        question = f"{name} had {a} {obj} and {verb} {b} of them. How many {obj} does {name} have left?"
        steps = [f"{name} had {a} {obj} and {verb} {b}, so {a} - {b} = {n} {obj} are left."]
    return question, steps, n


def single_eq(rng):
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    if rng.random() < 0.5:
        (one, many), a, b = rng.choice(CONTAINERS), rng.randint(2, 9), rng.randint(2, 9)
        n = a * b
        question = f"{name} has {b} {many} with {a} {obj} in each {one}. How many {obj} does {name} have in all?"
        steps = [f"There are {b} {many} of {a} {obj}, so {name} has {a} * {b} = {n} {obj}."]
    else:
        a, b = rng.randint(1, 15), rng.randint(1, 15)
        c, past, verb = rng.randint(0, a + b), rng.choice(GAIN_VERBS), rng.choice(LOSS_VERBS)
        n = a + b - c
        question = (f"{name} had {a} {obj}, {past} {b} more and then {verb} {c}. "
                    f"How many {obj} does {name} have now?")
        steps = [f"{name} has {a} + {b} - {c} = {n} {obj}."]
    return question, steps, n


def multi_arith(rng):
    name, friend = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 6)
        total, n = a + b, (a + b) * c
        question = (f"{name} has {a} friends and {friend} has {b} friends. Each of their friends gets {c} {obj}. "
                    f"How many {obj} do they need?")
        steps = [f"Together they have {a} + {b} = {total} friends.", f"Each gets {c} {obj}, so {total} * {c} = {n}."]
    elif kind == 1:
        (one, many), a, b = rng.choice(CONTAINERS), rng.randint(2, 9), rng.randint(2, 9)
        total = a * b
        c, verb = rng.randint(0, total), rng.choice(LOSS_VERBS)
        n = total - c
        question = (f"{name} bought {a} {many} of {obj} with {b} {obj} in each {one}. "
                    f"{name} {verb} {c} {obj}. How many {obj} does {name} have left?")
        steps = [f"{name} bought {a} * {b} = {total} {obj}.", f"After that, {total} - {c} = {n} {obj} are left."]
    else:
        c, n = rng.randint(2, 6), rng.randint(1, 8)
        total = c * n
        a = rng.randint(0, total)
        b = total - a
        question = (f"{name} picked {a} {obj} and {friend} picked {b} {obj}. They shared them equally "
                    f"among {c} friends. How many {obj} did each friend get?")
        steps = [f"They picked {a} + {b} = {total} {obj}.", f"Shared among {c} friends, each gets {total} / {c} = {n}."]
    return question, steps, n


FAMILIES = (add_sub, single_eq, multi_arith)


def make_example(rng):
    question, steps, n = rng.choice(FAMILIES)(rng)
    return {"instruction": question, "input": "", "output": answer_text(steps, n), "answer": str(n)}


def make_splits(n_train, n_val, n_test, seed=0):
    """(train, val, test) lists of examples, no instruction text shared between them."""
    rng, seen = random.Random(seed), set()
    splits = []
    for size in (n_train, n_val, n_test):
        split, tries = [], 0
        while len(split) < size:
            tries += 1
            if tries > 100 * size + 1000:
                raise RuntimeError(f"could not draw {size} distinct problems; ask for fewer")
            example = make_example(rng)
            if example["instruction"] not in seen:
                seen.add(example["instruction"])
                split.append(example)
        splits.append(split)
    return tuple(splits)


def main():
    parser = argparse.ArgumentParser(description="Write a synthetic math word-problem data set.")
    parser.add_argument("--out", required=True, help="output folder for train.json, val.json, test.json")
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_val", type=int, default=200)
    parser.add_argument("--n_test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split_name, examples in zip(("train", "val", "test"), make_splits(args.n_train, args.n_val, args.n_test, args.seed)):
        path = os.path.join(args.out, f"{split_name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(examples, f, indent=2)
        print(f"wrote {len(examples)} examples to {path}")


if __name__ == "__main__":
    main()
