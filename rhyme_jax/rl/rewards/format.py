"""Format rewards: did the model give its final answer in the requested form?

'hash': a line that is just '#### <number>' (the GSM8K / arithmetic prompts ask for it);
'boxed': a closed, non-empty \\boxed{...} (the 'boxed' prompt). Useful as a small shaping term
next to a correctness reward ('gsm8k+0.1*format'): a small model first has to learn where to
put the answer before the correctness reward can see it.
"""

from __future__ import annotations

import re
from typing import Any

from rhyme_jax.rl.rewards.gsm8k import NUMBER, last_boxed_span
from rhyme_jax.rl.rewards.registry import RewardResult, register_reward

_HASH_LINE_RE = re.compile(r"^[ \t]*####[ \t]*(?:\\?\$[ \t]*)?(" + NUMBER + r")[ \t]*\.?[ \t]*$",
                           re.MULTILINE)
STYLES = ("hash", "boxed")


def hash_format(completion: str) -> tuple[str, int] | None:
  """(number, end index) of the last line that is just '#### N' ('$N' and '.' allowed)."""
  matches = list(_HASH_LINE_RE.finditer(completion))
  return (matches[-1].group(1), matches[-1].end()) if matches else None


def boxed_format(completion: str) -> tuple[str, int] | None:
  """(content, end index) of the last closed, non-empty \\boxed{...}."""
  span = last_boxed_span(completion)
  return span if span is not None and span[0].strip() else None


@register_reward("format")
def format_reward(style: str = "hash", max_trailing_chars: int | None = None):
  """1.0 if the answer is in the `style` format, else 0.0.

  max_trailing_chars: if set, at most this many non-space characters may follow the formatted
  answer, which discourages rambling on after it.
  """
  if style not in STYLES:
    raise ValueError(f"format reward: style must be one of {STYLES}, got {style!r}")
  check = hash_format if style == "hash" else boxed_format

  def score(completion: str, example: Any) -> RewardResult:
    del example  # Format only.
    found = check(completion)
    ok = found is not None
    ends = ok and (max_trailing_chars is None or
                   len(completion[found[1]:].strip()) <= max_trailing_chars)
    return RewardResult(float(ends), {"format": float(ok), "ends_with_answer": float(ends)},
                        found[0] if ok else None)

  return score
