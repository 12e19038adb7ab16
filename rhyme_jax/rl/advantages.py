"""Advantage estimators for group-sampled RL (GRPO family), chosen by name from a registry.

Every estimator maps `rewards` shaped [prompts, group size] (one row per prompt, one column
per sampled response; no legend letter, so plain names) to one scalar advantage per response,
same shape. Flatten with `.reshape(-1)` to get the per-sequence advantages of a prompt-major
batch (prompt 0's responses first).

All functions are pure `jnp` and jit-friendly; options are keyword-only Python values.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from rhyme_jax.rl.registry import Registry


class AdvantageFn(Protocol):

  def __call__(self, rewards: jax.Array, *, normalize_std: bool = ...,
               eps: float = ...) -> jax.Array:
    ...


_REGISTRY: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = _REGISTRY.register  # decorator: make a function available by name
get_advantage = _REGISTRY.get
available_advantages = _REGISTRY.names


def _check_groups(rewards: jax.Array, name: str) -> None:
  if rewards.ndim != 2:
    raise ValueError(f"{name}: rewards must be shaped [num_groups, G], got {rewards.shape}")
  if rewards.shape[1] < 2:
    raise ValueError(f"{name}: needs at least 2 responses per group (G), got G="
                     f"{rewards.shape[1]}")


def _centred(rewards: jax.Array) -> jax.Array:
  """Reward minus its group's mean, exactly 0 for a group whose rewards are all equal: in
  float32 the mean of G equal rewards can miss them by an ulp (1.1 x 16 does), and dividing
  that by a std of the same size would give every sample one advantage of ~0.1."""
  adv = rewards - jnp.mean(rewards, axis=1, keepdims=True)
  same = jnp.all(rewards == rewards[:, :1], axis=1, keepdims=True)
  return jnp.where(same, 0.0, adv)


def _group_std(rewards: jax.Array) -> jax.Array:
  """Unbiased (ddof=1) std per group, as torch.std in the GRPO reference code, [N, 1]."""
  return jnp.std(rewards, axis=1, keepdims=True, ddof=1)


@register_advantage("grpo")
def grpo(rewards: jax.Array, *, normalize_std: bool = True,
         eps: float = 1e-6) -> jax.Array:
  """GRPO: reward minus the group mean, optionally divided by (group std + eps).

  `normalize_std=False` gives the Dr. GRPO variant, which avoids up-weighting groups whose
  rewards barely differ. A group with identical rewards gets zero advantage either way.
  """
  _check_groups(rewards, "grpo")
  rewards = rewards.astype(jnp.float32)
  adv = _centred(rewards)
  if normalize_std:
    adv = adv / (_group_std(rewards) + eps)
  return adv


@register_advantage("rloo")
def rloo(rewards: jax.Array, *, normalize_std: bool = False,
         eps: float = 1e-6) -> jax.Array:
  """REINFORCE leave-one-out: reward minus the mean of the other G-1 rewards of its group.

  Equals G/(G-1) x the mean-centred reward; the baseline never includes the sample itself, so
  the estimate is unbiased. `normalize_std=True` additionally divides by (group std + eps).
  """
  _check_groups(rewards, "rloo")
  rewards = rewards.astype(jnp.float32)
  g = rewards.shape[1]
  # r_i - (sum - r_i) / (G - 1) == G / (G - 1) * (r_i - mean)
  adv = (g / (g - 1)) * _centred(rewards)
  if normalize_std:
    adv = adv / (_group_std(rewards) + eps)
  return adv
