"""Run configuration: absl flag definitions -> frozen dataclasses, validated once at start.

Every dataclass field carries the name of the flag it comes from, so a bad value is reported as
`--spec=foo: expected one of histospec, none` before any work (or any write to the run
directory) happens. The config is plain data: it is fingerprinted into `RUN_DIR/run_config.json`
and compared on resume (see `rhyme_jax.checkpoint.ensure_run_config`).

Use from a program (the global absl flags):

  define_flags(flags.FLAGS)            # once, at import time of the main module
  config = config_from_flags(flags.FLAGS)

or from code and tests, without global state:

  config = parse_flags(["--task=arithmetic", "--group_size=4"])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from absl import flags

# Choice lists. This module imports nothing from the package (it sits at the bottom of the
# import graph and loads no JAX), so each list that mirrors a registry or constant elsewhere is
# checked against it by tests/test_config.py::test_choice_lists_match_their_sources.
SPECS = ("histospec", "none")
DRAFT_MODES = ("sync", "ahead", "ahead_only")  # rollout.interface.DRAFT_MODES
SPECULATE = ("auto", "always")  # of rollout.interface.SPECULATE ("never" is --spec=none)
# Decode attention: the XLA path, the Pallas kernel of the backend, or that kernel interpreted
# (CPU tests). The one source: models.attention and the engine config import it.
ATTENTIONS = ("xla", "pallas", "pallas_interpret")
MAX_MULTI_STEP = 64  # most plain decode steps in one engine launch (--multi_step)
DRAIN_STEPS = ("multi", "cost", "single")  # rollout.interface.DRAIN_STEPS
SCHEDULES = ("fifo", "history", "alternate", "probe", "residual")  # scheduling.plan.SCHEDULES
TASKS = ("arithmetic", "gsm8k")  # data.prompts templates
DTYPES = ("float32", "bfloat16")
LOSSES = ("ppo_clip",)  # rl.losses registry
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")  # rl.losses.AGGREGATIONS
KL_ESTIMATORS = ("k1", "k2", "k3")  # rl.losses.KL_ESTIMATORS
ADVANTAGES = ("grpo", "rloo")  # rl.advantages registry
# Default reward per task; `--reward` overrides it.
TASK_REWARDS = {"arithmetic": "arithmetic", "gsm8k": "gsm8k+0.1*format"}
# Fields that may differ when resuming a run directory or between its processes (each its own
# --process_id); everything else must match. rollout.attention: the same attention computed by
# another implementation (as on other hardware); the admission order never changes what is
# sampled; rollout.balance_hosts: switched on, it needs a checkpoint whose hosts stopped at one
# round of the prompt stream (rl.hosts.my_data_state).
RESUMABLE_CHANGES = ("run.num_steps", "run.run_dir", "run.checkpoint_every", "run.keep_checkpoints",
                     "run.eval_every", "run.eval_size", "run.log_every", "run.device_memory_gib",
                     "run.record_rollouts", "rl.remat",
                     "rollout.attention", "rollout.schedule", "rollout.speculate",
                     "rollout.divide_every", "rollout.park_rows", "rollout.compile_threads",
                     "rollout.multi_step", "rollout.balance_hosts",
                     "distributed")
# Of those, the ones every process of a run must share (multihost.check_agree at start-up):
# they decide which collectives a step enters and how the prompt stream is split. The others
# change what one host's engine does, never what any host samples or exchanges.
LOCKSTEP_FIELDS = ("run.num_steps", "run.run_dir", "run.checkpoint_every",
                   "run.keep_checkpoints", "run.eval_every", "run.eval_size", "run.log_every",
                   "run.device_memory_gib", "rollout.balance_hosts",
                   "rl.remat")  # the training step is one program across processes
# Every other field outside HOST_LOCAL_FIELDS is shared too (compared at start-up as one
# fingerprint): the ones that may differ between hosts change only what a host's own engine
# does (and the distributed flags name the host).
HOST_LOCAL_FIELDS = tuple(f for f in RESUMABLE_CHANGES if f not in LOCKSTEP_FIELDS)


class ConfigError(ValueError):
  """A flag has a value that is not allowed; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  model: str  # known name (smollm2-135m-instruct), HF checkpoint directory or .gguf file
  tokenizer: str  # '' = from the model
  param_dtype: str


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
  temperature: float
  top_p: float
  top_k: int
  max_prompt_len: int
  max_new_tokens: int
  spec: str  # 'histospec' drafts from the previous epoch and live siblings; 'none' does not
  draft_budget: int  # most draft nodes verified per request per step (EngineConfig.max_draft)
  draft_mode: str  # where host drafting runs: sync | ahead | ahead_only (EngineConfig)
  speculate: str  # auto (the cost model decides each step) | always (EngineConfig.speculate)
  prefill_chunk: int
  attention: str  # decode attention: xla | pallas | pallas_interpret (EngineConfig.attention)
  schedule: str  # rollout admission order (scheduling.plan.SCHEDULES)
  rollout_slots: int  # requests decoded at once (the engine's largest bucket); 0 = all of a step
  divide_every: int  # divided rollout: tokens between a request's offers to yield its slot
  park_rows: int  # divided rollout: device KV rows for requests that yielded (EngineConfig)
  compile_threads: int  # warm-up compiles the step shapes in this many threads (0: auto)
  multi_step: int  # plain decode steps per engine launch (EngineConfig.multi_step)
  drain_steps: str  # launches once no request waits: multi | cost | single (EngineConfig)
  history_epochs: int  # past epochs kept per prompt (history.store.HistoryStore.epochs_kept)
  balance_hosts: bool  # hosts sample the step's groups by LPT over predicted work (rl.hosts)


