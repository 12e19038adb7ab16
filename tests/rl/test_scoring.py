"""rl/rewards/scoring.py on its own, with the real SmolLM2 tokenizer and registered rewards."""

from __future__ import annotations

import numpy as np

from rhyme_jax.data.datasets import Example
from rhyme_jax.rl.rewards import get_reward_fn
from rhyme_jax.rl.rewards.scoring import Scorer, accuracy_of
from rhyme_jax.rl.samples import Sample, prompt_of


def _sample(tok, text):
  ids = np.asarray(tok.encode(text), np.int32)
  return Sample(prompt_of(Example("u", "1+1?", "1 + 1 = 2\n#### 2"), [1, 2]), ids,
                np.zeros(len(ids), np.float32), "stop")


def test_accuracy_of_finds_the_correctness_component():
  assert accuracy_of({"correct": 1.0, "format": 0.0}) == 1.0
  assert accuracy_of({"gsm8k/correct": 0.0, "format": 1.0}) == 0.0
  assert accuracy_of({"format": 1.0}) is None


def test_scorer_decodes_rewards_and_penalises_overlong(smollm2_tokenizer):
  tok = smollm2_tokenizer
  scorer = Scorer(tok, get_reward_fn("gsm8k+0.1*format"), max_new_tokens=8, overlong_buffer=0)
  right, wrong = _sample(tok, "so\n#### 2"), _sample(tok, "so\n#### 3")
  scorer.score_group([right, wrong])
  assert right.text == "so\n#### 2"
  assert right.reward == 1.1 and right.correct == 1.0
  assert wrong.reward == 0.1 and wrong.correct == 0.0

  long = Scorer(tok, get_reward_fn("gsm8k"), max_new_tokens=8, overlong_buffer=4)
  short_s, long_s = _sample(tok, "#### 2"), _sample(tok, "one two three\n#### 2")
  assert len(short_s.tokens) <= 4 < len(long_s.tokens) <= 8
  long.score_group([short_s, long_s])
  assert short_s.reward == 1.0  # inside max_new_tokens - buffer: no penalty
  over = len(long_s.tokens) - 4
  assert long_s.correct == 1.0 and np.isclose(long_s.reward, 1.0 - over / 4)  # linear penalty
