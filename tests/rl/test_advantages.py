"""Advantage estimators against plain-loop NumPy reimplementations."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rl import advantages


def _ref_grpo(rewards, normalize_std, eps):
  out = np.zeros_like(rewards, dtype=np.float64)
  for n in range(rewards.shape[0]):
    g = rewards.shape[1]
    mean = sum(rewards[n]) / g
    var = sum((r - mean) ** 2 for r in rewards[n]) / (g - 1)
    for i in range(g):
      out[n, i] = rewards[n, i] - mean
      if normalize_std:
        out[n, i] /= math.sqrt(var) + eps
  return out


def _ref_rloo(rewards, normalize_std, eps):
  out = np.zeros_like(rewards, dtype=np.float64)
  for n in range(rewards.shape[0]):
    g = rewards.shape[1]
    mean = sum(rewards[n]) / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards[n]) / (g - 1))
    for i in range(g):
      others = [rewards[n, j] for j in range(g) if j != i]
      out[n, i] = rewards[n, i] - sum(others) / len(others)
      if normalize_std:
        out[n, i] /= std + eps
  return out


@pytest.mark.parametrize("name,ref", [("grpo", _ref_grpo), ("rloo", _ref_rloo)])
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("shape", [(3, 2), (5, 8), (1, 16)])
def test_matches_numpy(name, ref, normalize_std, shape):
  rng = np.random.default_rng(zlib.crc32(repr((name, normalize_std, shape)).encode()))
  rewards = rng.normal(size=shape).astype(np.float32)
  rewards[0, :] = 1.0  # A constant group must give zero advantage.
  rewards_bin = (rng.random(size=shape) > 0.5).astype(np.float32)  # 0/1 task rewards.
  rewards_bin[0, :] = 0.0
  fn = advantages.get_advantage(name)
  for r in (rewards, rewards_bin):
    got = np.asarray(jax.jit(lambda x: fn(x, normalize_std=normalize_std, eps=1e-4))(r))
    want = ref(r.astype(np.float64), normalize_std, 1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], 0.0, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("value, g", [(1.1, 16), (1.2, 8), (1.3, 64), (0.1, 16), (1.2, 64)])
def test_equal_rewards_give_exactly_zero_advantage(name, value, g):
  """In float32 the mean of G equal rewards can miss them by an ulp (1.1 x 16: the reward of a
  correct, well-formatted answer under gsm8k+0.1*format); normalised by a std of the same
  size, that became an advantage of about -0.1 for every sample of the group."""
  rewards = jnp.full((2, g), value, jnp.float32).at[1, 0].set(value + 1.0)
  for normalize_std in (True, False):
    adv = np.asarray(jax.jit(lambda r: advantages.get_advantage(name)(
        r, normalize_std=normalize_std))(rewards))
    np.testing.assert_array_equal(adv[0], 0.0)
    assert adv[1, 0] > 0 > adv[1, 1]  # a group that differs keeps its advantages


def test_grpo_normalised_has_unit_std_and_zero_mean():
  rewards = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
  adv = advantages.grpo(rewards, eps=0.0)
  np.testing.assert_allclose(np.mean(adv, axis=1), 0.0, atol=1e-6)
  np.testing.assert_allclose(np.std(adv, axis=1, ddof=1), 1.0, rtol=1e-5)


def test_rloo_is_scaled_grpo_without_std():
  rewards = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32)
  np.testing.assert_allclose(advantages.rloo(rewards),
                             4 / 3 * advantages.grpo(rewards, normalize_std=False), rtol=1e-5)


def test_registry_and_errors():
  assert {"grpo", "rloo"} <= set(advantages.available_advantages())
  with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo"):
    advantages.get_advantage("nope")
  with pytest.raises(ValueError, match="already registered"):
    advantages.register_advantage("grpo")(lambda r, **kw: r)
  with pytest.raises(ValueError, match="at least 2"):
    advantages.grpo(jnp.ones((3, 1)))
  with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
    advantages.rloo(jnp.ones((6,)))
