"""Policy losses and log-prob helpers against plain-loop NumPy reimplementations."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rl import losses
from rhyme_jax.rl.losses import PolicyLossConfig


def _ref_loss(new, old, ref, rollout, ent, adv, mask, cfg):
  """Token-by-token loop reference of ppo_clip_loss in float64; returns (loss, metrics)."""
  f64 = lambda x: None if x is None else np.asarray(x, np.float64)
  new, old, ref, rollout, ent, adv = map(f64, (new, old, ref, rollout, ent, adv))
  b_size, t_size = new.shape
  per_token = np.zeros((b_size, t_size))
  pg_tok = np.zeros((b_size, t_size))
  kl_tok = np.zeros((b_size, t_size))
  ratio_tok = np.ones((b_size, t_size))
  w_tok = np.ones((b_size, t_size))
  capped = np.zeros((b_size, t_size))
  for b in range(b_size):
    for t in range(t_size):
      if not mask[b, t]:
        continue
      a = adv[b]
      r = math.exp(new[b, t] - old[b, t])
      ratio_tok[b, t] = r
      rc = min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high)
      pg = max(-a * r, -a * rc)
      if cfg.dual_clip_c is not None and a < 0:
        pg = min(pg, -a * cfg.dual_clip_c)
      if rollout is not None:
        w = math.exp(old[b, t] - rollout[b, t])
        if cfg.tis_cap is not None:
          capped[b, t] = w > cfg.tis_cap
          w = min(w, cfg.tis_cap)
        w_tok[b, t] = w
        pg *= w
      pg_tok[b, t] = pg
      total = pg
      if ref is not None:
        lr = new[b, t] - ref[b, t]
        kl = {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) + lr - 1}[cfg.kl_estimator]
        kl_tok[b, t] = kl
        total += cfg.kl_beta * kl
      per_token[b, t] = total

  def agg(x):
    if cfg.aggregation == "token-mean":
      num, den = 0.0, 0
      for b in range(b_size):
        for t in range(t_size):
          if mask[b, t]:
            num += x[b, t]
            den += 1
      return num / max(den, 1)
    seq_means = []
    for b in range(b_size):
      vals = [x[b, t] for t in range(t_size) if mask[b, t]]
      if vals:
        seq_means.append(sum(vals) / len(vals))
    return sum(seq_means) / max(len(seq_means), 1)

  def tok_mean(x):
    vals = [x[b, t] for b in range(b_size) for t in range(t_size) if mask[b, t]]
    return sum(vals) / max(len(vals), 1)

  loss = agg(per_token)
  metrics = {"pg_loss": agg(pg_tok), "ratio_mean": tok_mean(ratio_tok)}
  hi = np.zeros((b_size, t_size))
  lo = np.zeros((b_size, t_size))
  akl = np.zeros((b_size, t_size))
  for b in range(b_size):
    for t in range(t_size):
      r = ratio_tok[b, t]
      hi[b, t] = adv[b] > 0 and r > 1 + cfg.eps_high
      lo[b, t] = adv[b] < 0 and r < 1 - cfg.eps_low
      akl[b, t] = r - 1 - math.log(r)
  metrics["clip_frac_high"] = tok_mean(hi)
  metrics["clip_frac_low"] = tok_mean(lo)
  metrics["approx_kl"] = tok_mean(akl)
  if rollout is not None:
    metrics["is_weight_mean"] = tok_mean(w_tok)
    if cfg.tis_cap is not None:
      metrics["is_weight_capped_frac"] = tok_mean(capped)
  if ref is not None:
    metrics["kl_ref"] = tok_mean(kl_tok)
  if ent is not None:
    metrics["entropy"] = tok_mean(ent)
    loss -= cfg.entropy_coef * agg(ent)
  return loss, metrics


def _inputs(seed, b=5, t=7):
  rng = np.random.default_rng(seed)
  old = rng.normal(-1.5, 0.5, size=(b, t))
  new = old + rng.normal(0, 0.3, size=(b, t))  # Ratios spread across both clip edges.
  ref = old + rng.normal(0, 0.3, size=(b, t))
  rollout = old + rng.normal(0, 0.5, size=(b, t))  # Some weights above the TIS cap.
  ent = rng.uniform(0, 3, size=(b, t))
  adv = rng.normal(size=(b,))
  lengths = rng.integers(0, t + 1, size=(b,))
  lengths[0] = 0  # A sequence without valid tokens.
  lengths[1] = t
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  # Garbage (even -inf) on masked positions must not leak into the loss.
  new = np.where(mask > 0, new, -np.inf)
  return [x.astype(np.float32) for x in (new, old, ref, rollout, ent, adv, mask)]


CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(eps_low=0.2, eps_high=0.28, aggregation="seq-mean-token-mean"),
    PolicyLossConfig(kl_beta=0.1, kl_estimator="k3", tis_cap=None),
    PolicyLossConfig(kl_beta=0.05, kl_estimator="k1", aggregation="seq-mean-token-mean",
                     dual_clip_c=3.0, tis_cap=1.5),
    PolicyLossConfig(kl_beta=0.2, kl_estimator="k2", entropy_coef=0.01, eps_high=0.3),
]


# Every config x (reference, rollout log-probs, entropy) given or not; kl_beta > 0 requires a
# reference (that error is checked in test_errors).
CASES = [(cfg, *flags) for cfg in CONFIGS for flags in itertools.product([False, True], repeat=3)
         if flags[0] or cfg.kl_beta == 0]


@pytest.mark.parametrize("cfg,with_ref,with_rollout,with_ent", CASES)
def test_matches_numpy(cfg, with_ref, with_rollout, with_ent):
  new, old, ref, rollout, ent, adv, mask = _inputs(seed=7)
  kwargs = dict(logp_ref_BxT=ref if with_ref else None,
                logp_rollout_BxT=rollout if with_rollout else None,
                entropy_BxT=ent if with_ent else None)
  loss_fn = jax.jit(losses.get_loss("ppo_clip"), static_argnames="config")
  loss, metrics = loss_fn(new, old, adv, mask, config=cfg, **kwargs)
  want_loss, want_metrics = _ref_loss(
      new.astype(np.float64), old.astype(np.float64), ref if with_ref else None,
      rollout if with_rollout else None, ent if with_ent else None, adv, mask, cfg)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
  assert set(metrics) == set(want_metrics)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_clip_fractions_are_exercised():
  new, old, _, _, _, adv, mask = _inputs(seed=7)
  _, m = losses.ppo_clip_loss(new, old, adv, mask)
  assert 0 < float(m["clip_frac_high"]) < 1 and 0 < float(m["clip_frac_low"]) < 1


@pytest.mark.parametrize("cfg", CONFIGS[1:4])
def test_gradient_finite_and_zero_on_masked_tokens(cfg):
  new, old, ref, rollout, ent, adv, mask = _inputs(seed=3)
  new = np.where(mask > 0, new, 0.0).astype(np.float32)
  grad = jax.grad(lambda x: losses.ppo_clip_loss(
      x, old, adv, mask, config=cfg, logp_ref_BxT=ref, logp_rollout_BxT=rollout)[0])(
          jnp.asarray(new))
  grad = np.asarray(grad)
  assert np.all(np.isfinite(grad))
  assert np.all(grad[mask == 0] == 0)
  assert np.any(grad[mask > 0] != 0)
  # -inf garbage on masked positions: still finite, still zero there.
  new_inf = np.where(mask > 0, new, -np.inf).astype(np.float32)
  grad_inf = np.asarray(jax.grad(lambda x: losses.ppo_clip_loss(
      x, old, adv, mask, config=cfg, logp_ref_BxT=ref, logp_rollout_BxT=rollout)[0])(
          jnp.asarray(new_inf)))
  np.testing.assert_array_equal(grad_inf, grad)


def test_gradient_matches_finite_difference():
  new, old, ref, rollout, _, adv, mask = _inputs(seed=11, b=3, t=4)
  new = np.where(mask > 0, new, 0.0).astype(np.float64)
  cfg = PolicyLossConfig(kl_beta=0.1, aggregation="seq-mean-token-mean", tis_cap=1.5)
  with jax.enable_x64(True):
    f = lambda x: losses.ppo_clip_loss(x, old.astype(np.float64), adv, mask, config=cfg,
                                       logp_ref_BxT=ref, logp_rollout_BxT=rollout)[0]
    grad = np.asarray(jax.grad(f)(jnp.asarray(new)))
  h = 1e-6
  for b in range(new.shape[0]):
    for t in range(new.shape[1]):
      up, dn = new.copy(), new.copy()
      up[b, t] += h
      dn[b, t] -= h
      fd = (_ref_loss(up, old, ref, rollout, None, adv, mask, cfg)[0]
            - _ref_loss(dn, old, ref, rollout, None, adv, mask, cfg)[0]) / (2 * h)
      np.testing.assert_allclose(grad[b, t], fd, rtol=1e-4, atol=1e-6)


def test_on_policy_default_gives_plain_policy_gradient():
  """With old=None (one update per batch) the ratio is 1 and grad = -A * mask / count."""
  new, _, _, _, _, adv, mask = _inputs(seed=5)
  new = np.where(mask > 0, new, 0.0)
  loss, m = losses.ppo_clip_loss(jnp.asarray(new), None, adv, mask)
  grad = np.asarray(jax.grad(lambda x: losses.ppo_clip_loss(x, None, adv, mask)[0])(new))
  np.testing.assert_allclose(grad, -adv[:, None] * mask / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(m["approx_kl"]), 0.0, atol=1e-7)


def test_errors():
  new, old, ref, _, _, adv, mask = _inputs(seed=1)
  with pytest.raises(ValueError, match="kl_beta > 0 needs logp_ref_BxT"):
    losses.ppo_clip_loss(new, old, adv, mask, config=PolicyLossConfig(kl_beta=0.1))
  with pytest.raises(ValueError, match="advantages_B"):
    losses.ppo_clip_loss(new, old, adv[:2], mask)
  with pytest.raises(ValueError, match="logp_ref_BxT shape"):
    losses.ppo_clip_loss(new, old, adv, mask, logp_ref_BxT=ref[:, :2])
  with pytest.raises(ValueError, match="aggregation"):
    PolicyLossConfig(aggregation="sum")
  with pytest.raises(ValueError, match="kl_estimator"):
    PolicyLossConfig(kl_estimator="k4")
  with pytest.raises(ValueError, match="eps_low"):
    PolicyLossConfig(eps_low=1.0)
  with pytest.raises(ValueError, match="unknown loss 'nope'.*ppo_clip"):
    losses.get_loss("nope")


def _log_softmax_loop(row):
  m = max(row)
  z = m + math.log(sum(math.exp(v - m) for v in row))
  return [v - z for v in row]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_and_entropy(temperature):
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, size=(2, 3, 11)).astype(np.float32)
  targets = rng.integers(0, 11, size=(2, 3))
  ent = np.asarray(losses.entropy(logits, temperature))
  exact = np.asarray(losses.token_logprobs(logits, targets, temperature))
  for b in range(2):
    for t in range(3):
      ls = _log_softmax_loop([float(v) / temperature for v in logits[b, t]])
      np.testing.assert_allclose(exact[b, t], ls[targets[b, t]], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(ent[b, t], -sum(math.exp(v) * v for v in ls), rtol=1e-5)
  with pytest.raises(ValueError, match="temperature"):
    losses.token_logprobs(logits, targets, 0.0)


def test_overlong_penalty():
  max_len, cache = 100, 20
  lengths = np.array([0, 50, 80, 81, 90, 100, 101, 500])
  got = np.asarray(losses.overlong_penalty(lengths, max_len, cache))
  want = []
  for n in lengths:
    if n <= max_len - cache:
      want.append(0.0)
    elif n <= max_len:
      want.append(((max_len - cache) - n) / cache)
    else:
      want.append(-1.0)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ValueError, match="cache_length"):
    losses.overlong_penalty(lengths, 10, 20)
