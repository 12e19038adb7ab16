"""Reward functions: answer extraction, format checks, math-verify off the main thread."""

import concurrent.futures
import fractions
import time

import pytest

from rhyme_jax.data import arithmetic as arith_data
from rhyme_jax.data import datasets
from rhyme_jax.rl.rewards import get_reward_fn, math_verify_reward
from rhyme_jax.rl.rewards import gsm8k
from rhyme_jax.rl.rewards.format import hash_format

GSM_EXAMPLE = {"answer": "She makes 9 * 2 = $<<9*2=18>>18.\n#### 1,018"}


@pytest.mark.parametrize("completion,value,how", [
    ("So she makes 1018 dollars.", 1018, "last_number"),
    ("Total: $1,018.00.", 1018, "last_number"),
    ("#### 1018\nI hope this helps! 42", 1018, "hash"),
    ("#### $1,018", 1018, "hash"),
    ("The answer is: 1018. (Checked 3 times.)", 1018, "answer_is"),
    ("the final answer is $1018", 1018, "answer_is"),
    ("\\boxed{1018} then #### 5", 1018, "boxed"),
    ("\\boxed{\\$1,018 \\text{ dollars}}", 1018, "boxed"),
    ("\\boxed{\\frac{3}{4}}", fractions.Fraction(3, 4), "boxed"),
    ("It is -7.50 degrees.", fractions.Fraction(-15, 2), "last_number"),
    ("no numbers here", None, "none"),
    ("cut off \\boxed{10", 10, "last_number"),
])
def test_extract_prediction(completion, value, how):
  got, _, got_how = gsm8k.extract_prediction(completion)
  assert (got, got_how) == (value, how)


def test_gsm8k_reward_cases():
  fn = get_reward_fn("gsm8k")
  assert fn("... so #### 1018", GSM_EXAMPLE) == 1.0
  assert fn("... 1018.0", GSM_EXAMPLE) == 1.0
  assert fn("... #### 1018.5", GSM_EXAMPLE) == 0.0
  assert fn("#### 1018 and then 7", GSM_EXAMPLE) == 1.0  # '####' beats the last number.
  assert fn("I think 1018 but no wait 17", GSM_EXAMPLE) == 0.0
  strict = get_reward_fn("gsm8k", fallback_last_number=False)
  assert strict("so 1018", GSM_EXAMPLE) == 0.0 and strict("#### 1018", GSM_EXAMPLE) == 1.0
  result = fn.score("The answer is 1,018", GSM_EXAMPLE)
  assert result.extracted == "1,018" and result.components["strict_format"] == 0.0
  with pytest.raises(ValueError, match="no '####'"):
    fn("1", {"answer": "18"})
  with pytest.raises(KeyError, match="no field 'answer'"):
    fn("1", {"question": "q"})
  with pytest.raises(TypeError, match="completion must be a str"):
    fn(None, GSM_EXAMPLE)


def test_gsm8k_reference_answers_score_one():
  """Every GSM8K test reference parses, and the reference solution scores 1 against itself."""
  path = datasets.default_gsm8k_dir() / "test.jsonl"
  if not path.is_file():
    pytest.skip(f"{path} is missing (the shared GSM8K copy next to the checkout); CI has it")
  fn = get_reward_fn("gsm8k+format")
  examples = datasets.load_gsm8k("test")
  scores = [fn(e.answer, e) for e in examples]
  assert scores == [2.0] * len(examples)
  wrong = [fn(e.answer.rsplit("####", 1)[0] + "#### 0.123", e) for e in examples[:50]]
  assert wrong == [1.0] * 50  # Format still right, answer wrong.


@pytest.mark.parametrize("completion,ok", [
    ("work\n#### 42", True), ("work\n####42.\n", True), ("  #### $3,000  ", True),
    ("the result #### 42", False), ("#### forty-two", False), ("no answer", False),
])
def test_hash_format(completion, ok):
  assert (hash_format(completion) is not None) == ok
  assert get_reward_fn("format")(completion, {}) == float(ok)


