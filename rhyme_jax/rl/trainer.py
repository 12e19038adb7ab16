"""The GRPO training loop: rollout -> reward -> advantage -> clipped policy update, resumable.

`Trainer.run` is the loop; each piece it calls lives in its own module:

  inputs.py           what the run reads, checked before anything is written (`check_inputs`)
  samples.py          prompts, samples and the train step's sequence layout
  rollouts.py         prompts x G samples through the `RolloutEngine` (HistoSpec drafts from
                      the previous epoch's responses when `--spec=histospec`; admitted in the
                      `--schedule` order, scheduling/), scored
  rewards/scoring.py  decoded responses -> reward, correctness, DAPO overlong penalty
  learner.py          advantages, old / reference log-probs, `ppo_epochs` jitted updates
  epoch_stats.py      acceptance, reward and length per data epoch (`epoch/*` metrics)

  hosts.py            what hosts exchange at a step boundary (multi-host design:
                      rhyme_jax.multihost)

Per step: rollout (with dynamic sampling, groups whose rewards are all equal are dropped and
refilled from the next prompts) -> every host's groups exchanged, recorded in the history
store -> learner update -> the engine gets the new weights -> metrics, checkpoint, periodic
greedy evaluation. With several processes (one per host) each samples its own slice of the
prompts on its own host-local engine; training is one global program.

Inputs are checked (`check_inputs`) before anything is written. Resumption: every process's
data-iterator state, parameters, optimiser state and history store ride in the checkpoint;
the RNG "state" is the seed itself (sampling keys are functions of seed, request id and
position), so a resumed run samples what an uninterrupted one would (its updates agree to
float32 rounding: rollouts.TIMING_DEPENDENT_METRICS says why). SIGTERM (to any process)
saves at the next step boundary; one during start-up stops the run before its first step.
Several processes settle on one checkpoint to restore (`restore_latest(agree=...)`) and
check at start-up that they share every flag but the host-local ones, and the data.
"""

from __future__ import annotations

import copy
import math
import operator
import signal
import sys
import threading
import time
from typing import Any

import jax
from absl import logging as absl_logging
from etils import epath
from flax import nnx

from rhyme_jax import checkpoint as ckpt_lib
from rhyme_jax import metrics as metrics_lib
from rhyme_jax import multihost, parallel
from rhyme_jax import run_config
from rhyme_jax.config import (HOST_LOCAL_FIELDS, LOCKSTEP_FIELDS, RESUMABLE_CHANGES, Config,
                              ConfigError, ids_per_step)
from rhyme_jax.data.pipeline import ORDER_VERSION, PromptPipeline, check_order_version
from rhyme_jax.data.prompts import render_prompt
from rhyme_jax.models.loading import load_model
from rhyme_jax.models.sharding import param_shardings
from rhyme_jax.rl import hosts, memory
from rhyme_jax.rl.epoch_stats import EpochStats
from rhyme_jax.rl.inputs import Inputs, check_inputs, param_dtype
from rhyme_jax.rl.learner import Learner
from rhyme_jax.rl.rewards.scoring import Scorer
from rhyme_jax.rl.rollouts import Rollouts, engine_config, eval_metrics, rollout_metrics
from rhyme_jax.rl.samples import chat_renderer, encode_prompts, length_buckets


