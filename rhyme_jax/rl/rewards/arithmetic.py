"""Exact-answer reward for the synthetic arithmetic task (rhyme_jax.data.arithmetic).

The generator lives in the data package (rl may import data, not the other way round) and is
re-exported here. The target is the exact integer `meta['target']` (falling back to the number
after '####'); the completion's answer is extracted as for GSM8K.
"""

from __future__ import annotations

from typing import Any

from rhyme_jax.data.arithmetic import arithmetic_split, generate_arithmetic  # noqa: F401
from rhyme_jax.rl.rewards.gsm8k import numeric_score
from rhyme_jax.rl.rewards.registry import RewardResult, register_reward


@register_reward("arithmetic")
def arithmetic_reward(fallback_last_number: bool = True, format_bonus: float = 0.0):
  """1.0 for the exact answer (+ format_bonus if it was given as '#### N' or \\boxed{N}).

  With fallback_last_number (default) a bare final number counts, so an untrained small
  model already earns some reward; set it False to demand the requested format.
  """

  def score(completion: str, example: Any) -> RewardResult:
    result = numeric_score(completion, example, fallback_last_number)
    reward = result.reward + format_bonus * result.components["strict_format"]
    return RewardResult(reward, result.components, result.extracted)

  return score
