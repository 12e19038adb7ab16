"""Sampling: per-request parameters, logits processing, and position-keyed random draws.

Every random draw is keyed by (seed, request id, absolute position of the token being sampled)
and nothing else, so a token's sample does not depend on batch composition, slot, step, or on
whether it was reached through a verified draft or a one-token step. That is what makes
speculation invisible: the same logits give the same token.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp

_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is sampled. temperature 0 means greedy (argmax)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = off
  max_new_tokens: int = 256
  stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences that end a response

  def validate(self) -> None:
    """Raises ValueError naming the offending field and what is allowed."""
    if not (self.temperature >= 0.0 and self.temperature < float("inf")):
      raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 "
                       "(0 = greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
    if not isinstance(self.top_k, numbers.Integral) or not 0 <= self.top_k < 2**31:
      raise ValueError(f"top_k={self.top_k}: must be an integer in [0, 2**31) (0 = off)")
    # Integral, not "equal to an int": a float cap (5.0) reached the drafter's budgets.
    if not isinstance(self.max_new_tokens, numbers.Integral) or self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be an integer > 0")
    for s in self.stop_sequences:
      if len(s) == 0:
        raise ValueError("stop_sequences: every stop sequence must have at least one token")

  @property
  def filters(self) -> bool:
    """Whether top-p / top-k truncation is in play (needs a sort over the vocabulary)."""
    return self.top_p < 1.0 or self.top_k > 0


def needs_filtering(params: Sequence[SamplingParams]) -> bool:
  return any(p.filters for p in params)


def sample_keys(seed: int | jax.Array, request_N: jax.Array, position_N: jax.Array) -> jax.Array:
  """One key per draw, from (seed, request id, absolute position) only."""
  base = jax.random.key(seed)
  return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(
      request_N, position_N)


def _full_sort_filter(scaled: jax.Array, top_p_N: jax.Array, top_k_N: jax.Array) -> jax.Array:
  """Top-k then top-p over a full sort of the vocabulary (the definition; rarely needed)."""
  v = scaled.shape[-1]
  sorted_NxV = -jnp.sort(-scaled, axis=-1)
  kth_N = jnp.take_along_axis(sorted_NxV, jnp.clip(top_k_N - 1, 0, v - 1)[:, None], axis=-1)
  keep_k = jnp.where((top_k_N > 0)[:, None], scaled >= kth_N, True)
  ranks = jnp.arange(v)[None, :]
  sorted_k = jnp.where((top_k_N[:, None] > 0) & (ranks >= top_k_N[:, None]), _NEG, sorted_NxV)
  probs_sorted = jax.nn.softmax(sorted_k, axis=-1)
  mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  count_N = jnp.maximum(jnp.sum(mass_before < top_p_N[:, None], axis=-1), 1)
  thresh_N = jnp.take_along_axis(sorted_k, (count_N - 1)[:, None], axis=-1)
  keep_p = (scaled >= thresh_N) | (top_p_N >= 1.0)[:, None]
  return jnp.where(keep_k & keep_p, scaled, _NEG)


def _candidate_filter(scaled: jax.Array, top_p_N: jax.Array, top_k_N: jax.Array, c: int
                      ) -> tuple[jax.Array, jax.Array]:
  """Top-k then top-p from the `c` largest logits only (`lax.top_k`, no vocabulary sort).

  Returns (filtered logits, ok_N): ok_N is False where the answer may lie past the c
  candidates (top_k > c, or top_p not reached within them); the caller falls back there.
  """
  top_NxC, _ = jax.lax.top_k(scaled, c)
  ranks = jnp.arange(c)[None, :]
  k_on = (top_k_N > 0)[:, None]
  kth_N = jnp.take_along_axis(top_NxC, jnp.clip(top_k_N - 1, 0, c - 1)[:, None], axis=-1)
  keep_k = jnp.where(k_on, scaled >= kth_N, True)
  cand = jnp.where(k_on & (ranks >= top_k_N[:, None]), _NEG, top_NxC)
  # The normaliser: over the top-k set when top-k is on, else over the whole vocabulary.
  lse_N = jnp.where(k_on[:, 0], jax.nn.logsumexp(cand, axis=-1),
                    jax.nn.logsumexp(scaled, axis=-1))
  probs = jnp.exp(cand - lse_N[:, None])
  cum = jnp.cumsum(probs, axis=-1)
  count_N = jnp.maximum(jnp.sum(cum - probs < top_p_N[:, None], axis=-1), 1)
  thresh_N = jnp.take_along_axis(cand, (count_N - 1)[:, None], axis=-1)
  keep_p = (scaled >= thresh_N) | (top_p_N >= 1.0)[:, None]
  ok_N = ((top_k_N <= c) & ((top_p_N >= 1.0) | (top_k_N > 0) | (cum[:, -1] >= top_p_N)))
  return jnp.where(keep_k & keep_p, scaled, _NEG), ok_N


CANDIDATES = 256  # logits kept by lax.top_k before top-p (a full sort only if they fall short)


def filtered_logits(logits_NxV: jax.Array, temperature_N: jax.Array, top_p_N: jax.Array,
                    top_k_N: jax.Array, filters: bool) -> jax.Array:
  """Temperature-scaled logits with top-k then top-p truncation (truncated entries -1e30).

  `filters` is static: without it no top-k is compiled in. With it the threshold comes from
  the CANDIDATES largest logits (`lax.top_k`, linear in the vocabulary); only when some row's
  top-p mass is not reached within them does a full sort run (`lax.cond`).

  Each row keeps its own path's answer: the candidates' where they hold it, the sort's where
  they do not. The two sum probabilities in different orders, so at a top-p boundary they can
  keep different sets; taking the sort's answer for every row of a step that needs it would
  make a row's sample depend on which rows share its step.
  """
  greedy_N = temperature_N <= 0
  scaled = logits_NxV / jnp.where(greedy_N, 1.0, temperature_N)[:, None]
  if not filters:
    return scaled
  c = min(CANDIDATES, scaled.shape[-1])
  fast, ok_N = _candidate_filter(scaled, top_p_N, top_k_N, c)
  return jax.lax.cond(jnp.all(ok_N), lambda: fast, lambda: jnp.where(
      ok_N[:, None], fast, _full_sort_filter(scaled, top_p_N, top_k_N)))


def sample(logits_NxV: jax.Array, keys_N: jax.Array, temperature_N: jax.Array,
           top_p_N: jax.Array, top_k_N: jax.Array, filters: bool):
  """Draws one token per row; returns (tokens_N, logprobs_N).

  The log-probability is under the distribution sampled from (after temperature and
  truncation); for greedy rows it is the model's own log-probability of the argmax token.
  It comes from the same pass: the chosen logit minus one logsumexp (no V-wide log-softmax).
  """
  proc = filtered_logits(logits_NxV, temperature_N, top_p_N, top_k_N, filters)
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits_NxV.shape[-1],), jnp.float32))(keys_N)
  greedy_N = temperature_N <= 0
  tokens_N = jnp.where(greedy_N, jnp.argmax(logits_NxV, axis=-1),
                       jnp.argmax(proc + gumbel, axis=-1)).astype(jnp.int32)
  base = jnp.where(greedy_N[:, None], logits_NxV, proc)
  chosen_N = jnp.take_along_axis(base, tokens_N[:, None], axis=-1)[:, 0]
  return tokens_N, chosen_N - jax.nn.logsumexp(base, axis=-1)
