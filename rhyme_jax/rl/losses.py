"""Policy-gradient losses for RL post-training, chosen by name from a registry.

Inputs are per-token log-probabilities of the sampled response tokens, shaped [B, T], with a
mask that is 1 on response tokens that count and 0 on prompt / padding:

  logp_new_BxT      trainer log-probs under the parameters being optimised (differentiated)
  logp_old_BxT      trainer log-probs under the parameters that sampled the batch (constant);
                    None means fully on-policy: stop_gradient(logp_new_BxT)
  logp_ref_BxT      frozen reference policy log-probs, only needed when kl_beta > 0
  logp_rollout_BxT  log-probs reported by the rollout engine; when given, the loss is
                    reweighted by the truncated importance weight exp(old - rollout) ("TIS")
                    to correct the engine/trainer numerical mismatch
  advantages_B      one advantage per sequence (see rl/advantages.py)

Each loss returns (scalar loss, metrics dict of scalars). Metrics are always token-means over
valid tokens and carry no gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from rhyme_jax.config import AGGREGATIONS, KL_ESTIMATORS  # noqa: F401  (re-exported)
from rhyme_jax.rl.registry import Registry
import jax.numpy as jnp

# The choice lists are the flags' (config.py); AGGREGATIONS / KL_ESTIMATORS re-exported here.


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """Options of the clipped policy loss. Frozen and hashable: safe as a jit static argument.

  eps_low / eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high]; eps_high > eps_low
    is DAPO's clip-higher (e.g. 0.2 / 0.28).
  dual_clip_c: if set (> 1), negative-advantage tokens lose at most c * |A| (dual-clip PPO).
  aggregation: 'token-mean' (sum over all valid tokens / their count) or
    'seq-mean-token-mean' (mean over each sequence's valid tokens, then mean over sequences
    that have at least one valid token).
  kl_beta / kl_estimator: penalty beta * KL(new || ref) per token, estimated with k1 (log
    ratio), k2 (half squared log ratio) or k3 (exp(ref - new) - (ref - new) - 1, unbiased and
    non-negative). beta = 0 needs no reference log-probs.
  tis_cap: cap C of the truncated importance weight min(exp(old - rollout), C) applied when
    rollout log-probs are given; None applies the untruncated weight.
  entropy_coef: if > 0 and per-token entropies are given, subtract coef * entropy (aggregated
    like the policy term) as an exploration bonus.
  """

  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip_c: float | None = None
  aggregation: str = "token-mean"
  kl_beta: float = 0.0
  kl_estimator: str = "k3"
  tis_cap: float | None = 2.0
  entropy_coef: float = 0.0

  def __post_init__(self):
    if self.eps_low < 0 or self.eps_low >= 1:
      raise ValueError(f"PolicyLossConfig.eps_low must be in [0, 1), got {self.eps_low}")
    if self.eps_high < 0:
      raise ValueError(f"PolicyLossConfig.eps_high must be >= 0, got {self.eps_high}")
    if self.dual_clip_c is not None and self.dual_clip_c <= 1:
      raise ValueError(f"PolicyLossConfig.dual_clip_c must be > 1, got {self.dual_clip_c}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"PolicyLossConfig.aggregation must be one of {AGGREGATIONS}, got "
                       f"{self.aggregation!r}")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"PolicyLossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got "
                       f"{self.kl_estimator!r}")
    if self.kl_beta < 0:
      raise ValueError(f"PolicyLossConfig.kl_beta must be >= 0, got {self.kl_beta}")
    if self.tis_cap is not None and self.tis_cap <= 0:
      raise ValueError(f"PolicyLossConfig.tis_cap must be > 0 or None, got {self.tis_cap}")
    if self.entropy_coef < 0:
      raise ValueError(f"PolicyLossConfig.entropy_coef must be >= 0, got {self.entropy_coef}")


class LossFn(Protocol):

  def __call__(self, logp_new_BxT: jax.Array, logp_old_BxT: jax.Array | None,
               advantages_B: jax.Array, mask_BxT: jax.Array, *,
               config: PolicyLossConfig, logp_ref_BxT: jax.Array | None = None,
               logp_rollout_BxT: jax.Array | None = None,
               entropy_BxT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    ...


_REGISTRY: Registry[LossFn] = Registry("loss")
register_loss = _REGISTRY.register  # decorator: make a function available by name
get_loss = _REGISTRY.get
available_losses = _REGISTRY.names


# ----------------------------------------------------------------------------------------------
# Helpers on logits.


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log p(target) under softmax(logits / temperature), in float32, shaped [B, T].

  The temperature must match the one used for sampling, otherwise the ratio to the rollout
  log-probs is biased. `logits_BxTxV[:, t]` must be the logits that predicted `targets_BxT[:, t]`.
  """
  if temperature <= 0:
    raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
  logits_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
  logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  picked_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None].astype(jnp.int32),
                                   axis=-1)[..., 0]
  return picked_BxT - logz_BxT