def describe_plan(config: Config, inputs: Inputs) -> str:
  """The `--dry_run` report: mesh, shapes compiled, data and a memory estimate."""
  c, m = config, inputs.model_config
  mesh = _mesh(c)
  d, v, h = m.hidden_size, m.vocab_size, m.head_dim
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(memory.abstract_params(m)))
  est = memory.estimate(c, m, mesh)
  limit = memory.device_memory_bytes(c)
  eng = engine_config(c, inputs.tokenizer.stop_ids, c.rollout.spec == "histospec")
  s = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  n = c.rl.samples_per_step
  gib = lambda n: f"{n / 2**30:.2f} GiB"
  resumes = (epath.Path(c.run.run_dir) / run_config.RUN_CONFIG_FILE).exists()
  lines = [
      f"mesh: {dict(mesh.shape)} over {mesh.devices.size} {jax.default_backend()} device(s)",
      f"model: {c.model.model} ({m.arch}, {m.num_layers} layers, width {d}, heads "
      f"{m.num_heads}/{m.num_kv_heads}x{h}, vocab {v}, ~{num_params / 1e6:.1f}M parameters, "
      f"{c.model.param_dtype})",
      f"data: {len(inputs.train_examples)} train examples ({c.data.dataset or c.data.task}), "
      f"{len(inputs.eval_examples)} eval; {c.rl.prompts_per_step} prompts x {c.rl.group_size} "
      f"samples per step and process; {_steps_per_epoch(len(inputs.train_examples), c, inputs)}",
      f"reward: {inputs.reward_fn.name}; loss: {c.rl.loss}; advantage: {c.rl.advantage}",
      f"rollout engine: batch buckets {eng.buckets}, at most {eng.max_draft} draft nodes per "
      f"row, max length {eng.max_len}, prefill chunk {eng.prefill_chunk}, admission order "
      f"{c.rollout.schedule}",
      f"train step: sequence buckets {length_buckets(s)}, "
      f"{n // (c.rl.micro_batch_size or n)} micro-batch(es) of {c.rl.micro_batch_size or n}"
      + (", each layer recomputed in the backward pass (--remat)" if c.rl.remat else ""),
      f"memory: {est.describe()}; device memory "
      + (f"{gib(limit)}: {memory.fit_verdict(est, limit)}" if limit
         else "not reported (no check)"),
      f"processes: {_describe_processes(inputs.distributed)}",
      f"run dir: {c.run.run_dir} ({'resumes' if resumes else 'new'}); "
      f"{c.run.num_steps} steps, checkpoint every {c.run.checkpoint_every}",
  ]
  return "\n".join(lines)


def _steps_per_epoch(examples: int, c: Config, inputs: Inputs) -> str:
  """Every process reads --prompts_per_step prompts a step; a launcher's count is unknown
  until the processes meet."""
  count = 1 if inputs.distributed is None else inputs.distributed.get("num_processes")
  if count is None:
    return (f"{math.ceil(examples / c.rl.prompts_per_step)} steps per epoch divided by the "
            "number of processes")
  return f"{math.ceil(examples / (c.rl.prompts_per_step * count))} steps per epoch"


def check_plan_fits(config: Config, inputs: Inputs) -> None:
  """The memory check a run makes before it loads weights (`memory.check_fits`), for
  `--dry_run`: ConfigError where the run cannot fit."""
  memory.check_fits(config, inputs.model_config, _mesh(config))


def _describe_processes(settings: dict[str, Any] | None) -> str:
  if settings is None:
    return "one"
  if not settings:
    return "several, placed by the launcher (TPU pod slice, SLURM or Open MPI)"
  return (f"{settings.get('num_processes', 'launcher-given')} meeting at "
          f"{settings.get('coordinator_address', 'the TPU coordinator')}; rollout on each "
          "process's own devices")


