"""The learner: optimiser, the jitted update step and the state it updates.

`update_step` is a pure function `(params, opt_state, batch) -> (params, opt_state, metrics)`
that averages gradients over micro-batches inside one jit (lax.scan), with the parameters and
optimiser moments sharded by the model's partition rules. `Learner` owns that state (plus the
frozen reference parameters when a KL penalty is on) and turns scored sample groups into
`ppo_epochs` updates: advantages -> packed batch -> old / reference log-probs -> updates.

With several processes each passes its own groups: they are its rows of the global batch
(`parallel.shard_batch`), packed to the row length the longest row of any host needs, so every
process runs the same program.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rhyme_jax import multihost, parallel
from rhyme_jax.config import Config
from rhyme_jax.models import sharding
from rhyme_jax.rl import losses
from rhyme_jax.rl.advantages import get_advantage
from rhyme_jax.rl.samples import Sample, batch_tokens, length_buckets, pack_batch


class MasterWeights(NamedTuple):
  """The optimiser state of `with_master_weights`: the inner one and the float32 copies."""
  inner: Any
  master: Any


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` run on float32 master copies of low-precision (bfloat16) parameters.

  An AdamW step is about the learning rate (1e-6 by default), far below a bfloat16 weight's
  resolution (2**-8 of it): applied to the bfloat16 weights it rounds away and the run trains
  without moving them. The masters accumulate the steps (and hold the moments' inputs in
  float32); the update returned takes each parameter to its master's rounding (as float32, so
  `optax.apply_updates` lands on it exactly)."""

  def init(params):
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return MasterWeights(tx.init(master), master)

  def update(grads, state, params=None):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner = tx.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, updates)
    to_master = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(jnp.float32)
                             - p.astype(jnp.float32), master, params)
    return to_master, MasterWeights(inner, master)

  return optax.GradientTransformation(init, update)


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW, optional linear warm-up (counted in optimiser updates) and global-norm clipping;
  with bfloat16 parameters (--param_dtype) over float32 master weights (`with_master_weights`)."""
  rl = config.rl
  if rl.warmup_steps:
    lr = optax.warmup_constant_schedule(0.0, rl.learning_rate, rl.warmup_steps * rl.ppo_epochs)
  else:
    lr = rl.learning_rate
  parts = []
  if rl.max_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(rl.max_grad_norm))
  parts.append(optax.adamw(lr, weight_decay=rl.weight_decay))
  tx = optax.chain(*parts)
  return tx if config.model.param_dtype == "float32" else with_master_weights(tx)


def optimizer_shardings(abstract_opt_state, mesh, model_config):
  """Optimiser moments sharded like the parameters they mirror (the same path rules);
  scalars (step counts) replicated."""
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def one(path, x):
    if not x.ndim:
      return rep
    spec = sharding.spec_for(parallel.path_str(path), x.shape, mesh, model_config)
    return jax.sharding.NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def loss_config(config: Config) -> losses.PolicyLossConfig:
  rl = config.rl
  return losses.PolicyLossConfig(
      eps_low=rl.clip_eps_low, eps_high=rl.clip_eps_high, aggregation=rl.loss_aggregation,
      kl_beta=rl.kl_beta, kl_estimator=rl.kl_estimator, tis_cap=rl.tis_cap or None)


# --remat: positions per chunk of the loss head (rl/memory.py counts its working set)
HEAD_CHUNK = 128


def _forward_logprobs(graphdef, params, tokens_BxT, targets_BxT, temperature, remat=False,
                      head_chunk=HEAD_CHUNK):
  """(log-probs of the targets, entropies), float32 [B, T]. With `remat` the layers are
  recomputed in the backward pass and so is the head, `head_chunk` positions at a time
  (`_chunked_head`): the float32 B x T x V logits, their log-softmax and its gradient, which
  otherwise outweigh everything a rematerialised gradient keeps, never live at once."""
  model = nnx.merge(graphdef, params)
  positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
  # The entropy keeps its gradient: a loss with an entropy bonus (entropy_coef > 0) needs it,
  # and one without only reports it (metrics carry no gradient).
  if remat:
    hidden_BxTxD, _ = model.trunk(tokens_BxT, positions_BxT, remat=True)
    return _chunked_head(model, hidden_BxTxD, targets_BxT, temperature, head_chunk)
  logits_BxTxV = model(tokens_BxT, positions_BxT).logits_BxTxV
  return (losses.token_logprobs(logits_BxTxV, targets_BxT, temperature),
          losses.entropy(logits_BxTxV, temperature))


def _chunked_head(model, hidden_BxTxD, targets_BxT, temperature, chunk):
  """The head's log-probs and entropies over T in chunks of `chunk` positions (at most T; T
  padded to a multiple, the padding's values dropped): a lax.map (a scan) over a `jax.checkpoint`ed
  pure function of the model's state, so the backward pass recomputes one chunk's logits at a
  time and keeps only each chunk's B x chunk x D input."""
  b, t, d = hidden_BxTxD.shape
  chunk = min(chunk, t)
  n = -(-t // chunk)
  pad = n * chunk - t
  hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  hidden_NxBxCxD = jnp.moveaxis(hidden_BxTxD.reshape(b, n, chunk, d), 1, 0)
  targets_NxBxC = jnp.moveaxis(targets_BxT.reshape(b, n, chunk), 1, 0)
  graphdef, state = nnx.split(model)
  # The head's weights enter the scan in float32: their gradient sums over the chunks in the
  # scan's float32 carry, not in a bfloat16 one rounded once per chunk (the matmul still runs
  # in the model's compute dtype)
  head_name = "embed" if model.cfg.tie_word_embeddings else "lm_head"
  state[head_name] = jax.tree.map(lambda x: x.astype(jnp.float32), state[head_name])

  @jax.checkpoint
  def head(state, hidden_BxCxD, targets_BxC):
    logits_BxCxV = nnx.merge(graphdef, state).logits(hidden_BxCxD)
    return (losses.token_logprobs(logits_BxCxV, targets_BxC, temperature),
            losses.entropy(logits_BxCxV, temperature))

  logp_NxBxC, ent_NxBxC = jax.lax.map(lambda xs: head(state, *xs),
                                      (hidden_NxBxCxD, targets_NxBxC))
  unchunk = lambda x_NxBxC: jnp.moveaxis(x_NxBxC, 0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp_NxBxC), unchunk(ent_NxBxC)


def logprob_step(graphdef, temperature, params, tokens_BxT, targets_BxT, remat=False):
  """Trainer log-probs of the targets (no gradient); with `remat` (--remat) the head runs
  in chunks here too, so the old / reference pass never holds the whole B x T x V logits."""
  return _forward_logprobs(graphdef, params, tokens_BxT, targets_BxT, temperature, remat)[0]


def micro_weights(mask_MxRxT: jax.Array, aggregation: str) -> tuple[jax.Array, jax.Array]:
  """Each micro-batch's share of what the loss averages over ([M]: valid tokens for
  'token-mean', sequences with a valid token for 'seq-mean-token-mean') and of the valid
  tokens ([M], for token-mean metrics); all zero for a batch without valid tokens."""
  mask_MxRxT = mask_MxRxT.astype(jnp.float32)
  tokens_M = jnp.sum(mask_MxRxT, axis=(1, 2))
  if aggregation == "token-mean":
    counts_M = tokens_M
  else:
    counts_M = jnp.sum(jnp.sum(mask_MxRxT, axis=2) > 0, axis=1).astype(jnp.float32)
  share = lambda n_M: n_M / jnp.maximum(jnp.sum(n_M), 1.0)
  return share(counts_M), share(tokens_M)


def update_step(graphdef, tx, loss_name: str, loss_cfg: losses.PolicyLossConfig,
                temperature: float, num_micro: int, params, opt_state, batch, *, remat=False):
  """One optimiser update over `num_micro` micro-batches (lax.scan), each weighted by its
  share of what the loss averages over (`micro_weights`): the whole batch's gradient.
  `remat` (--remat): each layer's activations are recomputed in the backward pass."""
  loss_fn = losses.get_loss(loss_name)

  def micro_loss(p, mb):
    logp_BxT, ent_BxT = _forward_logprobs(graphdef, p, mb["tokens"], mb["targets"], temperature,
                                          remat)
    return loss_fn(logp_BxT, mb.get("old"), mb["adv"], mb["mask"], config=loss_cfg,
                   logp_ref_BxT=mb.get("ref"), logp_rollout_BxT=mb.get("rollout"),
                   entropy_BxT=ent_BxT)

  # Rows i, i + M, i + 2M, ... form micro-batch i: each keeps the batch sharding of its rows.
  micro = jax.tree.map(
      lambda x: jnp.moveaxis(x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:]), 1, 0),
      batch)
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  # A micro-batch's loss is a mean over its own tokens (token-mean) or sequences: weighted by
  # its share of the batch's, the sum is the whole batch's loss and gradient, whatever the
  # lengths and empty rows. Metrics are token-means: weighted by tokens.
  weight_M, token_weight_M = micro_weights(micro["mask"], loss_cfg.aggregation)

  def body(acc, xs):
    mb, w, tw = xs
    (loss, mets), grads = grad_fn(params, mb)
    scaled = (jax.tree.map(lambda g: w * g.astype(jnp.float32), grads), w * loss,
              jax.tree.map(lambda m: tw * m, mets))
    return jax.tree.map(jnp.add, acc, scaled), None

  # Gradients sum over micro-batches in float32, whatever the parameters' dtype.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  mets0 = jax.eval_shape(lambda: micro_loss(params, jax.tree.map(lambda x: x[0], micro))[1])
  mets0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mets0)
  (grads, loss, mets), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0), mets0),
                                        (micro, weight_M, token_weight_M))
  mets["loss"] = loss
  mets["grad_norm"] = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, mets


