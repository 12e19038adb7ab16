"""Logits processing against NumPy, and position-keyed randomness."""

import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rollout import sampling
from rhyme_jax.rollout.sampling import SamplingParams


def numpy_filter(logits, temperature, top_p, top_k):
  x = logits / (temperature if temperature > 0 else 1.0)
  order = np.argsort(-x, kind="stable")
  keep = np.ones_like(x, bool)
  if top_k > 0:
    keep[order[top_k:]] = False
  kept = np.where(keep, x, -np.inf)
  p = np.exp(kept - kept.max())
  p /= p.sum()
  cum = 0.0
  keep_p = np.zeros_like(keep)
  for idx in order:
    if not keep[idx]:
      break
    keep_p[idx] = True
    cum += p[idx]
    if cum >= top_p and top_p < 1.0:
      break
  return keep & keep_p


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0),
                                                     (1.0, 1.0, 5), (0.5, 0.5, 10),
                                                     (1.3, 0.3, 3)])
def test_filtered_logits_match_numpy(temperature, top_p, top_k):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(16, 50)).astype(np.float32) * 3
  n = logits.shape[0]
  out = np.asarray(sampling.filtered_logits(
      jnp.asarray(logits), jnp.full(n, temperature), jnp.full(n, top_p),
      jnp.full(n, top_k, jnp.int32), filters=True))
  for row in range(n):
    keep = numpy_filter(logits[row], temperature, top_p, top_k)
    np.testing.assert_array_equal(out[row] > -1e29, keep)
    np.testing.assert_allclose(out[row][keep], logits[row][keep] / temperature, rtol=1e-6)


def test_sample_is_keyed_by_position_only():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 40)).astype(np.float32))
  one = lambda r, p: sampling.sample(logits, sampling.sample_keys(7, jnp.array([r]), jnp.array([p])),
                                     jnp.ones(1), jnp.ones(1), jnp.zeros(1, jnp.int32), False)[0]
  draws = {int(one(3, p)[0]) for p in range(40)}
  assert len(draws) > 5  # different positions, different draws
  assert int(one(3, 11)[0]) == int(one(3, 11)[0])
  # Same (seed, request, position) inside a larger batch: the same draw.
  big = jnp.concatenate([logits] * 4)
  toks, _ = sampling.sample(big, sampling.sample_keys(7, jnp.array([9, 3, 4, 3]),
                                                      jnp.array([1, 11, 2, 11])),
                            jnp.ones(4), jnp.ones(4), jnp.zeros(4, jnp.int32), False)
  assert int(toks[1]) == int(toks[3]) == int(one(3, 11)[0])


def test_greedy_logprob_is_model_logprob():
  logits = jnp.asarray([[0.0, 2.0, 1.0]])
  tok, lp = sampling.sample(logits, sampling.sample_keys(0, jnp.array([0]), jnp.array([0])),
                            jnp.zeros(1), jnp.ones(1), jnp.zeros(1, jnp.int32), False)
  assert int(tok[0]) == 1
  np.testing.assert_allclose(float(lp[0]), 2.0 - np.log(np.exp([0, 2, 1]).sum()), rtol=1e-6)


@pytest.mark.parametrize("field,kw", [("temperature", dict(temperature=-1.0)),
                                      ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)),
                                      ("top_k", dict(top_k=-2)), ("top_k", dict(top_k=2**31)),
                                      ("max_new_tokens", dict(max_new_tokens=0)),
                                      ("stop_sequences", dict(stop_sequences=((),)))])
def test_invalid_params_name_the_field(field, kw):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kw).validate()


@pytest.mark.parametrize("top_p,top_k", [(0.9, 0), (0.5, 20), (1.0, 7), (0.999999, 0),
                                         (1.0, 300)])
def test_candidate_filter_equals_the_full_sort(top_p, top_k):
  """Top-k before top-p from lax.top_k candidates (a full sort only when they fall short, e.g.
  top-p mass past the candidates or top_k > candidates) keeps exactly what the sort keeps."""
  rng = np.random.default_rng(7)
  v, n = 2000, 12
  logits = jnp.asarray(rng.normal(size=(n, v)).astype(np.float32) * 2)
  t, p, k = jnp.full(n, 0.8), jnp.full(n, top_p), jnp.full(n, top_k, jnp.int32)
  fast = np.asarray(sampling.filtered_logits(logits, t, p, k, filters=True))
  full = np.asarray(sampling._full_sort_filter(logits / 0.8, p, k))
  np.testing.assert_array_equal(fast > -1e29, full > -1e29)
  np.testing.assert_allclose(fast, full)


def test_a_rows_truncation_does_not_depend_on_the_rows_beside_it():
  """Top-p at a boundary (the threshold equal to the mass before a candidate, as the
  candidate path sums it), where the candidate path and the full sort, summing in different
  orders, can keep different sets: each row keeps the same tokens alone as beside a flat row
  whose top-p mass lies past the candidates (a step that needs the sort)."""
  rng = np.random.default_rng(0)
  v, n = 512, 64
  logits = jnp.asarray(rng.normal(size=(n, v)).astype(np.float32) * 2)
  top = np.sort(np.asarray(logits), axis=-1)[:, ::-1]
  lse = np.asarray(jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1))
                   + logits.max(-1))
  probs = np.exp(top - lse[:, None]).astype(np.float32)
  before = np.cumsum(probs, axis=-1, dtype=np.float32) - probs
  top_p = before[np.arange(n), rng.integers(1, 20, n)]
  flat = jnp.zeros((1, v), jnp.float32)  # top-p 0.9 of a flat row needs 461 of 512 tokens
  one = lambda x, p: np.asarray(sampling.filtered_logits(
      x, jnp.ones(len(x)), jnp.asarray(p, jnp.float32), jnp.zeros(len(x), jnp.int32), True))
  alone = one(logits, top_p)
  beside = one(jnp.concatenate([logits, flat]), np.append(top_p, 0.9))
  np.testing.assert_array_equal(alone > -1e29, beside[:n] > -1e29)
  # the case is live: the full sort itself keeps another set for some of these rows
  full = np.asarray(sampling._full_sort_filter(logits, jnp.asarray(top_p), jnp.zeros(n, int)))
  assert ((full > -1e29).sum(-1) != (alone > -1e29).sum(-1)).any()
  assert (beside[n] > -1e29).sum() > sampling.CANDIDATES