def entropy(logits_BxTxV: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Entropy of softmax(logits / temperature) at every position, float32, shaped [B, T]."""
  if temperature <= 0:
    raise ValueError(f"entropy: temperature must be > 0, got {temperature}")
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
  return -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def overlong_penalty(lengths_B: jax.Array, max_length: int, cache_length: int) -> jax.Array:
  """DAPO soft overlong punishment, added to the task reward, shaped [B], values in [-1, 0].

  0 up to max_length - cache_length tokens, then falling linearly to -1 at max_length, and -1
  beyond. Penalising only the last `cache_length` tokens avoids punishing sound reasoning that
  happens to be long as hard as truncated output.
  """
  if not 0 < cache_length <= max_length:
    raise ValueError(f"overlong_penalty: need 0 < cache_length <= max_length, got "
                     f"cache_length={cache_length}, max_length={max_length}")
  lengths_B = jnp.asarray(lengths_B, jnp.float32)
  free = max_length - cache_length
  return jnp.clip((free - lengths_B) / cache_length, -1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Aggregation and KL.


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Mean of x over valid tokens (0 when there are none)."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def aggregate(loss_BxT: jax.Array, mask_BxT: jax.Array, mode: str) -> jax.Array:
  """Reduce per-token losses to a scalar ('token-mean' or 'seq-mean-token-mean').

  'token-mean' weighs every token equally, so long responses count more (DAPO);
  'seq-mean-token-mean' weighs every sequence equally (original GRPO). Sequences without valid
  tokens are left out of the sequence mean.
  """
  mask_BxT = mask_BxT.astype(jnp.float32)
  if mode == "token-mean":
    return masked_mean(loss_BxT, mask_BxT)
  if mode == "seq-mean-token-mean":
    count_B = jnp.sum(mask_BxT, axis=1)
    seq_B = jnp.sum(loss_BxT * mask_BxT, axis=1) / jnp.maximum(count_B, 1.0)
    has_B = (count_B > 0).astype(jnp.float32)
    return jnp.sum(seq_B * has_B) / jnp.maximum(jnp.sum(has_B), 1.0)
  raise ValueError(f"unknown aggregation {mode!r}; known: {AGGREGATIONS}")


def kl_penalty(log_ratio_BxT: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(policy || ref) from samples of the policy.

  `log_ratio_BxT` is log policy - log ref at the sampled tokens.
  """
  if estimator == "k1":
    return log_ratio_BxT
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio_BxT)
  if estimator == "k3":
    # Clip the exponent so a far-off reference cannot overflow to inf.
    neg_BxT = jnp.clip(-log_ratio_BxT, -20.0, 20.0)
    return jnp.exp(neg_BxT) - neg_BxT - 1.0
  raise ValueError(f"unknown kl estimator {estimator!r}; known: {KL_ESTIMATORS}")


# ----------------------------------------------------------------------------------------------
# Losses.


def _check_shapes(logp_new_BxT, advantages_B, mask_BxT, **optional):
  if logp_new_BxT.ndim != 2:
    raise ValueError(f"logp_new_BxT must be [B, T], got {logp_new_BxT.shape}")
  if mask_BxT.shape != logp_new_BxT.shape:
    raise ValueError(f"mask_BxT shape {mask_BxT.shape} != logp_new_BxT shape "
                     f"{logp_new_BxT.shape}")
  if advantages_B.shape != logp_new_BxT.shape[:1]:
    raise ValueError(f"advantages_B must be shaped [{logp_new_BxT.shape[0]}], got "
                     f"{advantages_B.shape}")
  for name, x in optional.items():
    if x is not None and x.shape != logp_new_BxT.shape:
      raise ValueError(f"{name} shape {x.shape} != logp_new_BxT shape {logp_new_BxT.shape}")