class Trainer:
  """Holds the run's state; `run()` is the loop. Built from a validated Config."""

  def __init__(self, config: Config, inputs: Inputs | None = None):
    c = self.config = config
    inputs = inputs or check_inputs(config)  # before anything is written
    d = c.distributed
    parallel.maybe_initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)
    self.process_index, self.process_count = jax.process_index(), jax.process_count()
    # Ours from here (jax.distributed installs a handler that only logs): a SIGTERM during
    # start-up (weights, warm-up, restore) stops the run before its first step.
    self._stop_signal, self._sigterm_before = None, None
    if threading.current_thread() is threading.main_thread():
      self._sigterm_before = signal.signal(signal.SIGTERM, self._on_sigterm)
    try:  # before anything is written: a mismatch would hang or mix hosts' data later
      multihost.check_agree({f.split(".")[-1]: operator.attrgetter(f)(c)
                             for f in LOCKSTEP_FIELDS})
      multihost.check_agree({
          "flags": run_config.fingerprint_without(c, HOST_LOCAL_FIELDS)[:12],
          "training examples": inputs.train_fingerprint["sha256"][:12]},
          what="the {} of every process of a run must be the same (sha256 by process)")
    except ValueError as e:
      raise ConfigError(str(e)) from e
    self.mesh = _mesh(c)
    self.tokenizer, self.template = inputs.tokenizer, inputs.template
    self.eval_examples = inputs.eval_examples
    # With --balance_hosts every host reads the whole round (the same stream positions as
    # all hosts' slices together) and samples what the plan gives it (rl.hosts).
    self.balance = c.rollout.balance_hosts and self.process_count > 1
    part = (dict(batch_size=c.rl.prompts_per_step * self.process_count, process_index=0,
                 process_count=1) if self.balance else
            dict(batch_size=c.rl.prompts_per_step, process_index=self.process_index,
                 process_count=self.process_count))
    self.pipeline = PromptPipeline(inputs.train_examples, seed=c.run.seed,
                                   render_fn=chat_renderer(self.tokenizer),
                                   template=self.template, **part)
    # Refuses, naming the parts, a run that cannot fit, before weights load or anything is written.
    self.memory = memory.check_fits(c, inputs.model_config, self.mesh)
    model, _ = load_model(c.model.model, param_dtype=param_dtype(c), mesh=self.mesh)

    self.learner = Learner(c, model, self.mesh, inputs.model_config)
    # Rollout runs on this host's devices, on a replica of the policy (rhyme_jax.multihost).
    self.policy = multihost.HostPolicy(self.mesh, param_shardings(
        self.learner.params, multihost.host_local_mesh(self.mesh), inputs.model_config))
    scorer = Scorer(self.tokenizer, inputs.reward_fn, c.rollout.max_new_tokens,
                    c.rl.overlong_buffer)
    self.rollouts = Rollouts(c, self._rollout_policy(), self.tokenizer, scorer,
                             self.process_index, self.process_count)
    t0 = time.perf_counter()
    self.rollouts.warmup()  # every rollout shape compiles here, once
    absl_logging.info("rollout engine compiled in %.1fs", time.perf_counter() - t0)
    self.checkpointer = ckpt_lib.RunCheckpointer(c.run.run_dir, keep_last=c.run.keep_checkpoints,
                                                 save_every=c.run.checkpoint_every)
    self.step = 0
    self.data_iter = iter(self.pipeline)
    self.epoch_stats = EpochStats()
    self._restore()  # refuses a checkpoint this config cannot resume, before the write below
    if self.process_index == 0:  # one writer; the others checked it in check_inputs
      run_config.ensure_run_config(c.run.run_dir, c,
                                   data=inputs.train_fingerprint,
                                   allow_changed=RESUMABLE_CHANGES)

  def _rollout_policy(self):
    """The learner's current parameters as this host's rollout model."""
    return nnx.merge(self.learner.graphdef, self.policy.replica(self.learner.params))

  # ---- checkpoints -------------------------------------------------------------------------

  def _restore(self):
    warn = lambda msg: print(msg, file=sys.stderr)
    state = self.checkpointer.restore_latest(abstract_params=self.learner.params,
                                             abstract_opt_state=self.learner.opt_state, warn=warn,
                                             agree=multihost.allgather_json,
                                             validate=self._host_state_usable)
    if state is None:
      return
    self.learner.params, self.learner.opt_state, self.step = (state.params, state.opt_state,
                                                              state.step)
    host = state.host_state
    self.data_iter.set_state(self._host_state_usable(state))
    store = self.rollouts.store
    if store is not None and host.get("history") is not None:
      store.load_state_dict(host["history"])
    self.epoch_stats.load_state_dict(host.get("epoch_stats"))
    self.rollouts.engine.update_params(self._rollout_policy())
    print(f"resumed from {self.checkpointer.directory} at step {self.step}", file=sys.stderr)

  def _host_state_usable(self, state):
    """This process's data-iterator state from a restored checkpoint, after checking that
    all of its host state loads (into throwaway copies); `CheckpointError` naming the
    checkpoint where it does not, so `restore_latest` tries the one before."""
    host, where = state.host_state, f"checkpoint {self.checkpointer.directory / str(state.step)}"
    try:
      check_order_version(host.get("data_order", 1), where)
      data_state = hosts.my_data_state(host["data_iter"], self.process_index,
                                       self.process_count, where, balanced=self.balance)
      store = self.rollouts.store
      if store is not None and host.get("history") is not None:
        object.__new__(type(store)).load_state_dict(host["history"])
      copy.copy(self.epoch_stats).load_state_dict(host.get("epoch_stats"))
    except ValueError as e:
      raise ckpt_lib.CheckpointError(str(e) if where in str(e) else f"{where}: {e}") from e
    except (KeyError, TypeError, AttributeError) as e:
      raise ckpt_lib.CheckpointError(
          f"{where}: malformed host state ({type(e).__name__}: {e})") from e
    return data_state

  def save(self, force: bool = False):
    if not (force or self.checkpointer.should_save(self.step)):
      return  # (every process decides alike: the gather below is a collective)
    store = self.rollouts.store  # the same on every host (hosts.py): process 0's is saved
    host = {"data_iter": hosts.data_states(self.data_iter.get_state()),
            "data_order": ORDER_VERSION,
            "rng": {"seed": self.config.run.seed},
            "history": store.state_dict() if store is not None else None,
            "epoch_stats": self.epoch_stats.state_dict()}
    self.checkpointer.save(self.step, params=self.learner.params,
                           opt_state=self.learner.opt_state, host_state=host, force=force)

  # ---- one step ----------------------------------------------------------------------------

  def train_step(self) -> dict[str, Any]:
    """One full RL step: rollout rounds until enough informative groups, then an update."""
    c = self.config
    t_step = time.perf_counter()
    stats: dict[str, Any] = {}
    next_round = lambda: _encode(next(self.data_iter), self.tokenizer, c)
    if self.balance:  # global rounds over the whole batch, each host its plan's share
      rounds = hosts.balanced_rounds(next_round, self.rollouts, c, self.step, self.process_index,
                                     self.process_count, stats)
    else:  # this host's rounds over its own slice: hosts may need different numbers of them
      rounds = hosts.local_rounds(next_round, self.rollouts, c, self.step, stats)
    shared = rounds.share(stats)
    self.rollouts.record(shared.records)
    m = rollout_metrics(shared.records, shared.kept, shared.stats,
                        c.rl.prompts_per_step * self.process_count)
    m.update(rounds.metrics)
    m.update(self.epoch_stats.update(
        m["data/epoch"], shared.stats, [x for g in shared.records for x in g.rewards],
        [len(r) for g in shared.records for r in g.responses]))
    if shared.kept:  # every process trains (with its kept groups, maybe none) or none does
      m.update(self.learner.train_on(rounds.mine))
      self.rollouts.engine.update_params(self._rollout_policy())
    else:  # dynamic sampling found no informative group: nothing to learn from this step
      m.update({"time/logprob": 0.0, "time/train": 0.0})
    m["time/step"] = time.perf_counter() - t_step
    return m

  def evaluate(self) -> dict[str, float]:
    """Greedy decoding on the held-out examples (each host a share): mean reward, accuracy."""
    t0 = time.perf_counter()
    mine = self.eval_examples[self.process_index::self.process_count]
    texts = [render_prompt(e, chat_renderer(self.tokenizer), self.template) for e in mine]
    prompts = encode_prompts(texts, mine, [0] * len(texts), self.tokenizer,
                             self.config.rollout.max_prompt_len)
    parts = multihost.allgather_json(self.rollouts.evaluate(prompts, self.step))
    return eval_metrics(parts, time.perf_counter() - t0)

  # ---- the loop ----------------------------------------------------------------------------

  def _on_sigterm(self, signum, frame):
    del frame
    self._stop_signal = signum  # only this: printing here can re-enter a blocked stderr write

  def _stopping(self) -> bool:
    """Whether a stop signal arrived; with several processes, whether any got one (all hosts
    must leave at the same step boundary or the next collective hangs)."""
    stop = multihost.any_process(self._stop_signal is not None)
    if stop:
      print(f"received signal {self._stop_signal or 'on another process'}: stopping at step "
            f"{self.step}", file=sys.stderr)
      self._stop_signal = self._stop_signal or signal.SIGTERM
    return stop

  def run(self) -> list[dict[str, Any]]:
    c = self.config
    start = self.step
    primary = self.process_index == 0  # metrics cover every host; one process writes them
    writer = metrics_lib.MetricsWriter(c.run.run_dir, resume_step=start if start else None,
                                       enabled=primary)
    progress = metrics_lib.Progress(c.run.num_steps, start_step=start,
                                    keys=("reward/mean", "accuracy", "eval/accuracy",
                                          "rollout/mean_accepted_length", "time/step"))
    history = []
    stopping = self._stopping()  # a signal during start-up: its last checkpoint stands
    try:
      while not stopping and self.step < c.run.num_steps:
        self.step += 1
        m = self.train_step()
        if c.run.eval_every and self.step % c.run.eval_every == 0:
          m.update(self.evaluate())
        writer.write(self.step, m)
        history.append(m)
        stopping = self._stopping()
        self.save(force=self.step == c.run.num_steps or stopping)
        if primary and (self.step % c.run.log_every == 0 or self.step == c.run.num_steps):
          progress.update(self.step, m)
    finally:
      try:
        self.checkpointer.close()  # first: the stop checkpoint commits before anything else
      finally:
        progress.close()
        writer.close()
        if self._sigterm_before is not None:  # only now: a second SIGTERM cannot cut the commit
          signal.signal(signal.SIGTERM, self._sigterm_before)
    if self._stop_signal is not None:
      saved = "checkpoint saved" if self.step else "before the first step"
      print(f"stopped at step {self.step} ({saved}); rerun the same command to resume",
            file=sys.stderr)
    return history


def _encode(batch, tokenizer, c: Config) -> list:
  """A data batch's prompts as the rollout's `Prompt`s (tokenized, length-checked)."""
  return encode_prompts(batch.prompts, batch.examples, batch.epochs, tokenizer,
                        c.rollout.max_prompt_len)


def _mesh(c: Config):
  """The training mesh; with several processes each must hold its own batch rows, and request
  ids (int32) must stay in range over all of them."""
  try:
    mesh = parallel.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    parallel.check_process_rows(mesh)
  except ValueError as e:
    raise ConfigError(f"--mesh_data={c.mesh.data} --mesh_fsdp={c.mesh.fsdp} "
                      f"--mesh_tensor={c.mesh.tensor}: {e}") from e
  if (c.run.num_steps + 1) * ids_per_step(c) * jax.process_count() >= 2**31:
    raise ConfigError(f"--num_steps={c.run.num_steps}: request ids run past 2^31 with "
                      f"{jax.process_count()} processes (fewer steps, or a smaller "
                      "--prompts_per_step or --group_size)")
  return mesh


def run(config: Config) -> list[dict[str, Any]]:
  """Trains per `config`, resuming from the run directory's latest checkpoint when present."""
  return Trainer(config).run()