@dataclasses.dataclass(frozen=True)
class RLOptions:
  group_size: int
  prompts_per_step: int
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  max_grad_norm: float
  loss: str  # a registered policy loss (rl.losses)
  clip_eps_low: float
  clip_eps_high: float
  kl_beta: float
  kl_estimator: str
  loss_aggregation: str
  advantage: str
  normalize_std: bool
  ppo_epochs: int
  micro_batch_size: int  # samples per gradient micro-batch; 0 = the whole batch at once
  remat: bool  # recompute each layer's activations in the backward pass
  dynamic_sampling: bool
  dynamic_sampling_max_rounds: int  # rollout rounds per step at most (1 = no refill)
  overlong_buffer: int  # DAPO soft overlong penalty over the last N tokens; 0 = off
  tis_cap: float  # cap of the rollout->trainer importance weight; 0 = no correction

  @property
  def samples_per_step(self) -> int:
    return self.group_size * self.prompts_per_step


@dataclasses.dataclass(frozen=True)
class DataOptions:
  task: str  # 'arithmetic' (synthetic) or 'gsm8k': prompt template and default reward
  dataset: str  # '' = the task's own train data; else a .jsonl / .parquet path
  eval_dataset: str  # '' = the task's own test data; else a path
  data_dir: str  # GSM8K directory ('' = $RHYME_JAX_GSM8K_DIR or ../shared/datasets/gsm8k)
  train_size: int  # 0 = all (arithmetic: how many problems to generate)
  reward: str  # '' = the task's default


@dataclasses.dataclass(frozen=True)
class MeshOptions:
  data: int
  fsdp: int
  tensor: int


@dataclasses.dataclass(frozen=True)
class RunOptions:
  run_dir: str
  num_steps: int
  seed: int
  checkpoint_every: int
  keep_checkpoints: int
  eval_every: int  # 0 = no periodic evaluation
  eval_size: int
  log_every: int
  device_memory_gib: float  # 0 = what the device reports (CPUs report nothing: no check)
  record_rollouts: bool  # sampled tokens of every round to RUN_DIR/rollouts/ (for replay)


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
  """Multi-process start-up off TPU (multi-node GPU, CPU); a TPU pod slice needs none of it."""
  coordinator_address: str  # host:port of process 0; '' = single process or the environment
  num_processes: int  # 0 = from the environment
  process_id: int  # -1 = from the environment


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelOptions
  rollout: RolloutOptions
  rl: RLOptions
  data: DataOptions
  mesh: MeshOptions
  run: RunOptions
  distributed: DistributedOptions

  @property
  def reward_name(self) -> str:
    return self.data.reward or TASK_REWARDS[self.data.task]


# ----------------------------------------------------------------------------------------------
# Flags. (name, default, help) per group; the group's dataclass fields have the same names.