@register_loss("ppo_clip")
def ppo_clip_loss(logp_new_BxT: jax.Array, logp_old_BxT: jax.Array | None,
                  advantages_B: jax.Array, mask_BxT: jax.Array, *,
                  config: PolicyLossConfig = PolicyLossConfig(),
                  logp_ref_BxT: jax.Array | None = None,
                  logp_rollout_BxT: jax.Array | None = None,
                  entropy_BxT: jax.Array | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO/GRPO/DAPO clipped surrogate with optional KL-to-reference, TIS and entropy bonus.

  Per token: pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(new - old),
  optionally capped at c |A| for A < 0 (dual clip), times the stop-gradient TIS weight, plus
  beta * KL(new || ref), aggregated per `config.aggregation`.
  """
  _check_shapes(logp_new_BxT, advantages_B, mask_BxT, logp_old_BxT=logp_old_BxT,
                logp_ref_BxT=logp_ref_BxT, logp_rollout_BxT=logp_rollout_BxT,
                entropy_BxT=entropy_BxT)
  if config.kl_beta > 0 and logp_ref_BxT is None:
    raise ValueError("ppo_clip_loss: config.kl_beta > 0 needs logp_ref_BxT")
  mask_BxT = mask_BxT.astype(jnp.float32)
  logp_new_BxT = logp_new_BxT.astype(jnp.float32)
  if logp_old_BxT is None:
    logp_old_BxT = jax.lax.stop_gradient(logp_new_BxT)
  logp_old_BxT = jax.lax.stop_gradient(logp_old_BxT.astype(jnp.float32))
  adv_Bx1 = jax.lax.stop_gradient(advantages_B.astype(jnp.float32))[:, None]

  # Zero the log-ratio on masked tokens so padding garbage cannot make inf * 0 = nan.
  log_ratio_BxT = jnp.where(mask_BxT > 0, logp_new_BxT - logp_old_BxT, 0.0)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - config.eps_low, 1.0 + config.eps_high)
  pg_BxT = jnp.maximum(-adv_Bx1 * ratio_BxT, -adv_Bx1 * clipped_BxT)
  if config.dual_clip_c is not None:
    pg_BxT = jnp.where(adv_Bx1 < 0, jnp.minimum(pg_BxT, -adv_Bx1 * config.dual_clip_c), pg_BxT)

  metrics = {}
  if logp_rollout_BxT is not None:
    gap_BxT = jnp.where(mask_BxT > 0, logp_old_BxT - logp_rollout_BxT.astype(jnp.float32), 0.0)
    w_BxT = jnp.exp(jnp.clip(gap_BxT, -20.0, 20.0))
    if config.tis_cap is not None:
      metrics["is_weight_capped_frac"] = masked_mean(
          (w_BxT > config.tis_cap).astype(jnp.float32), mask_BxT)
      w_BxT = jnp.minimum(w_BxT, config.tis_cap)
    w_BxT = jax.lax.stop_gradient(w_BxT)
    pg_BxT = pg_BxT * w_BxT
    metrics["is_weight_mean"] = masked_mean(w_BxT, mask_BxT)

  loss_BxT = pg_BxT
  if logp_ref_BxT is not None:
    logp_ref_BxT = jax.lax.stop_gradient(logp_ref_BxT.astype(jnp.float32))
    ref_log_ratio_BxT = jnp.where(mask_BxT > 0, logp_new_BxT - logp_ref_BxT, 0.0)
    kl_BxT = kl_penalty(ref_log_ratio_BxT, config.kl_estimator)
    if config.kl_beta > 0:
      loss_BxT = loss_BxT + config.kl_beta * kl_BxT
    metrics["kl_ref"] = masked_mean(kl_BxT, mask_BxT)

  loss = aggregate(loss_BxT, mask_BxT, config.aggregation)
  if entropy_BxT is not None:
    entropy_BxT = jnp.where(mask_BxT > 0, entropy_BxT.astype(jnp.float32), 0.0)
    ent = aggregate(entropy_BxT, mask_BxT, config.aggregation)
    if config.entropy_coef > 0:
      loss = loss - config.entropy_coef * ent
    metrics["entropy"] = masked_mean(entropy_BxT, mask_BxT)

  pos_Bx1, neg_Bx1 = adv_Bx1 > 0, adv_Bx1 < 0
  metrics["clip_frac_high"] = masked_mean(
      (pos_Bx1 & (ratio_BxT > 1.0 + config.eps_high)).astype(jnp.float32), mask_BxT)
  metrics["clip_frac_low"] = masked_mean(
      (neg_Bx1 & (ratio_BxT < 1.0 - config.eps_low)).astype(jnp.float32), mask_BxT)
  # k3 estimate of KL(old || new) on tokens sampled from old: (r - 1) - log r.
  metrics["approx_kl"] = masked_mean(ratio_BxT - 1.0 - log_ratio_BxT, mask_BxT)
  metrics["pg_loss"] = aggregate(pg_BxT, mask_BxT, config.aggregation)
  metrics["ratio_mean"] = masked_mean(ratio_BxT, mask_BxT)
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return loss, metrics