def test_format_options():
  boxed = get_reward_fn("format", style="boxed")
  assert boxed("so \\boxed{x+1}", {}) == 1.0
  assert boxed("so \\boxed{ }", {}) == 0.0 and boxed("so \\boxed{3", {}) == 0.0
  tight = get_reward_fn("format", max_trailing_chars=10)
  assert tight("#### 4\nDone!", {}) == 1.0
  assert tight("#### 4\nNow let me tell you a story about apples.", {}) == 0.0
  assert get_reward_fn("format", style="boxed", max_trailing_chars=0)("\\boxed{1}.", {}) == 0.0
  with pytest.raises(ValueError, match="style must be"):
    get_reward_fn("format", style="xml")


def test_arithmetic_reward():
  examples = arith_data.generate_arithmetic(100, seed=5)
  fn = get_reward_fn("arithmetic")
  assert [fn(e.answer, e) for e in examples] == [1.0] * 100
  e = examples[0]
  target = e.meta["target"]
  assert fn(f"The answer is {target + 1}.", e) == 0.0
  assert fn(f"{target}", e) == 1.0
  assert fn(f"{target}.0 apples", e) == 1.0
  bonus = get_reward_fn("arithmetic", format_bonus=0.5)
  assert bonus(f"#### {target}", e) == 1.5 and bonus(f"{target}", e) == 1.0
  # The target comes from meta even when the answer text disagrees.
  assert fn("#### 3", {"answer": "#### 99", "meta": {"target": 3}}) == 1.0


def test_registry_names_and_combinations():
  fn = get_reward_fn("gsm8k + 0.25*format")
  assert fn("#### 1018", GSM_EXAMPLE) == 1.25
  assert fn.score("1018", GSM_EXAMPLE).components["format"] == 0.0
  with pytest.raises(ValueError, match="unknown reward 'nope'.*gsm8k"):
    get_reward_fn("nope")
  with pytest.raises(ValueError, match="cannot parse term"):
    get_reward_fn("gsm8k+0.1*")
  with pytest.raises(ValueError, match="appears twice"):
    get_reward_fn("format+format")
  with pytest.raises(ValueError, match="single reward"):
    get_reward_fn("gsm8k+format", style="boxed")


MATH_CASES = [
    ("$\\frac{1}{2}$", "Thus the answer is \\boxed{0.5}.", 1.0),
    ("\\frac{1}{2}", "We get \\boxed{\\frac{2}{4}}", 1.0),
    ("x^2+2x+1", "Expanding, \\boxed{(x+1)^2}", 1.0),
    ("\\sqrt{2}", "so \\boxed{1.5}", 0.0),
    ("3", "I do not know.", 0.0),
]


def test_math_verify_main_thread():
  fn = get_reward_fn("math_verify")
  for gold, completion, want in MATH_CASES:
    assert fn(completion, {"answer": gold}) == want, (gold, completion)
  # GSM8K-style reference: the number after '####'.
  assert fn("so \\boxed{1018}", GSM_EXAMPLE) == 1.0
  with pytest.raises(ValueError, match="cannot parse the reference"):
    fn("\\boxed{1}", {"answer": "no math here"})


def test_math_verify_off_main_thread_uses_worker_process():
  """In a thread math-verify's signal timeouts raise; the wrapper must still give answers."""
  fn = get_reward_fn("math_verify")
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    got = list(pool.map(lambda c: fn(c[1], {"answer": c[0]}), MATH_CASES))
    assert got == [c[2] for c in MATH_CASES]
    with pytest.raises(ValueError, match="cannot parse the reference"):
      pool.submit(fn, "\\boxed{1}", {"answer": "no math here"}).result()


def test_worker_deadline_kills_and_recovers():
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="exceeded"):
    math_verify_reward.call_in_worker(time.sleep, (60,), deadline_s=2.0)
  assert time.monotonic() - start < 30
  # A new worker replaces the killed one.
  assert math_verify_reward.call_in_worker(abs, (-3,), deadline_s=60.0) == 3


def test_the_worker_pool_shuts_down_and_restarts():
  """`shutdown_pool` (also run at exit, before the interpreter's teardown) stops the worker
  process and drops the pool; the next call starts a new one."""
  assert math_verify_reward.call_in_worker(abs, (-4,), deadline_s=60.0) == 4
  procs = list(math_verify_reward._POOL._processes.values())
  assert procs and all(p.is_alive() for p in procs)
  math_verify_reward.shutdown_pool()
  assert math_verify_reward._POOL is None and not any(p.is_alive() for p in procs)
  assert math_verify_reward.call_in_worker(abs, (-5,), deadline_s=60.0) == 5