_FLAGS = {
    ModelOptions: [
        ("model", "smollm2-135m-instruct", "Model: a known name, an HF checkpoint directory "
         "(config.json + safetensors) or a .gguf file."),
        ("tokenizer", "", "Tokenizer: as --model; empty = the model's own."),
        ("param_dtype", "float32", f"Parameter/compute dtype: {', '.join(DTYPES)}."),
    ],
    RolloutOptions: [
        ("temperature", 0.7, "Sampling temperature (> 0; the trainer's log-probs use it too)."),
        ("top_p", 1.0, "Nucleus sampling mass in (0, 1]."),
        ("top_k", 0, "Top-k sampling (0 = off)."),
        ("max_prompt_len", 256, "Longest prompt in tokens; longer prompts are an error."),
        ("max_new_tokens", 96, "Response length cap in tokens."),
        ("spec", "histospec", f"Speculative rollout: {', '.join(SPECS)}."),
        ("draft_budget", 16, "Most draft nodes verified per request per decoding step (< 32); "
         "the engine's cost model decides each step how many, and whether to speculate at "
         "all."),
        ("speculate", "auto", "With --spec=histospec: 'auto' (the engine's cost model "
         "chooses each step between a plain step and speculative shapes: never slower than "
         "--spec=none beyond noise) or 'always' (every decode step verifies the largest "
         "speculative shape, drafts or not: acceptance measured at every step, e.g. "
         "bench/acceptance_epochs.py; slower where speculation cannot pay)."),
        ("draft_mode", "sync", "Where host drafting runs: 'sync' (before each step, the "
         "device waits), 'ahead' (in a background thread while the device verifies the previous "
         "step; synchronously only where the emitted tokens left that tree) or 'ahead_only' "
         "(never on the critical path; no draft that step instead). 'ahead' pays when most "
         "drafts are right; at the acceptance fresh-seed RL rollouts showed it did not "
         "(bench/RESULTS.md). Drafts never change what is sampled."),
        ("prefill_chunk", 64, "Prompt tokens prefilled per engine call."),
        ("attention", "xla", f"Decode attention: {', '.join(ATTENTIONS)}. 'pallas' runs the "
         "Pallas kernel of the backend (TPU: Mosaic, GPU: Triton), reading only each row's "
         "live KV; on CPU or a shape the kernel cannot take it uses the XLA path and logs "
         "why, once. 'pallas_interpret' runs the kernel interpreted (slow; CPU tests)."),
        ("schedule", "fifo", "Rollout admission order: 'fifo' (data order), 'history' (longest "
         "predicted first from the prompt's past response lengths: HistoPipe), 'alternate' "
         "(long->short on even steps, short->long on odd: HistoPipe's cross-step alternation, "
         "which interleaves tails only where a step's rollout overlaps the previous step's "
         "training; this trainer runs them in turn, so it lengthens odd steps' tails) "
         "or 'probe' (Seer: each group's first sample first, then the group with the longest "
         "finished sibling; probes ordered by history where it exists) or 'residual' (longest "
         "remaining work first: the upper quartile of L - n given L > n over the prompt's "
         "history, ties by its mean; with --divide_every, running requests give way to longer "
         "remaining work). Never changes what is sampled."),
        ("rollout_slots", 0, "Requests decoded at once (the rollout engine's largest batch "
         "bucket, e.g. what the KV cache memory allows); 0 = all group_size x prompts_per_step "
         "samples of a step at once. With fewer slots than samples, requests wait for a slot and "
         "--schedule decides which goes first."),
        ("divide_every", 0, "Divided rollout (Seer): every this many tokens a running request "
         "is offered to yield its slot to a queued one, as --schedule=probe or residual "
         "decides; its KV waits in one of --park_rows device rows and nothing is recomputed. "
         "0 = off. Cuts the rollout's tail when slots are fewer than samples."),
        ("park_rows", 0, "KV rows (each max_prompt_len + max_new_tokens positions) kept on "
         "the device for requests that yielded their slot (--divide_every); a full pool stops "
         "yields until one resumes."),
        ("compile_threads", 0, "Threads the rollout engine's warm-up compiles its step shapes "
         "in, one bucket each (0 = one per bucket up to the host's CPUs on CPU, one on a GPU or "
         "TPU, where XLA's autotuning times kernels while it compiles; 1 = one after another). "
         "Changes how long the first step waits, never what compiles or is sampled."),
        ("multi_step", 1, "Plain decode steps the rollout engine runs per compiled call "
         f"(1-{MAX_MULTI_STEP}): the host dispatches and reads once per this many tokens per "
         "row, for accelerators where the host's per-step work nears the device's step time. "
         "A request ending inside a call computes the rest of it for nothing. Never changes "
         "what is sampled."),
        ("drain_steps", "multi", "With --multi_step above 1, the launches once no request "
         "waits: 'multi' (--multi_step steps), 'single' (one step: ends are read, and rows move "
         "to smaller buckets, up to two launches sooner) or 'cost' (one step where the host's "
         "pass takes less than the step, so it costs no device time). Never changes what is "
         "sampled."),
        ("history_epochs", 1, "Past epochs of responses the history store keeps per prompt: "
         "HistoSpec drafts from all of them (newer weigh more) and a history --schedule "
         "predicts lengths from all of them (ranks averaged, newer weigh more). 1 = the "
         "prompt's last visit (RhymeRL); more predicts lengths better where they are noisy "
         "(bench/RESULTS.md, --epochs_kept of bench/schedsim.py) for that many times the host "
         "memory. Fixed for a run (its checkpoints hold the store). Never changes what is "
         "sampled."),
        ("balance_hosts", False, "Multi-host: every host reads the whole step's prompts and "
         "samples the groups a longest-processing-time-first assignment of their predicted "
         "work (history lengths) gives it, the same on every host without communication, "
         "instead of its own slice of the batch; the groups' samples are exchanged and each "
         "host trains on its slice of them. Evens the hosts' rollout times; without "
         "--dynamic_sampling the run samples the same tokens and trains each host on the same "
         "groups as without it (rollout log-probs may differ in their last bits: other batch "
         "shapes). With it the "
         "refill is global: every host reads every round, until all hosts together kept "
         "enough groups (without balancing each host refills its own slice), so it is switched on "
         "at a resume only where the hosts stopped at one round of the prompt stream."),
    ],
    RLOptions: [
        ("group_size", 4, "G: responses sampled per prompt (>= 2)."),
        ("prompts_per_step", 4, "Prompts per training step (per process)."),
        ("learning_rate", 1e-6, "AdamW peak learning rate."),
        ("warmup_steps", 0, "Linear warm-up steps from 0 to the learning rate."),
        ("weight_decay", 0.0, "AdamW weight decay."),
        ("max_grad_norm", 1.0, "Global-norm gradient clipping (0 = off)."),
        ("loss", "ppo_clip", f"Policy loss: {', '.join(LOSSES)}."),
        ("clip_eps_low", 0.2, "PPO ratio clip below: 1 - eps."),
        ("clip_eps_high", 0.28, "PPO ratio clip above: 1 + eps (DAPO clip-higher)."),
        ("kl_beta", 0.0, "KL penalty to the initial model (0 = no reference model)."),
        ("kl_estimator", "k3", f"KL estimator: {', '.join(KL_ESTIMATORS)}."),
        ("loss_aggregation", "token-mean", f"Loss aggregation: {', '.join(AGGREGATIONS)}."),
        ("advantage", "grpo", f"Advantage estimator: {', '.join(ADVANTAGES)}."),
        ("normalize_std", True, "Divide group-centred rewards by the group std."),
        ("ppo_epochs", 1, "Optimisation epochs over each rollout batch."),
        ("micro_batch_size", 0, "Samples per gradient micro-batch and process (0 = whole "
         "batch); must divide group_size * prompts_per_step."),
        ("remat", False, "Recompute each layer's activations in the backward pass instead of "
         "keeping them (gradient checkpointing): a micro-batch keeps one input per layer and "
         "one layer's working set at a time, and the loss head's float32 logits for "
         "128 positions at a time, for about a third more training compute. The "
         "same values to float rounding; the --dry_run memory estimate counts it."),
        ("dynamic_sampling", False, "Drop groups whose rewards are all equal and refill from "
         "the next prompts (DAPO)."),
        ("dynamic_sampling_max_rounds", 3, "Rollout rounds per step at most when refilling."),
        ("overlong_buffer", 0, "Soft overlong penalty over the last N tokens before "
         "max_new_tokens (0 = off)."),
        ("tis_cap", 2.0, "Cap of the rollout/trainer importance weight (0 = no correction)."),
    ],
    DataOptions: [
        ("task", "arithmetic", f"Task: {', '.join(TASKS)} (prompt template and default reward)."),
        ("dataset", "", "Training data: empty = the task's own; else a .jsonl/.parquet path "
         "with question/answer fields."),
        ("eval_dataset", "", "Evaluation data: empty = the task's test split; else a path."),
        ("data_dir", "", "GSM8K directory with train.jsonl / test.jsonl (empty = "
         "$RHYME_JAX_GSM8K_DIR if set, else ../shared/datasets/gsm8k next to the checkout)."),
        ("train_size", 0, "Use the first N training examples (0 = all; arithmetic: how many "
         "to generate, default 2000)."),
        ("reward", "", "Reward name, e.g. 'gsm8k+0.1*format' (empty = the task's default)."),
    ],
    MeshOptions: [
        ("data", -1, "Mesh 'data' axis size (-1 = the remaining devices)."),
        ("fsdp", 1, "Mesh 'fsdp' axis size."),
        ("tensor", 1, "Mesh 'tensor' axis size."),
    ],
    RunOptions: [
        ("run_dir", "", "Run directory (checkpoints, metrics, run_config.json). Required."),
        ("num_steps", 30, "Training steps."),
        ("seed", 0, "Seed of data order and sampling."),
        ("checkpoint_every", 10, "Save a checkpoint every N steps (and at the end)."),
        ("keep_checkpoints", 2, "Checkpoints kept."),
        ("eval_every", 0, "Greedy evaluation every N steps (0 = off)."),
        ("eval_size", 32, "Held-out examples per evaluation."),
        ("log_every", 1, "Print progress every N steps."),
        ("device_memory_gib", 0.0, "Memory per device in GiB that the run must fit (checked at "
         "start against an estimate of parameters, optimiser state, activations and KV cache; "
         "0 = what the device reports, no check where it reports nothing)."),
        ("record_rollouts", False, "Write every rollout round's sampled tokens to "
         "RUN_DIR/rollouts/ (history.recording files, one per round and data epoch): replay "
         "drafters against this run's epochs offline with bench/replay.py --grpo_dir."),
    ],
    DistributedOptions: [
        ("coordinator_address", "", "host:port of process 0, the same for every process of a "
         "multi-process run off TPU; empty = one process, or what the launcher says (TPU pod "
         "slice, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS)."),
        ("num_processes", 0, "Processes of the run (0 = from the launcher)."),
        ("process_id", -1, "This process's index in [0, --num_processes) (-1 = launcher's)."),
    ],
}
_MESH_FLAG = {"data": "mesh_data", "fsdp": "mesh_fsdp", "tensor": "mesh_tensor"}


