"""Reward functions for RL: `get_reward_fn(name)(completion_text, example) -> float`.

Registered names: 'gsm8k', 'arithmetic', 'math_verify', 'format'; combine with weights as
'gsm8k+0.1*format'. `fn.score(...)` returns a RewardResult with per-component values.
"""

from rhyme_jax.rl.rewards import arithmetic, format, gsm8k, math_verify_reward  # noqa: F401  pylint: disable=redefined-builtin
from rhyme_jax.rl.rewards.registry import (RewardFn, RewardResult, available_rewards,
                                           combine_rewards, get_reward_fn, register_reward)

__all__ = ["RewardFn", "RewardResult", "available_rewards", "combine_rewards", "get_reward_fn",
           "register_reward"]
