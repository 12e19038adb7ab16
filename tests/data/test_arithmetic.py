"""Synthetic arithmetic problems: deterministic, correct answers, disjoint splits."""

import re

import pytest

from rhyme_jax.data import arithmetic


def test_deterministic_and_seed_dependent():
  a = arithmetic.generate_arithmetic(50, seed=3)
  b = arithmetic.generate_arithmetic(50, seed=3)
  c = arithmetic.generate_arithmetic(50, seed=4)
  assert [(e.uid, e.question, e.answer) for e in a] == [(e.uid, e.question, e.answer) for e in b]
  assert [e.question for e in a] != [e.question for e in c]
  assert len({e.question for e in a}) == 50


def test_answers_are_correct_and_small():
  examples = arithmetic.generate_arithmetic(600, seed=0)
  ops = set()
  for e in examples:
    m = e.meta
    a, b, op = m["a"], m["b"], m["op"]
    ops.add(op)
    want = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert m["target"] == want and want > 0
    assert e.answer.endswith(f"#### {want}")
    assert re.findall(r"\d+", e.question) == [str(a), str(b)]
    assert a <= 20 and b <= 20
    if op == "*":
      assert 2 <= a <= 6 and 2 <= b <= 6
  assert ops == {"+", "-", "*"}


def test_ops_and_limits_options():
  only_add = arithmetic.generate_arithmetic(20, seed=1, ops=("+",), max_add=5)
  assert all(e.meta["op"] == "+" and e.meta["target"] <= 10 for e in only_add)
  with pytest.raises(ValueError, match="ops must be"):
    arithmetic.generate_arithmetic(5, ops=("/",))
  with pytest.raises(ValueError, match="could not draw"):
    arithmetic.generate_arithmetic(10_000, ops=("*",), max_mul=2)


def test_splits_are_disjoint():
  train = arithmetic.arithmetic_split("train", num_train=500, num_test=100)
  test = arithmetic.arithmetic_split("test", num_train=500, num_test=100)
  assert len(train) == 500 and len(test) == 100
  assert not {e.question for e in train} & {e.question for e in test}
  assert not {e.uid for e in train} & {e.uid for e in test}
  with pytest.raises(ValueError, match="split must be"):
    arithmetic.arithmetic_split("dev")
