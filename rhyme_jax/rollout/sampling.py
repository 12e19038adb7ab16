"""Sampling: per-request parameters, logits processing, and position-keyed random draws.

Every random draw is keyed by (seed, request id, absolute position of the token being sampled)
and nothing else, so a token's sample does not depend on batch composition, slot, step, or on
whether it was reached through a verified draft or a one-token step. That is what makes
speculation invisible: the same logits give the same token.
"""

from __future__ import annotations

import dataclasses
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
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: must be an integer >= 0 (0 = off)")
    if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens <= 0:
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


def filtered_logits(logits_NxV: jax.Array, temperature_N: jax.Array, top_p_N: jax.Array,
                    top_k_N: jax.Array, filters: bool) -> jax.Array:
  """Temperature-scaled logits with top-k then top-p truncation (truncated entries -1e30).

  `filters` is static: without it no sort over the vocabulary is compiled in.
  """
  greedy_N = temperature_N <= 0
  scaled = logits_NxV / jnp.where(greedy_N, 1.0, temperature_N)[:, None]
  if not filters:
    return scaled
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


def sample(logits_NxV: jax.Array, keys_N: jax.Array, temperature_N: jax.Array,
           top_p_N: jax.Array, top_k_N: jax.Array, filters: bool):
  """Draws one token per row; returns (tokens_N, logprobs_N).

  The log-probability is under the distribution sampled from (after temperature and
  truncation); for greedy rows it is the model's own log-probability of the argmax token.
  """
  proc = filtered_logits(logits_NxV, temperature_N, top_p_N, top_k_N, filters)
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits_NxV.shape[-1],), jnp.float32))(keys_N)
  greedy_N = temperature_N <= 0
  tokens_N = jnp.where(greedy_N, jnp.argmax(logits_NxV, axis=-1),
                       jnp.argmax(proc + gumbel, axis=-1)).astype(jnp.int32)
  logp = jax.nn.log_softmax(jnp.where(greedy_N[:, None], logits_NxV, proc), axis=-1)
  return tokens_N, jnp.take_along_axis(logp, tokens_N[:, None], axis=-1)[:, 0]
