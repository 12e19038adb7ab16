"""GSM8K-style numeric answers: extraction, normalisation and the 1/0 correctness reward.

The reference is the number after the last '####' of the GSM8K answer text. From the model's
completion the answer is taken, by priority, from the last \\boxed{...}, the last '#### N',
the last 'answer is N', else (optionally) the last number in the text. Numbers are compared
exactly as rationals after dropping '$', thousands separators, '%' and trailing zeros
('1,000.00' == '1000').
"""

from __future__ import annotations

import fractions
import re
from typing import Any

from rhyme_jax.rl.rewards.registry import (RewardResult, example_field, example_meta,
                                           register_reward)

# A number: optional sign, comma-grouped or plain digits, optional decimals; or '.5'.
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(NUMBER)
_HASH_RE = re.compile(r"####\s*(?:\\?\$\s*)?(" + NUMBER + r")")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*(?:\\?\$\s*)?(" + NUMBER + r")", re.IGNORECASE)


def normalize_number(text: str) -> fractions.Fraction | None:
  """Parse '1,234.50', '$18', '-3', '18.0', '50%' or 'a/b' to an exact rational (None if not)."""
  s = text.strip().replace("\\$", "").replace("$", "").replace(",", "").replace("%", "")
  s = s.replace("\\!", "").replace(" ", "").rstrip(".")
  frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s)
  if frac:
    s = f"{frac.group(1)}/{frac.group(2)}"
  try:
    return fractions.Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def last_boxed_span(text: str) -> tuple[str, int] | None:
  """(content, end index after the closing brace) of the last \\boxed{...} / \\fbox{...},
  with nested braces balanced; None when absent or cut off before the closing brace."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    return None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j], j + 1
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (None when absent or unclosed)."""
  span = last_boxed_span(text)
  return span[0] if span else None


def extract_reference(answer_text: str) -> fractions.Fraction:
  """The GSM8K reference number after the last '####'; errors name the bad text."""
  if "####" not in answer_text:
    raise ValueError(f"gsm8k reward: reference answer has no '####': {answer_text[-80:]!r}")
  value = normalize_number(answer_text.rsplit("####", 1)[1])
  if value is None:
    raise ValueError(f"gsm8k reward: cannot parse the number after '####' in "
                     f"{answer_text[-80:]!r}")
  return value


def extract_prediction(completion: str, fallback_last_number: bool = True
                       ) -> tuple[fractions.Fraction | None, str | None, str]:
  """(value, raw text, how) of the completion's final answer; how is 'boxed', 'hash',
  'answer_is', 'last_number' or 'none'."""
  boxed = last_boxed(completion)
  if boxed is not None:
    value = normalize_number(boxed)
    if value is None:  # e.g. '18 \\text{ dollars}': take the first number inside.
      m = _NUMBER_RE.search(boxed)
      value = normalize_number(m.group(0)) if m else None
    if value is not None:
      return value, boxed, "boxed"
  for how, pattern in (("hash", _HASH_RE), ("answer_is", _ANSWER_IS_RE)):
    matches = pattern.findall(completion)
    if matches:
      return normalize_number(matches[-1]), matches[-1], how
  if fallback_last_number:
    matches = _NUMBER_RE.findall(completion)
    if matches:
      return normalize_number(matches[-1]), matches[-1], "last_number"
  return None, None, "none"


def reference_value(example: Any) -> fractions.Fraction:
  """`meta['target']` when the example carries one, else the number after '####'."""
  meta = example_meta(example)
  if "target" in meta:
    value = normalize_number(str(meta["target"]))
    if value is None:
      raise ValueError(f"gsm8k reward: cannot parse meta['target']={meta['target']!r}")
    return value
  return extract_reference(example_field(example, "answer"))


def numeric_score(completion: str, example: Any, fallback_last_number: bool) -> RewardResult:
  value, raw, how = extract_prediction(completion, fallback_last_number)
  correct = float(value is not None and value == reference_value(example))
  return RewardResult(correct, {"correct": correct, "found_answer": float(value is not None),
                                "strict_format": float(how in ("hash", "boxed"))}, raw)


@register_reward("gsm8k")
def gsm8k_reward(fallback_last_number: bool = True):
  """1.0 if the completion's final number equals the reference, else 0.0."""
  return lambda completion, example: numeric_score(completion, example, fallback_last_number)