def _flag_name(group, name: str) -> str:
  return _MESH_FLAG[name] if group is MeshOptions else name


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """Defines every run flag in `fv` (once)."""
  for group, entries in _FLAGS.items():
    for name, default, help_text in entries:
      flag = _flag_name(group, name)
      if flag in fv:
        continue
      if isinstance(default, bool):
        flags.DEFINE_bool(flag, default, help_text, flag_values=fv)
      elif isinstance(default, int):
        flags.DEFINE_integer(flag, default, help_text, flag_values=fv)
      elif isinstance(default, float):
        flags.DEFINE_float(flag, default, help_text, flag_values=fv)
      else:
        flags.DEFINE_string(flag, default, help_text, flag_values=fv)


def config_from_flags(fv: flags.FlagValues = flags.FLAGS) -> Config:
  """Builds the validated Config from parsed flags; raises ConfigError naming a bad flag."""
  parts = {}
  for group, entries in _FLAGS.items():
    parts[group] = group(**{name: fv[_flag_name(group, name)].value for name, _, _ in entries})
  config = Config(model=parts[ModelOptions], rollout=parts[RolloutOptions], rl=parts[RLOptions],
                  data=parts[DataOptions], mesh=parts[MeshOptions], run=parts[RunOptions],
                  distributed=parts[DistributedOptions])
  validate(config)
  return config


