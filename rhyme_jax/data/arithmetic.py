"""Synthetic single-step arithmetic word problems for demos with small models.

"Tom has 7 apples and buys 5 more. How many apples does he have now?" One operation (+, - or
x), small numbers, plain English. A 135M-parameter instruct model solves a fraction of these
(reward visibly rises under RL), unlike GSM8K. Generation is deterministic given the seed:
Python's `random.Random(int)` sequence is stable across platforms and versions.

Answers use the GSM8K convention ('... = 12\\n#### 12') so GSM8K rewards apply as-is; the
exact integer is also kept in `meta['target']`.
"""

from __future__ import annotations

import random
from typing import Sequence

from rhyme_jax.data.example import Example

NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Lucy", "she"), ("Sam", "he"),
         ("Mia", "she"), ("Jack", "he"), ("Emma", "she"), ("Leo", "he"), ("Zoe", "she"))
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells",
         "cards", "balloons", "oranges", "toy cars")

# (operation, template). Fields: {name}, {pron} (he/she), {Pron}, {items}, {a}, {b}.
TEMPLATES = (
    ("+", "{name} has {a} {items}. {Pron} buys {b} more. How many {items} does {name} have "
          "now?"),
    ("+", "{name} had {a} {items} and found {b} more. How many {items} does {name} have?"),
    ("+", "There are {a} {items} in a box. {name} puts {b} more {items} in the box. How many "
          "{items} are in the box now?"),
    ("-", "{name} has {a} {items} and gives {b} of them to a friend. How many {items} does "
          "{name} have left?"),
    ("-", "{name} had {a} {items}. {Pron} lost {b} of them. How many {items} does {pron} have "
          "left?"),
    ("-", "There are {a} {items} on a table. {name} takes {b} of them away. How many {items} "
          "are on the table now?"),
    ("*", "{name} has {a} bags. Each bag holds {b} {items}. How many {items} does {name} have "
          "in total?"),
    ("*", "{name} buys {a} boxes of {items}. There are {b} {items} in each box. How many "
          "{items} does {name} buy?"),
)
OPS = ("+", "-", "*")
_SPLIT_SEEDS = {"train": 0, "test": 1}


def make_problem(rng: random.Random, ops: Sequence[str] = OPS, max_add: int = 20,
                 max_mul: int = 6) -> tuple[str, str, int, dict]:
  """Draw one problem: (question, gsm8k-style answer text, integer target, parameters).

  '+': both operands in [2, max_add]; '-': a in [3, max_add], b in [1, a-1] (never negative);
  '*': both operands in [2, max_mul].
  """
  op = rng.choice(list(ops))
  template = rng.choice([t for o, t in TEMPLATES if o == op])
  name, pron = rng.choice(NAMES)
  items = rng.choice(ITEMS)
  if op == "+":
    a, b = rng.randint(2, max_add), rng.randint(2, max_add)
    target = a + b
  elif op == "-":
    a = rng.randint(3, max_add)
    b = rng.randint(1, a - 1)
    target = a - b
  else:
    a, b = rng.randint(2, max_mul), rng.randint(2, max_mul)
    target = a * b
  question = template.format(name=name, pron=pron, Pron=pron.capitalize(), items=items, a=a,
                             b=b)
  symbol = {"+": "+", "-": "-", "*": "x"}[op]
  answer = f"{a} {symbol} {b} = {target}\n#### {target}"
  return question, answer, target, {"op": op, "a": a, "b": b}


def generate_arithmetic(num_examples: int, seed: int = 0, *, ops: Sequence[str] = OPS,
                        max_add: int = 20, max_mul: int = 6,
                        exclude: frozenset[str] | set[str] = frozenset(),
                        uid_prefix: str = "arith") -> list[Example]:
  """`num_examples` distinct problems from `seed`, skipping questions in `exclude`."""
  bad = [o for o in ops if o not in OPS]
  if bad or not ops:
    raise ValueError(f"arithmetic: ops must be a non-empty subset of {OPS}, got {list(ops)}")
  if num_examples <= 0:
    raise ValueError(f"arithmetic: num_examples must be > 0, got {num_examples}")
  if max_add < 3 or max_mul < 2:
    raise ValueError(f"arithmetic: need max_add >= 3 and max_mul >= 2, got {max_add}, "
                     f"{max_mul}")
  rng = random.Random(seed)
  seen = set(exclude)
  examples = []
  repeats = 0  # draws in a row that found nothing new: near the end of the problem space
  for _ in range(num_examples * 200):
    question, answer, target, params = make_problem(rng, ops, max_add, max_mul)
    if question in seen:
      repeats += 1
      if repeats > 20_000:
        break
      continue
    repeats = 0
    seen.add(question)
    uid = f"{uid_prefix}-{seed}-{len(examples)}"
    examples.append(Example(uid=uid, question=question, answer=answer,
                            meta={"target": target, "seed": seed, **params}))
    if len(examples) == num_examples:
      return examples
  raise ValueError(f"arithmetic: could not draw {num_examples} distinct problems with "
                   f"ops={list(ops)}, max_add={max_add}, max_mul={max_mul}; lower num_examples")


def arithmetic_split(split: str = "train", *, num_train: int = 2000, num_test: int = 200,
                     seed: int = 0, **kwargs) -> list[Example]:
  """Train / test splits with disjoint questions: test is drawn first and excluded from train.

  kwargs (ops, max_add, max_mul) must be the same for both splits to keep them disjoint.
  """
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"arithmetic: split must be one of {sorted(_SPLIT_SEEDS)}, got {split!r}")
  test = generate_arithmetic(num_test, 2 * seed + _SPLIT_SEEDS["test"],
                             uid_prefix="arith-test", **kwargs)
  if split == "test":
    return test
  return generate_arithmetic(num_train, 2 * seed + _SPLIT_SEEDS["train"],
                             exclude={e.question for e in test}, uid_prefix="arith-train",
                             **kwargs)
