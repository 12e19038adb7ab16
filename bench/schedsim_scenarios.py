"""The simulator's scenarios: which engine shapes bench/schedsim.py replays each trace through.

A `Scenario` is one row of its summary table: a step-time table (h100 / cpu), shards x slots,
bucket shrinking, speculation, a shard plan, divided rollout's chunk and KV handling, and the
engine's launch shape (plain steps per launch, outputs read one launch late). `scenarios`
lists them for a trace's step size; `shard_plan` makes the group -> shard plans compared on
several shards.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from rhyme_jax.scheduling.assignment import lpt_assign, plan_shards
from rhyme_jax.scheduling.simulate import DividedRollout, SimConfig
from rhyme_jax.scheduling.step_time import PREFILL_MS_PER_TOKEN, StepTimeTable


def shard_plan(kind: str, jobs, predictor, shards: int):
  groups = sorted({m.group_id for m, _ in jobs})
  if kind == "data_order":
    return {g: i % shards for i, g in enumerate(groups)}
  if kind == "lpt_history":
    return plan_shards([m for m, _ in jobs], predictor, shards)
  if kind == "lpt_oracle":
    true = collections.Counter()
    for m, n in jobs:
      true[m.group_id] += n
    shard = lpt_assign(np.array([true[g] for g in groups], np.int64), shards)
    return dict(zip(groups, shard.tolist()))
  raise ValueError(f"--plans: unknown plan {kind!r}")


@dataclasses.dataclass(frozen=True)
class Scenario:
  table: str
  slots: int
  shards: int = 1
  shrink: bool = True
  accepted: float = 1.0  # mean accepted length at `budget` (1.0: no speculation)
  budget: int = 16
  plan: str = "-"
  chunk: int = 0
  keep_kv: bool = True  # divided rollout: a yielded request's KV stays (else re-prefilled)
  kv_rows: float = 0  # history_residual's cap on started requests, x slots (0: none)
  multi_step: int = 1  # plain steps per launch (the engine's EngineConfig.multi_step)
  pipeline: bool = False  # outputs read one launch late, as the engine reads them
  drain: bool = False  # one-step launches once nothing waits (EngineConfig.drain_steps single)

  def label(self) -> str:
    spec = f"a={self.accepted:g}@T{self.budget}" if self.accepted > 1 else "off"
    return (f"{self.table} | {self.shards}x{self.slots} | {'yes' if self.shrink else 'no'} | "
            f"{spec} | {self.plan} | "
            f"{self.chunk_label()} | {self.launch_label()}")

  @property
  def divided_reference(self) -> bool:
    """One shard, shrinking buckets, no speculation, divided rollout with every yielded KV
    kept: where divided rollout's references and the quantile rehearsal are measured."""
    return (self.shards == 1 and self.shrink and self.accepted <= 1 and self.chunk > 0
            and self.keep_kv and not self.kv_rows)

  def sim_config(self, yield_ms: dict, yield_pass_ms: dict) -> SimConfig:
    """The simulator's engine for this scenario; `yield_ms` / `yield_pass_ms`: {table name:
    ms} a yield / a pass that yields stalls its shard."""
    return SimConfig(slots=self.slots,
                     buckets=tuple(b for b in (64, 32, 16, 8, 4, 2, 1) if b <= self.slots),
                     shrink=self.shrink, shards=self.shards,
                     accepted=((self.budget, self.accepted),) if self.accepted > 1 else (),
                     prefill_ms_per_token=PREFILL_MS_PER_TOKEN[self.table],
                     divided=DividedRollout(self.chunk, self.keep_kv, yield_ms[self.table],
                                            yield_pass_ms[self.table]),
                     multi_step=self.multi_step, pipeline=self.pipeline,
                     drain_single_step=self.drain)

  def told_yield_cost(self, table: StepTimeTable, yield_ms: dict, yield_pass_ms: dict,
                      told_cost: float = 1.0) -> float:
    """The yield cost an online order is told: a pass of one yield in decode steps of the
    full batch, as the engine tells it, times `told_cost` (a sensitivity factor; 1 = the
    engine's)."""
    return ((yield_ms[self.table] + yield_pass_ms[self.table]) / table.ms(self.slots, 0)
            * told_cost)

  def launch_label(self) -> str:
    return (f"{self.multi_step}" + (" piped" if self.pipeline else "")
            + (", drain 1" if self.drain else ""))

  def chunk_label(self) -> str:
    if not self.chunk:
      return "-"
    return (f"{self.chunk}" + ("" if self.keep_kv else " re-prefill")
            + (f" kv {self.kv_rows:g}x" if self.kv_rows else ""))


def divided_chunk(chunk: int, max_new_tokens: int) -> int:
  """Divided rollout's chunk: `chunk` (--chunk), else min(64, max_new_tokens / 4), at least 1."""
  return chunk or max(min(64, max_new_tokens // 4), 1)


def slot_counts(args, num_requests: int) -> tuple[int, int]:
  """Rows per shard on the (h100, cpu) tables: --slots, else scaled to the step so a slot
  serves 2 (h100) / 4 (cpu) requests as on the 128-request GSM8K trace (64 / 32 slots):
  a step no larger than the slots admits everything at once, where no order can matter."""
  if getattr(args, "slots", None):
    return args.slots
  pow2 = lambda n: 1 << max(int(n), 1).bit_length() - 1
  return min(64, pow2(num_requests / 2)), min(32, pow2(num_requests / 4))


def scenarios(args, num_requests: int = 128, chunk: int = 64) -> list[Scenario]:
  h, c = slot_counts(args, num_requests)
  out = [Scenario("h100", h), Scenario("h100", h, shrink=False),
         Scenario("h100", h, accepted=args.accepted, budget=args.budget),
         Scenario("cpu", c), Scenario("cpu", c, shrink=False)]
  for plan in args.plans.split(","):
    out.append(Scenario("h100", max(h // 4, 1), shards=4, plan=plan))
  out.append(Scenario("h100", max(h // 4, 1), shards=4, plan="lpt_history", chunk=chunk))
  out.append(Scenario("cpu", max(c // 4, 1), shards=4, plan="lpt_history"))
  out.append(Scenario("cpu", max(c // 4, 1), shards=4, plan="lpt_history", chunk=chunk))
  out += [Scenario("h100", h, chunk=chunk),  # divided rollout on one shard
          Scenario("h100", h, accepted=args.accepted, budget=args.budget, chunk=chunk),
          Scenario("cpu", c, chunk=chunk),
          # KV held for at most 2 x slots: the simulator's rule (at the budget only started
          # requests resume); the engine instead stops yields while its park pool is full
          Scenario("h100", h, chunk=chunk, kv_rows=2),
          Scenario("cpu", c, chunk=chunk, kv_rows=2),
          Scenario("h100", h, chunk=chunk, keep_kv=False),  # KV dropped when a request yields
          Scenario("cpu", c, chunk=chunk, keep_kv=False)]
  # As the engine runs (bench/schedule_engine.py): outputs read one launch late; on the GPU
  # 4 plain steps per launch (bench/gpu_schedule.sh), on the CPU one.
  out += [Scenario("h100", h, multi_step=4, pipeline=True),
          Scenario("h100", h, chunk=chunk, multi_step=4, pipeline=True),
          Scenario("h100", h, chunk=chunk, multi_step=4, pipeline=True, drain=True),
          Scenario("cpu", c, pipeline=True),
          Scenario("cpu", c, chunk=chunk, pipeline=True)]
  return out