def parse_flags(argv: Sequence[str]) -> Config:
  """Parses flag strings (no program name) into a validated Config, without global state."""
  fv = flags.FlagValues()
  define_flags(fv)
  try:
    fv(["rhyme_jax"] + list(argv))
  except flags.Error as e:
    raise ConfigError(str(e)) from e
  return config_from_flags(fv)


# ----------------------------------------------------------------------------------------------
# Validation.


def _fail(flag: str, value, allowed: str):
  raise ConfigError(f"--{flag}={value}: expected {allowed}")


def _one_of(flag: str, value, choices: Sequence[str]):
  if value not in choices:
    _fail(flag, value, f"one of {', '.join(choices)}")


def _at_least(flag: str, value, low):
  if not value >= low:
    _fail(flag, value, f"an integer >= {low}" if isinstance(low, int) else f"a number >= {low}")


def validate(c: Config) -> None:
  """Checks every value; the first bad one raises ConfigError naming its flag."""
  m, r, rl, d, mesh, run = c.model, c.rollout, c.rl, c.data, c.mesh, c.run
  if not m.model:
    _fail("model", "''", "a known model name, an HF checkpoint directory or a .gguf file")
  _one_of("param_dtype", m.param_dtype, DTYPES)

  if not (r.temperature > 0 and math.isfinite(r.temperature)):
    _fail("temperature", r.temperature, "a finite number > 0 (training needs a sampling "
          "distribution; evaluation is greedy on its own)")
  if not 0.0 < r.top_p <= 1.0:
    _fail("top_p", r.top_p, "a number in (0, 1]")
  _at_least("top_k", r.top_k, 0)
  _at_least("max_prompt_len", r.max_prompt_len, 1)
  _at_least("max_new_tokens", r.max_new_tokens, 1)
  _one_of("spec", r.spec, SPECS)
  if not 1 <= r.draft_budget < 32:
    _fail("draft_budget", r.draft_budget, "an integer in [1, 32)")
  _one_of("draft_mode", r.draft_mode, DRAFT_MODES)
  _one_of("speculate", r.speculate, SPECULATE)
  _at_least("prefill_chunk", r.prefill_chunk, 1)
  _one_of("attention", r.attention, ATTENTIONS)
  _one_of("schedule", r.schedule, SCHEDULES)
  _at_least("rollout_slots", r.rollout_slots, 0)
  _at_least("divide_every", r.divide_every, 0)
  _at_least("park_rows", r.park_rows, 0)
  _at_least("compile_threads", r.compile_threads, 0)
  _at_least("history_epochs", r.history_epochs, 1)
  _one_of("drain_steps", r.drain_steps, DRAIN_STEPS)
  if not 1 <= r.multi_step <= MAX_MULTI_STEP:
    _fail("multi_step", r.multi_step, f"in [1, {MAX_MULTI_STEP}]")
  if r.divide_every and not r.park_rows:
    _fail("park_rows", r.park_rows, ">= 1 with --divide_every (room for yielded requests' KV)")
  if r.divide_every and r.schedule not in ("probe", "residual"):
    _fail("divide_every", r.divide_every, "0 unless --schedule is probe or residual (an order "
          "that re-ranks running requests)")

  _at_least("group_size", rl.group_size, 2)
  _at_least("prompts_per_step", rl.prompts_per_step, 1)
  if not (rl.learning_rate > 0 and math.isfinite(rl.learning_rate)):
    _fail("learning_rate", rl.learning_rate, "a finite number > 0")
  _at_least("warmup_steps", rl.warmup_steps, 0)
  _at_least("weight_decay", rl.weight_decay, 0.0)
  _at_least("max_grad_norm", rl.max_grad_norm, 0.0)
  _one_of("loss", rl.loss, LOSSES)
  if not 0.0 <= rl.clip_eps_low < 1.0:
    _fail("clip_eps_low", rl.clip_eps_low, "a number in [0, 1)")
  _at_least("clip_eps_high", rl.clip_eps_high, 0.0)
  _at_least("kl_beta", rl.kl_beta, 0.0)
  _one_of("kl_estimator", rl.kl_estimator, KL_ESTIMATORS)
  _one_of("loss_aggregation", rl.loss_aggregation, AGGREGATIONS)
  _one_of("advantage", rl.advantage, ADVANTAGES)
  _at_least("ppo_epochs", rl.ppo_epochs, 1)
  _at_least("micro_batch_size", rl.micro_batch_size, 0)
  if rl.micro_batch_size and rl.samples_per_step % rl.micro_batch_size:
    _fail("micro_batch_size", rl.micro_batch_size,
          f"0 or a divisor of group_size * prompts_per_step = {rl.samples_per_step}")
  _at_least("dynamic_sampling_max_rounds", rl.dynamic_sampling_max_rounds, 1)
  _at_least("overlong_buffer", rl.overlong_buffer, 0)
  if rl.overlong_buffer > r.max_new_tokens:
    _fail("overlong_buffer", rl.overlong_buffer,
          f"0 or at most --max_new_tokens={r.max_new_tokens}")
  _at_least("tis_cap", rl.tis_cap, 0.0)

  _one_of("task", d.task, TASKS)
  for flag, path in (("dataset", d.dataset), ("eval_dataset", d.eval_dataset)):
    if path and not path.lower().endswith((".jsonl", ".json", ".parquet")):
      _fail(flag, path, "empty (the task's own data) or a .jsonl / .parquet file path")
  _at_least("train_size", d.train_size, 0)
  # --reward names are checked by the trainer against the reward registry (rl/ sits above
  # this module), still before anything is written.

  for axis in ("data", "fsdp", "tensor"):
    size = getattr(mesh, axis)
    if size != -1 and size < 1:
      _fail(_MESH_FLAG[axis], size, "an integer >= 1, or -1 for all remaining devices")
  if sum(getattr(mesh, a) == -1 for a in ("data", "fsdp", "tensor")) > 1:
    raise ConfigError(f"--mesh_data={mesh.data} --mesh_fsdp={mesh.fsdp} "
                      f"--mesh_tensor={mesh.tensor}: at most one mesh axis may be -1")

  if not run.run_dir:
    _fail("run_dir", "''", "a directory path (where checkpoints and metrics go)")
  _at_least("num_steps", run.num_steps, 1)
  if not 0 <= run.seed < 2**32:  # the data order's and the sampler's keys take 32 bits
    _fail("seed", run.seed, "an integer in [0, 2^32)")
  _at_least("checkpoint_every", run.checkpoint_every, 1)
  _at_least("keep_checkpoints", run.keep_checkpoints, 1)
  _at_least("eval_every", run.eval_every, 0)
  _at_least("eval_size", run.eval_size, 1)
  _at_least("log_every", run.log_every, 1)
  _at_least("device_memory_gib", run.device_memory_gib, 0.0)
  _validate_distributed(c.distributed)
  # Request ids (int32) are step * ids_per_step + offset: keep them in range.
  if (run.num_steps + 1) * ids_per_step(c) >= 2**31:
    _fail("num_steps", run.num_steps, f"fewer steps: request ids run past 2^31 with "
          f"{ids_per_step(c)} ids per step (lower --prompts_per_step, --group_size or "
          "--dynamic_sampling_max_rounds)")


def _validate_distributed(dist: DistributedOptions) -> None:
  """The flags alone (`rhyme_jax.parallel.distributed_settings` adds the environment)."""
  host, _, port = (address := dist.coordinator_address).rpartition(":")
  if address and not (host and port.isdigit() and 0 < int(port) < 65536):
    _fail("coordinator_address", address, "host:port (process 0's address and a free port)")
  _at_least("num_processes", dist.num_processes, 0)
  _at_least("process_id", dist.process_id, -1)
  if (dist.process_id >= 0) != (dist.num_processes > 0):  # both or neither
    _fail("num_processes", f"{dist.num_processes} --process_id={dist.process_id}",
          "both (each process its own id in [0, num_processes)) or neither")
  if dist.num_processes and dist.process_id >= dist.num_processes:
    _fail("process_id", dist.process_id, f"an index in [0, --num_processes={dist.num_processes})")


def ids_per_step(c: Config) -> int:
  """Request ids one training step may use: rounds x prompts x samples."""
  rounds = c.rl.dynamic_sampling_max_rounds if c.rl.dynamic_sampling else 1
  return rounds * c.rl.samples_per_step
