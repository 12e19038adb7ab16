"""Scoring samples: decode, reward, correctness, and the group-level soft overlong penalty.

Shared by training rollouts, greedy evaluation and the benchmarks, so every place that
reports a reward computes it the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from rhyme_jax.rl import losses
from rhyme_jax.rl.rewards.registry import RewardFn
from rhyme_jax.rl.samples import Sample


def accuracy_of(components: Mapping[str, float]) -> float | None:
  """The correctness component of a reward ('correct' or 'x/correct'), if it has one."""
  for k, v in components.items():
    if k == "correct" or k.endswith("/correct"):
      return float(v)
  return None


@dataclasses.dataclass
class Scorer:
  """Fills in samples' text, reward and correctness.

  `overlong_buffer` > 0 adds DAPO's soft penalty over the last that many tokens before
  `max_new_tokens` (a group-level step: it needs the group's lengths).
  """

  tokenizer: object
  reward_fn: RewardFn
  max_new_tokens: int
  overlong_buffer: int = 0

  def score(self, sample: Sample) -> None:
    sample.text = self.tokenizer.decode(sample.tokens)
    result = self.reward_fn.score(sample.text, sample.prompt.example)
    sample.reward = float(result.reward)
    sample.correct = accuracy_of(result.components)

  def score_group(self, group: Sequence[Sample]) -> None:
    """Rewards of one prompt's samples: each scored, plus the soft overlong penalty."""
    for sample in group:
      self.score(sample)
    if self.overlong_buffer:
      pen_B = losses.overlong_penalty(np.array([len(x.tokens) for x in group]),
                                      self.max_new_tokens, self.overlong_buffer)
      for x, v in zip(group, np.asarray(pen_B)):
        x.reward += float(v)