class Learner:
  """Parameters, optimiser state and the compiled update / log-prob steps of one run."""

  def __init__(self, config: Config, model: nnx.Module, mesh, model_config):
    c = config
    self.config = config
    self.mesh = mesh
    self.graphdef, self.params = nnx.split(model)
    self.ref_params = jax.tree.map(jnp.copy, self.params) if c.rl.kl_beta > 0 else None
    self.tx = make_optimizer(c)
    self.opt_state = jax.jit(self.tx.init, out_shardings=optimizer_shardings(
        jax.eval_shape(self.tx.init, self.params), mesh, model_config))(self.params)
    self.buckets = length_buckets(c.rollout.max_prompt_len + c.rollout.max_new_tokens)
    self.num_rows = c.rl.samples_per_step
    self.micro = c.rl.micro_batch_size or self.num_rows
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding if x.ndim else rep, tree)
    self._update = jax.jit(
        functools.partial(update_step, self.graphdef, self.tx, c.rl.loss, loss_config(c),
                          c.rollout.temperature, self.num_rows // self.micro,
                          remat=c.rl.remat),
        donate_argnums=(0, 1),
        out_shardings=(shardings(self.params), shardings(self.opt_state), None))
    self._logprobs = jax.jit(functools.partial(logprob_step, self.graphdef,
                                               c.rollout.temperature, remat=c.rl.remat),
                             out_shardings=jax.sharding.NamedSharding(mesh, parallel.fit_spec(
                                 parallel.batch_spec(), (self.micro * jax.process_count(), 1),
                                 mesh)))

  def model(self) -> nnx.Module:
    """The current policy as a module (shares the parameter arrays)."""
    return nnx.merge(self.graphdef, self.params)

  def logprobs(self, params, batch) -> np.ndarray:
    """Log-probs of `batch`'s targets (this process's rows) under `params`, micro-batch by
    micro-batch."""
    out = []
    for i in range(0, batch["tokens"].shape[0], self.micro):
      rows = {k: batch[k][i:i + self.micro] for k in ("tokens", "targets")}
      rows = parallel.shard_batch(rows, self.mesh)
      out.append(parallel.host_rows(self._logprobs(params, rows["tokens"], rows["targets"])))
    return np.concatenate(out).astype(np.float32)

  def train_on(self, groups: Sequence[Sequence[Sample]]) -> dict[str, Any]:
    """Advantages, old/ref log-probs, `ppo_epochs` updates of scored groups (this process's;
    every process calls it, possibly with none); returns metrics."""
    c = self.config
    mets: dict[str, Any] = {}
    # One row per prompt, one column per sample of its group.
    rewards = np.array([[s.reward for s in g] for g in groups], np.float32)
    adv_B = (np.asarray(get_advantage(c.rl.advantage)(
        jnp.asarray(rewards), normalize_std=c.rl.normalize_std)).reshape(-1) if groups
             else np.zeros(0, np.float32))
    longest = multihost.max_over_processes(batch_tokens(groups))
    batch = pack_batch(groups, adv_B, self.num_rows, self.buckets, min_tokens=longest)
    if not c.rl.tis_cap:
      del batch["rollout"]
    mets["seq_len"] = batch["tokens"].shape[1]

    t0 = time.perf_counter()
    extra = {}
    if c.rl.ppo_epochs > 1:
      extra["old"] = self.logprobs(self.params, batch)
    if self.ref_params is not None:
      extra["ref"] = self.logprobs(self.ref_params, batch)
    batch.update(extra)
    mets["time/logprob"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    device_batch = parallel.shard_batch(batch, self.mesh)
    epoch_mets = []
    for _ in range(c.rl.ppo_epochs):
      self.params, self.opt_state, m = self._update(self.params, self.opt_state, device_batch)
      epoch_mets.append(m)
    epoch_mets = jax.device_get(epoch_mets)
    mets["time/train"] = time.perf_counter() - t0
    last = epoch_mets[-1]
    mets.update({f"train/{k}": float(v) for k, v in last.items()})
    mets["train/grad_norm_first_epoch"] = float(epoch_mets[0]["grad_norm"])
    mets["kl"] = float(last.get("kl_ref", last["approx_kl"]))
    mets["entropy"] = float(last["entropy"])
    mets["clip_frac"] = float(last["clip_frac_high"] + last["clip_frac_low"])
    mets["grad_norm"] = float(last["grad_norm"])
    return mets
