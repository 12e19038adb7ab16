"""The GRPO training loop: rollout -> reward -> advantage -> clipped policy update, resumable.

One readable loop (`run`) over small pieces defined above it. Per step:

  1. rollout   next prompts x G samples through the `RolloutEngine` (HistoSpec drafts from the
               previous epoch's responses when `--spec=histospec`); every finished group goes
               into the history store, so the next visit of the prompt drafts from it.
  2. reward    decoded responses scored by the task's reward; optional DAPO overlong penalty.
  3. advantage group-normalised (registry: grpo / rloo); with dynamic sampling, groups whose
               rewards are all equal are dropped and refilled from the next prompts.
  4. logprob   old (trainer) log-probs when there are several optimisation epochs, reference
               log-probs when kl_beta > 0. The engine's own log-probs are the rollout log-probs
               of the importance correction.
  5. train     `ppo_epochs` optimiser updates, each accumulating gradients over micro-batches
               inside one jitted, mesh-sharded step.
  6. the engine gets the new weights; metrics, checkpoint, periodic greedy evaluation.

Sequence layout of the train step: per sample [prompt, response] right-padded to a static
length L from a few buckets; positions = arange(L); the logits at t score token t + 1; the loss
mask covers response tokens. No KV cache: one causal forward.

Determinism: request ids are a function of (step, rollout round, prompt index, sample index),
and the engine's sampling keys of (seed, request id, position), so a resumed run samples the
same tokens as one that never stopped. The data iterator state, parameters, optimiser state and
history store ride in the checkpoint; the RNG "state" is the seed itself.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging as absl_logging
from flax import nnx

from rhyme_jax import checkpoint as ckpt_lib
from rhyme_jax import metrics as metrics_lib
from rhyme_jax import parallel
from rhyme_jax.config import RESUMABLE_CHANGES, Config, ConfigError, ids_per_step
from rhyme_jax.data.datasets import Example, load_dataset
from rhyme_jax.data.pipeline import PromptPipeline
from rhyme_jax.data.prompts import get_prompt_template, render_prompt
from rhyme_jax.history.drafter import HistoryDrafter
from rhyme_jax.history.store import HistoryStore, prompt_key
from rhyme_jax.models.loading import load_model
from rhyme_jax.models.tokenizer import load_tokenizer
from rhyme_jax.rl import losses
from rhyme_jax.rl.advantages import get_advantage
from rhyme_jax.rl.rewards import get_reward_fn
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams, needs_filtering

ARITHMETIC_TRAIN_SIZE = 2000  # problems generated when --train_size=0
ARITHMETIC_TEST_SIZE = 200  # held-out problems (fixed: the train split excludes them)


# ----------------------------------------------------------------------------------------------
# Data.


@dataclasses.dataclass
class Prompt:
  """One example ready for the engine."""

  example: Example
  text: str
  tokens: np.ndarray  # int32
  key: str  # history-store key (hash of the tokens)
  epoch: int


def load_examples(config: Config, split: str) -> list[Example]:
  """Train or eval examples for the configured task (errors name the file and line)."""
  d = config.data
  path = d.dataset if split == "train" else d.eval_dataset
  if path:
    examples = load_dataset(path)
  elif d.task == "arithmetic":
    n = d.train_size or ARITHMETIC_TRAIN_SIZE
    examples = load_dataset("arithmetic", split, num_train=n, num_test=ARITHMETIC_TEST_SIZE,
                            seed=0)
  else:
    examples = load_dataset("gsm8k", split, data_dir=d.data_dir or None)
  if split == "train" and d.train_size:
    examples = examples[:d.train_size]
  return examples


def encode_prompts(texts: Sequence[str], examples: Sequence[Example], epochs: Sequence[int],
                   tokenizer, max_prompt_len: int) -> list[Prompt]:
  out = []
  for text, ex, epoch in zip(texts, examples, epochs):
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    if len(tokens) > max_prompt_len:
      raise ValueError(f"example {ex.uid}: prompt has {len(tokens)} tokens, more than "
                       f"--max_prompt_len={max_prompt_len}")
    if len(tokens) == 0:
      raise ValueError(f"example {ex.uid}: prompt encodes to no tokens")
    out.append(Prompt(ex, text, tokens, prompt_key(tokens), epoch))
  return out


# ----------------------------------------------------------------------------------------------
# Sequence layout.


def length_buckets(max_total: int, smallest: int = 64) -> tuple[int, ...]:
  """Static sequence lengths: powers of two from `smallest` below `max_total`, then it."""
  sizes, n = [], smallest
  while n < max_total:
    sizes.append(n)
    n *= 2
  return tuple(sizes) + (max_total,)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"sequence of {n} tokens exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class Sample:
  prompt: Prompt
  tokens: np.ndarray  # response, int32
  logprobs: np.ndarray  # engine (rollout) log-probs, float32
  finish_reason: str
  reward: float = 0.0
  correct: float | None = None
  text: str = ""


def pack_batch(groups: Sequence[Sequence[Sample]], advantages: np.ndarray, num_rows: int,
               buckets: Sequence[int]) -> dict[str, np.ndarray]:
  """Right-padded [prompt, response] rows; rows past the samples are empty (mask 0).

  tokens_BxL are the model inputs; targets_BxL[:, t] = tokens_BxL[:, t + 1] is what the logits
  at t score; mask_BxL is 1 where that target is a response token.
  """
  samples = [s for g in groups for s in g]
  need = max((len(s.prompt.tokens) + len(s.tokens) for s in samples), default=1)
  length = pick_bucket(need, buckets)
  tokens = np.zeros((num_rows, length), np.int32)
  targets = np.zeros((num_rows, length), np.int32)
  mask = np.zeros((num_rows, length), np.float32)
  rollout = np.zeros((num_rows, length), np.float32)
  adv = np.zeros((num_rows,), np.float32)
  for i, s in enumerate(samples):
    p, r = len(s.prompt.tokens), len(s.tokens)
    seq = np.concatenate([s.prompt.tokens, s.tokens])
    tokens[i, :p + r] = seq
    targets[i, :p + r - 1] = seq[1:]
    mask[i, p - 1:p + r - 1] = 1.0
    rollout[i, p - 1:p + r - 1] = s.logprobs
    adv[i] = advantages[i]
  return dict(tokens=tokens, targets=targets, mask=mask, rollout=rollout, adv=adv)


# ----------------------------------------------------------------------------------------------
# Jitted pieces.


def make_optimizer(config: Config) -> optax.GradientTransformation:
  rl = config.rl
  if rl.warmup_steps:
    lr = optax.warmup_constant_schedule(0.0, rl.learning_rate, rl.warmup_steps * rl.ppo_epochs)
  else:
    lr = rl.learning_rate
  parts = []
  if rl.max_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(rl.max_grad_norm))
  parts.append(optax.adamw(lr, weight_decay=rl.weight_decay))
  return optax.chain(*parts)


def optimizer_shardings(abstract_opt_state, mesh, cfg):
  """Optimiser moments sharded like the parameters they mirror (the same path rules);
  scalars (step counts) replicated."""
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def one(path, x):
    if not x.ndim:
      return rep
    spec = parallel.spec_for(parallel.path_str(path), x.shape, mesh, cfg)
    return jax.sharding.NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def _forward_logprobs(graphdef, params, tokens_BxL, targets_BxL, temperature):
  model = nnx.merge(graphdef, params)
  positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
  logits_BxLxV = model(tokens_BxL, positions_BxL).logits_BxTxV
  return (losses.token_logprobs(logits_BxLxV, targets_BxL, temperature),
          jax.lax.stop_gradient(losses.entropy(logits_BxLxV, temperature)))


def logprob_step(graphdef, temperature, params, tokens_BxL, targets_BxL):
  """Trainer log-probs of the targets (no gradient)."""
  return _forward_logprobs(graphdef, params, tokens_BxL, targets_BxL, temperature)[0]


def update_step(graphdef, tx, loss_cfg: losses.PolicyLossConfig, temperature: float,
               num_micro: int, params, opt_state, batch):
  """One optimiser update; gradients are averaged over `num_micro` micro-batches (lax.scan)."""
  loss_fn = losses.get_loss("ppo_clip")

  def micro_loss(p, mb):
    logp_BxL, ent_BxL = _forward_logprobs(graphdef, p, mb["tokens"], mb["targets"], temperature)
    return loss_fn(logp_BxL, mb.get("old"), mb["adv"], mb["mask"], config=loss_cfg,
                   logp_ref_BxT=mb.get("ref"), logp_rollout_BxT=mb.get("rollout"),
                   entropy_BxT=ent_BxL)

  # Rows i, i + M, i + 2M, ... form micro-batch i: each keeps the batch sharding of its rows.
  micro = jax.tree.map(
      lambda x: jnp.moveaxis(x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:]), 1, 0),
      batch)
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def body(acc, mb):
    (loss, mets), grads = grad_fn(params, mb)
    acc = jax.tree.map(jnp.add, acc, (grads, loss, mets))
    return acc, None

  zeros = jax.tree.map(jnp.zeros_like, params)
  mets0 = jax.eval_shape(lambda: micro_loss(params, jax.tree.map(lambda x: x[0], micro))[1])
  mets0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mets0)
  (grads, loss, mets), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0), mets0), micro)
  grads = jax.tree.map(lambda g: g / num_micro, grads)
  mets = {k: v / num_micro for k, v in mets.items()}
  mets["loss"] = loss / num_micro
  mets["grad_norm"] = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, mets


# ----------------------------------------------------------------------------------------------
# The trainer.


def _rows_hash(prompts: Sequence[Prompt]) -> str:
  return hashlib.sha1(",".join(p.example.uid for p in prompts).encode()).hexdigest()[:12]


def accuracy_of(components) -> float | None:
  """The correctness component of a reward ('correct' or 'x/correct'), if it has one."""
  for k, v in components.items():
    if k == "correct" or k.endswith("/correct"):
      return float(v)
  return None


class Trainer:
  """Holds the run's state; `run()` is the loop. Built from a validated Config."""

  def __init__(self, config: Config):
    self.config = config
    c = config
    try:
      self.reward_fn = get_reward_fn(c.reward_name)
    except ValueError as e:
      raise ConfigError(f"--reward={c.reward_name}: {e}") from e
    parallel.maybe_initialize_distributed()
    self.mesh = parallel.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)

    # Everything that can fail on bad input happens before the run directory is touched,
    # cheapest checks first.
    self.train_examples = load_examples(c, "train")
    self.eval_examples = load_examples(c, "test")[:c.run.eval_size] if c.run.eval_every else []
    if (Path(c.run.run_dir) / ckpt_lib.RUN_CONFIG_FILE).exists():
      ckpt_lib.check_run_config(c.run.run_dir, c, allow_changed=RESUMABLE_CHANGES)
    self.tokenizer = load_tokenizer(c.model.tokenizer or c.model.model)
    self.template = get_prompt_template(c.data.task)
    self.pipeline = PromptPipeline(self.train_examples, batch_size=c.rl.prompts_per_step,
                                   seed=c.run.seed, render_fn=self._render,
                                   template=self.template)
    ckpt_lib.ensure_run_config(c.run.run_dir, c, allow_changed=RESUMABLE_CHANGES)

    dtype = None if c.model.param_dtype == "float32" else jnp.bfloat16
    model, self.model_config = load_model(c.model.model, param_dtype=dtype, mesh=self.mesh)
    if self.tokenizer.vocab_size > self.model_config.vocab_size:
      raise ValueError(f"--tokenizer: vocabulary of {self.tokenizer.vocab_size} tokens is larger "
                       f"than the model's ({self.model_config.vocab_size})")
    self.graphdef, self.params = nnx.split(model)
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if c.rl.kl_beta > 0 else None)
    self.tx = make_optimizer(c)
    self.opt_state = jax.jit(self.tx.init, out_shardings=optimizer_shardings(
        jax.eval_shape(self.tx.init, self.params), self.mesh, self.model_config))(self.params)

    self.store = HistoryStore() if c.rollout.spec == "histospec" else None
    self.drafter = (HistoryDrafter(self.store, max_budget=c.rollout.draft_budget)
                    if self.store is not None else None)
    b = c.rl.samples_per_step
    engine_buckets = sorted({b} | {2**k for k in range(b.bit_length()) if 2**k < b},
                            reverse=True)
    self.engine = RolloutEngine(model, EngineConfig(
        max_len=c.rollout.max_prompt_len + c.rollout.max_new_tokens,
        buckets=tuple(engine_buckets), max_draft=c.rollout.draft_budget if self.drafter else 0,
        prefill_chunk=c.rollout.prefill_chunk, draft_mode=c.rollout.draft_mode,
        eos_ids=tuple(self.tokenizer.stop_ids), seed=c.run.seed), self.drafter)
    self.sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                   top_k=c.rollout.top_k, max_new_tokens=c.rollout.max_new_tokens)
    self.buckets = length_buckets(c.rollout.max_prompt_len + c.rollout.max_new_tokens)
    self.micro = c.rl.micro_batch_size or b
    self._compile()
    # Every rollout shape (buckets x draft budgets, prefill, slot moves) compiles here, once:
    # for training sampling and, if it differs, for greedy evaluation.
    t0 = time.perf_counter()
    for filters in {needs_filtering([self.sampling]), False}:
      self.engine.warmup(filters=filters)
    absl_logging.info("rollout engine compiled in %.1fs", time.perf_counter() - t0)
    self.checkpointer = ckpt_lib.RunCheckpointer(c.run.run_dir, keep_last=c.run.keep_checkpoints,
                                                 save_every=c.run.checkpoint_every)
    self.step = 0
    self.data_iter = iter(self.pipeline)
    self._restore()

  def _render(self, messages):
    return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)

  def _compile(self):
    c = self.config
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding if x.ndim else rep, tree)
    self.loss_cfg = losses.PolicyLossConfig(
        eps_low=c.rl.clip_eps_low, eps_high=c.rl.clip_eps_high,
        aggregation=c.rl.loss_aggregation, kl_beta=c.rl.kl_beta,
        kl_estimator=c.rl.kl_estimator, tis_cap=c.rl.tis_cap or None)
    num_micro = c.rl.samples_per_step // self.micro
    self._train = jax.jit(
        functools.partial(update_step, self.graphdef, self.tx, self.loss_cfg,
                          c.rollout.temperature, num_micro),
        donate_argnums=(0, 1),
        out_shardings=(shardings(self.params), shardings(self.opt_state), None))
    self._logprobs = jax.jit(functools.partial(logprob_step, self.graphdef,
                                               c.rollout.temperature))

  # ---- checkpoints -------------------------------------------------------------------------

  def _host_state(self) -> dict:
    return {"data_iter": self.data_iter.get_state(), "rng": {"seed": self.config.run.seed},
            "history": self.store.state_dict() if self.store is not None else None}

  def _restore(self):
    latest = self.checkpointer.latest_step()
    if latest is None:
      return
    state = self.checkpointer.restore(latest, abstract_params=self.params,
                                      abstract_opt_state=self.opt_state)
    self.params, self.opt_state, self.step = state.params, state.opt_state, state.step
    host = state.host_state
    self.data_iter.set_state(host["data_iter"])
    if self.store is not None and host.get("history") is not None:
      self.store.load_state_dict(host["history"])
    self.engine.update_params(nnx.merge(self.graphdef, self.params))
    print(f"resumed from {self.checkpointer.directory} at step {self.step}", file=sys.stderr)

  def save(self, force: bool = False):
    self.checkpointer.save(self.step, params=self.params, opt_state=self.opt_state,
                           host_state=self._host_state(), force=force)

  # ---- one step ----------------------------------------------------------------------------

  def _requests(self, prompts: Sequence[Prompt], base_id: int, params: SamplingParams,
                group_prefix) -> list[Request]:
    g = self.config.rl.group_size if params.temperature > 0 else 1
    return [Request(request_id=base_id + i * g + j, prompt=p.tokens, params=params,
                    group_id=(group_prefix, i), prompt_key=p.key)
            for i, p in enumerate(prompts) for j in range(g)]

  def score(self, sample: Sample) -> None:
    """Fills in a sample's text, reward and correctness."""
    sample.text = self.tokenizer.decode(sample.tokens)
    result = self.reward_fn.score(sample.text, sample.prompt.example)
    sample.reward = float(result.reward)
    sample.correct = accuracy_of(result.components)

  def score_group(self, group: Sequence[Sample]) -> None:
    """Rewards of one prompt's samples: each scored, plus the soft overlong penalty."""
    for sample in group:
      self.score(sample)
    c = self.config
    if c.rl.overlong_buffer:
      pen = losses.overlong_penalty(np.array([len(x.tokens) for x in group]),
                                    c.rollout.max_new_tokens, c.rl.overlong_buffer)
      for x, v in zip(group, np.asarray(pen)):
        x.reward += float(v)

  def rollout_round(self, round_idx: int, stats: dict) -> list[list[Sample]]:
    """Samples G responses for the next prompts; records each group in the history store."""
    c = self.config
    batch = next(self.data_iter)
    prompts = encode_prompts(batch.prompts, batch.examples, batch.epochs, self.tokenizer,
                             c.rollout.max_prompt_len)
    stats.setdefault("rows", []).extend(prompts)
    base = self.step * ids_per_step(c) + round_idx * c.rl.samples_per_step
    t0 = time.perf_counter()
    results = self.engine.generate(self._requests(prompts, base, self.sampling,
                                                  (self.step, round_idx)))
    s = self.engine.stats
    for k in ("tokens", "useful_slot_steps", "steps", "draft_time_s", "lookahead_time_s",
              "ahead_hits", "ahead_misses"):
      stats[k] = stats.get(k, 0) + getattr(s, k)
    stats["time/rollout"] = stats.get("time/rollout", 0.0) + time.perf_counter() - t0
    t0 = time.perf_counter()
    g = c.rl.group_size
    groups = []
    for i, p in enumerate(prompts):
      group = []
      for r in results[i * g:(i + 1) * g]:
        if r.finish_reason == "error":
          raise RuntimeError(f"rollout of example {p.example.uid} failed: {r.error}")
        group.append(Sample(p, r.tokens, r.logprobs, r.finish_reason))
      self.score_group(group)
      if self.drafter is not None:
        self.drafter.record_group(p.key, [x.tokens for x in group], [x.reward for x in group],
                                  epoch=p.epoch)
        self.drafter.end_group(((self.step, round_idx), i))
      groups.append(group)
    stats["time/reward"] = stats.get("time/reward", 0.0) + time.perf_counter() - t0
    return groups

  def train_on(self, groups: list[list[Sample]]) -> dict:
    """Advantages, old/ref log-probs, `ppo_epochs` updates; returns metrics."""
    c = self.config
    mets: dict[str, Any] = {}
    rewards_NxG = np.array([[s.reward for s in g] for g in groups], np.float32)
    adv = np.asarray(get_advantage(c.rl.advantage)(jnp.asarray(rewards_NxG),
                                                   normalize_std=c.rl.normalize_std)).reshape(-1)
    batch = pack_batch(groups, adv, c.rl.samples_per_step, self.buckets)
    if not c.rl.tis_cap:
      del batch["rollout"]
    mets["seq_len"] = batch["tokens"].shape[1]

    t0 = time.perf_counter()
    extra = {}
    if c.rl.ppo_epochs > 1:
      extra["old"] = self._batched_logprobs(self.params, batch)
    if self.ref_params is not None:
      extra["ref"] = self._batched_logprobs(self.ref_params, batch)
    batch.update(extra)
    mets["time/logprob"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    device_batch = parallel.shard_batch(batch, self.mesh)
    epoch_mets = []
    for _ in range(c.rl.ppo_epochs):
      self.params, self.opt_state, m = self._train(self.params, self.opt_state, device_batch)
      epoch_mets.append(m)
    epoch_mets = jax.device_get(epoch_mets)
    mets["time/train"] = time.perf_counter() - t0
    last = epoch_mets[-1]
    for k, v in last.items():
      mets[f"train/{k}"] = float(v)
    mets["train/grad_norm_first_epoch"] = float(epoch_mets[0]["grad_norm"])
    mets["kl"] = float(last.get("kl_ref", last["approx_kl"]))
    mets["entropy"] = float(last["entropy"])
    mets["clip_frac"] = float(last["clip_frac_high"] + last["clip_frac_low"])
    mets["grad_norm"] = float(last["grad_norm"])
    self.engine.update_params(nnx.merge(self.graphdef, self.params))
    return mets

  def _batched_logprobs(self, params, batch) -> np.ndarray:
    n = batch["tokens"].shape[0]
    out = []
    for i in range(0, n, self.micro):
      rows = {k: batch[k][i:i + self.micro] for k in ("tokens", "targets")}
      rows = parallel.shard_batch(rows, self.mesh)
      out.append(np.asarray(self._logprobs(params, rows["tokens"], rows["targets"])))
    return np.concatenate(out).astype(np.float32)

  def train_step(self) -> dict:
    """One full RL step; returns its metrics."""
    c = self.config
    t_step = time.perf_counter()
    stats: dict[str, Any] = {}
    kept, all_samples = [], []
    rounds = c.rl.dynamic_sampling_max_rounds if c.rl.dynamic_sampling else 1
    for r in range(rounds):
      groups = self.rollout_round(r, stats)
      all_samples += [s for g in groups for s in g]
      if c.rl.dynamic_sampling:
        groups = [g for g in groups if len({s.reward for s in g}) > 1]
      kept += groups
      if len(kept) >= c.rl.prompts_per_step:
        break
    kept = kept[:c.rl.prompts_per_step]
    m: dict[str, Any] = {}
    rewards = np.array([s.reward for s in all_samples])
    lengths = np.array([len(s.tokens) for s in all_samples])
    m["reward/mean"] = float(rewards.mean())
    m["reward/std"] = float(rewards.std())
    correct = [s.correct for s in all_samples if s.correct is not None]
    if correct:
      m["accuracy"] = float(np.mean(correct))
    m["response_length/mean"] = float(lengths.mean())
    m["response_length/max"] = int(lengths.max())
    # Fingerprint of every sampled token: equal across runs iff they sampled the same tokens
    # (e.g. --spec=histospec vs --spec=none with the same seed).
    sampled = b"".join(np.asarray(x.tokens, np.int32).tobytes() for x in all_samples)
    m["rollout/tokens_crc32"] = f"{zlib.crc32(sampled):08x}"
    m["response_length/truncated_frac"] = float(np.mean(
        [s.finish_reason == "length" for s in all_samples]))
    m["rollout/rounds"] = len(stats["rows"]) // c.rl.prompts_per_step
    m["rollout/groups_kept"] = len(kept)
    m["rollout/tokens_per_s"] = stats["tokens"] / max(stats["time/rollout"], 1e-9)
    m["rollout/mean_accepted_length"] = stats["tokens"] / max(stats["useful_slot_steps"], 1)
    m["rollout/forwards_per_token"] = stats["steps"] / max(stats["tokens"], 1)
    # Host drafting per decode step: on the critical path, and in the background (overlapped).
    m["time/draft_ms_per_step"] = 1e3 * stats["draft_time_s"] / max(stats["steps"], 1)
    m["time/lookahead_ms_per_step"] = 1e3 * stats["lookahead_time_s"] / max(stats["steps"], 1)
    m["rollout/ahead_hit_rate"] = stats["ahead_hits"] / max(
        stats["ahead_hits"] + stats["ahead_misses"], 1)
    m["time/rollout"] = stats["time/rollout"]
    m["time/reward"] = stats["time/reward"]
    rows = stats["rows"]
    m["data/epoch"] = int(max(p.epoch for p in rows))
    m["data/batch_hash"] = _rows_hash(rows)
    if kept:
      m.update(self.train_on(kept))
    else:  # dynamic sampling found no informative group: nothing to learn from this step
      m.update({"time/logprob": 0.0, "time/train": 0.0})
    m["time/step"] = time.perf_counter() - t_step
    return m

  # ---- evaluation --------------------------------------------------------------------------

  def evaluate(self) -> dict:
    """Greedy decoding on the held-out examples: mean reward and accuracy."""
    t0 = time.perf_counter()
    texts = [render_prompt(e, self._render, self.template) for e in self.eval_examples]
    prompts = encode_prompts(texts, self.eval_examples, [0] * len(texts), self.tokenizer,
                             self.config.rollout.max_prompt_len)
    greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0, top_k=0)
    results = self.engine.generate(self._requests(prompts, 0, greedy, ("eval", self.step)))
    samples = [Sample(p, r.tokens, r.logprobs, r.finish_reason) for p, r in zip(prompts, results)]
    for s in samples:
      self.score(s)
    if self.drafter is not None:
      for i in range(len(prompts)):
        self.drafter.end_group((("eval", self.step), i))
    out = {"eval/reward": float(np.mean([s.reward for s in samples])),
           "eval/response_length": float(np.mean([len(s.tokens) for s in samples])),
           "time/eval": time.perf_counter() - t0}
    correct = [s.correct for s in samples if s.correct is not None]
    if correct:
      out["eval/accuracy"] = float(np.mean(correct))
    return out

  # ---- the loop ----------------------------------------------------------------------------

  def run(self) -> list[dict]:
    c = self.config
    start = self.step
    writer = metrics_lib.MetricsWriter(c.run.run_dir, resume_step=start if start else None,
                                       enabled=jax.process_index() == 0)
    progress = metrics_lib.Progress(c.run.num_steps, start_step=start,
                                    keys=("reward/mean", "accuracy", "eval/accuracy",
                                          "rollout/mean_accepted_length", "time/step"))
    history = []
    try:
      while self.step < c.run.num_steps:
        self.step += 1
        m = self.train_step()
        if c.run.eval_every and self.step % c.run.eval_every == 0:
          m.update(self.evaluate())
        writer.write(self.step, m)
        history.append(m)
        self.save(force=self.step == c.run.num_steps)
        if self.step % c.run.log_every == 0 or self.step == c.run.num_steps:
          progress.update(self.step, m)
    finally:
      progress.close()
      writer.close()
      self.checkpointer.close()
    return history


def run(config: Config) -> list[dict]:
  """Trains per `config`, resuming from the run directory's latest checkpoint when present."""
  return Trainer(config).run()
