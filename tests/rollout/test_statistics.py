"""A statistical check that speculative decoding samples the target distribution.

On a model with an 8-token vocabulary, 40,000 two-token samples from speculative decoding
(garbage tree drafts, which match often in so small a vocabulary) and from one-token decoding
(different seeds, so the samples are independent) are compared with the exact next-token and
two-token distributions by chi-square tests. The sample size is chosen so that a 1% shift of
probability mass is caught: the test checks that too, on a deliberately biased distribution.
"""

import math

import jax.numpy as jnp
import numpy as np

from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rollout.drafts import RandomDrafter
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams, filtered_logits

V, N = 8, 40_000
PARAMS = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=2)
PROMPT = [1, 2]


def chi2_critical(df, alpha=1e-3):
  """Wilson–Hilferty approximation of the chi-square quantile."""
  z = {1e-3: 3.0902, 1e-4: 3.7190}[alpha]
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts, probs):
  n = counts.sum()
  keep = probs > 0
  assert counts[~keep].sum() == 0, "sampled a token the distribution forbids"
  exp = n * probs[keep]
  return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def next_probs(model, seq):
  logits = model(jnp.asarray([seq]), jnp.arange(len(seq))[None]).logits_BxTxV[:, -1]
  proc = filtered_logits(logits, jnp.asarray([PARAMS.temperature]), jnp.asarray([PARAMS.top_p]),
                         jnp.asarray([PARAMS.top_k]), filters=True)
  return np.asarray(jnp.exp(proc - jax_logsumexp(proc)))[0].astype(np.float64)


def jax_logsumexp(x):
  import jax
  return jax.nn.logsumexp(x, axis=-1, keepdims=True)


def sample_pairs(model, drafter, budget, seed):
  cfg = EngineConfig(max_len=8, buckets=(512,), max_draft=budget,
                     speculate="always" if budget else "never", seed=seed)
  res = RolloutEngine(model, cfg, drafter).generate(
      [Request(i, PROMPT, PARAMS) for i in range(N)])
  return np.stack([r.tokens for r in res])


def test_speculative_sampling_matches_target_distribution():
  cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8)
  model = init_model(cfg, seed=3)
  # Sharpen the random model a little so the distribution is far from uniform.
  model.embed.embedding[...] = model.embed.embedding[...] * 5.0
  p1 = next_probs(model, PROMPT)
  p12 = np.concatenate([p1[a] * next_probs(model, PROMPT + [a]) for a in range(V)])
  assert p1.max() > 0.2 and (p1 == 0).sum() >= 1  # non-uniform, top-p truncates

  spec = sample_pairs(model, RandomDrafter(V, seed=0), budget=4, seed=11)
  plain = sample_pairs(model, None, budget=0, seed=12)
  for name, pairs in (("speculative", spec), ("one-token", plain)):
    c1 = np.bincount(pairs[:, 0], minlength=V)
    c12 = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    for counts, probs in ((c1, p1), (c12, p12)):
      stat, df = chi2_stat(counts, probs)
      assert stat < chi2_critical(df), f"{name}: chi2={stat:.1f} df={df}"

  # Power: the same sample size rejects a distribution with 1% of mass moved between the two
  # most likely tokens.
  order = np.argsort(-p1)
  biased = p1.copy()
  biased[order[0]] -= 0.01
  biased[order[1]] += 0.01
  stat, df = chi2_stat(np.bincount(spec[:, 0], minlength=V), biased)
  assert stat > chi2_critical(df, 1e-4), f"1% bias not detected: chi2={stat:.1f}"
