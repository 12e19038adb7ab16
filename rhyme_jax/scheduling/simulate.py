"""A discrete-event model of the SPMD rollout: what an admission order does to a step's makespan.

Each of D shards (data-parallel replicas / hosts) runs the engine's loop: `slots` rows, refilled
from its queue as requests finish; once its queue is empty the live requests move into the
smallest bucket that holds them (with `shrink`: the engine's `bucket_moves="always"`; its
default moves only where the cost model says a move pays, rollout/tail.py, and a move costs
nothing here); every step costs the measured time of its
(bucket, budget) shape (`StepTimeTable`) and advances each live request by one token, or by the
mean accepted length where speculating is cheaper per token (`best_budget`). Admissions cost a
prefill of the prompt at `prefill_ms_per_token`. Lengths are the requests' true (recorded)
lengths; the policy under test never sees them (except the oracle's).

Divided rollout (Seer, `chunk` > 0): a request yields its slot after every `chunk` tokens and
rejoins the queue of the shard with the fewest live + queued requests (its own on ties; ahead
of requests not yet started, under a static order), and a shard whose queue ran dry takes
requests from the longest other queue, so work moves off a loaded shard mid-response and the
tail spreads over shards (smaller buckets each). Resuming on the shard it left costs nothing
(its KV stays there); resuming elsewhere costs a re-prefill of prompt + generated tokens (no
global KV pool here).
Keeping the KV of a yielded request that another one displaced needs room for more sequences
than rows (`SimResult.peak_started` counts them); with `keep_kv=False` the KV is dropped
instead, and every resumption that is not immediate pays the re-prefill too.

The engine interface this models: `AdmissionPolicy.order` once, `next_to_admit` when a slot
frees, and every `chunk` tokens of a running request (divided rollout) whether it gives way:
the policy's rule (`rollout.interface.yield_rule`: its own `yield_rule` or `should_yield` where
it has one, else whether `next_to_admit` offered the queue plus the running request picks
another), made once per step for every request asked in it (the free slots take the
policy's first picks, each yield the next), and asked only while its shard's
queue holds more requests than the step left free slots, as rollout/divided.py asks
(history_residual yields to a margin more expected remaining work); each such yield stalls its
shard for `DividedRollout.yield_ms` (the engine's two KV row copies), and a step that yields at
all for `pass_ms` more (the engine copies a pass's rows in one call each way). A static order's
yield (or one with an empty queue) requeues the request where it balances shards, resuming in
place for free on its own. The `live` map handed to `next_to_admit` also holds the tokens so
far of yielded requests still queued (what an online policy needs to rank a resumption).

Launches (`multi_step` > 1, the engine's `EngineConfig.multi_step`): a stretch of plain steps
runs as one launch of that many steps, shortened to one step by the engine's token-cap rule
(`rollout.loop.Rollout._launch_steps`: while requests wait, where a row would reach its cap
inside the launch; with none waiting, where every row would, or always with
`drain_single_step`, the engine's `EngineConfig.drain_steps`). A request that ends inside a
launch holds its row until the launch ends, and is recorded as finished at the launch's end
(`SimResult.finish_ms`, what the host sees; `step_finish_ms` keeps the step that computed its
last token, the engine's modelled clock).
Pipelining (`pipeline`, the engine's default): the engine dispatches a launch before it reads
the one before, so admissions and yields see each launch's outputs one launch late, and a row
that finished stays in the batch (computing nothing) for one more launch while requests wait;
a yielded request rejoins the queue once the launch it was still in is read. A shard with
nothing left to admit reads at once, as the engine does before a bucket move.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from rhyme_jax.rollout.interface import yield_rule
from rhyme_jax.scheduling.admission import AdmissionPolicy, RequestMeta
from rhyme_jax.scheduling.step_time import StepTimeTable, bucket_for


@dataclasses.dataclass(frozen=True)
class DividedRollout:
  """Seer's divided rollout: a live request yields its slot after `chunk` tokens (0 = never);
  `keep_kv`: a yielded request's KV stays on its shard (else it is recomputed on resumption)."""

  chunk: int = 0
  keep_kv: bool = True
  yield_ms: float = 0.0  # device time a yield stalls its shard (the two KV row copies)
  # Once per step that yields on a shard, whatever the count: the engine parks a pass's
  # yields in one copy call and resumes them in one more (dispatch, index transfer, launch).
  pass_ms: float = 0.0

  def should_yield(self, generated_since_admission: float) -> bool:
    return self.chunk > 0 and generated_since_admission >= self.chunk


@dataclasses.dataclass(frozen=True)
class SimConfig:
  slots: int = 64  # rows per shard (its largest bucket)
  buckets: tuple[int, ...] = (64, 32, 16, 8, 4, 2, 1)
  shrink: bool = True  # move the tail into smaller buckets (else every step runs `slots` rows)
  shards: int = 1
  accepted: tuple[tuple[int, float], ...] = ()  # speculation: (budget, mean accepted length)
  prefill_ms_per_token: float = 0.0
  divided: DividedRollout = DividedRollout()
  multi_step: int = 1  # plain steps per launch (speculative steps run one per launch)
  pipeline: bool = False  # outputs read one launch late (the engine's `pipeline`)
  # one-step launches once nothing waits: the engine's drain_steps "single" (and "cost"'s
  # choice where host time is free, as here)
  drain_single_step: bool = False

  def __post_init__(self):
    if self.multi_step < 1:
      raise ValueError(f"SimConfig: multi_step={self.multi_step}: must be >= 1")
    if self.slots < 1 or self.shards < 1:
      raise ValueError(f"SimConfig: slots={self.slots}, shards={self.shards}: must be >= 1")
    if self.slots not in self.buckets:
      raise ValueError(f"SimConfig: slots={self.slots} must be one of buckets={self.buckets}")
    for budget, a in self.accepted:
      if not 1.0 <= a <= budget + 1:
        raise ValueError(f"SimConfig: accepted length {a} at budget {budget} must lie in "
                         f"[1, budget + 1]")


@dataclasses.dataclass
class _Job:
  meta: RequestMeta
  length: int
  progress: float = 0.0
  since: float = 0.0  # progress when last admitted
  shard: int = -1  # shard it last ran on
  yielded_at: int = -1  # its shard's launch count when it last yielded
  seen: float = 0.0  # progress as the host last read it (pipelining: a launch behind)


@dataclasses.dataclass
class SimResult:
  finish_ms: np.ndarray  # per request, in input order
  makespan_ms: float
  tail_ms: float  # time to finish the last 10% of requests
  utilisation: float  # live row-time / (shards x slots x makespan)
  steps: int
  spec_steps: int
  tokens: float  # tokens generated (equals the sum of lengths)
  prefill_tokens: int
  migrations: int  # resumptions on another shard (divided rollout)
  shard_end_ms: np.ndarray
  peak_started: int = 0  # most requests started and unfinished at once (KV held), all shards
  yields: int = 0  # divided rollout: slots given up
  yield_passes: int = 0  # steps of a shard that gave up at least one (one copy call each way)
  launches: int = 0  # compiled calls: steps, fewer with multi_step > 1
  # per request, when the step that computed its last token ended (finish_ms is when its launch
  # ended, the soonest the host can see it): equal at one step per launch
  step_finish_ms: np.ndarray | None = None

  @property
  def step_tail_ms(self) -> float:
    """The tail on the step clock (`step_finish_ms`): what the order achieved, without the
    launch's granularity in which the host sees it."""
    return tail_time(self.step_finish_ms) if len(self.step_finish_ms) else 0.0


def tail_start(finish_ms: np.ndarray, share: float = 0.1) -> float:
  """The time by which all but the last `share` of requests had finished."""
  done = np.sort(np.asarray(finish_ms, np.float64))
  return float(done[max(int(math.ceil((1 - share) * len(done))), 1) - 1])


def tail_time(finish_ms: np.ndarray, share: float = 0.1) -> float:
  """Makespan minus `tail_start`: the time the last `share` of requests took to finish."""
  return float(np.max(finish_ms)) - tail_start(finish_ms, share)


def simulate(jobs: Sequence[tuple[RequestMeta, int]],
             make_policy: Callable[[], AdmissionPolicy], table: StepTimeTable,
             config: SimConfig = SimConfig(),
             plan: Mapping[Hashable, int] | None = None) -> SimResult:
  """Runs every (request, true length) to completion; `plan` maps group -> shard (required
  when shards > 1)."""
  cfg = config
  buckets = tuple(b for b in cfg.buckets if b <= cfg.slots)
  accepted = dict(cfg.accepted)
  divided = cfg.divided.chunk > 0
  if cfg.shards > 1 and plan is None:
    raise ValueError("simulate: shards > 1 needs a plan (group -> shard)")
  work = [_Job(m, int(n)) for m, n in jobs]
  if any(j.length < 1 for j in work):
    raise ValueError("simulate: every request needs a true length >= 1")
  queues: list[list[_Job]] = [[] for _ in range(cfg.shards)]
  for j in work:
    q = 0 if plan is None else plan[j.meta.group_id]
    if not 0 <= q < cfg.shards:
      raise ValueError(f"simulate: plan sends group {j.meta.group_id!r} to shard {q} of "
                       f"{cfg.shards}")
    queues[q].append(j)
  policies = [make_policy() for _ in range(cfg.shards)]
  for q in range(cfg.shards):  # the policy's opening order
    by_id = {j.meta.request_id: j for j in queues[q]}
    queues[q] = [by_id[m.request_id] for m in policies[q].order([j.meta for j in queues[q]])]

  finished: dict[int, int] = {}
  live_len: dict[int, int] = {}
  finish_at: dict[int, float] = {}
  step_finish_at: dict[int, float] = {}
  t = [0.0] * cfg.shards
  rows: list[list[_Job]] = [[] for _ in range(cfg.shards)]
  # Pipelining: per shard, the last launch's rows with their progress, not read yet, the
  # requests that yielded while it ran (they rejoin a queue once it is read), and its steps.
  unread: list[tuple[list, list[_Job], int] | None] = [None] * cfg.shards
  steps = spec_steps = prefill_tokens = migrations = peak_started = yields = passes = 0
  shard_launches = [0] * cfg.shards
  started = 0
  tokens = busy = now = 0.0

  def donor(s: int) -> int | None:
    """Where shard `s` admits from: its own queue; once that is dry (divided rollout), the
    longest other queue of a shard holding at least two more requests (so work never moves
    back and forth between balanced shards)."""
    if queues[s] or not divided:
      return s if queues[s] else None
    others = [d for d in range(cfg.shards) if d != s and queues[d]
              and len(rows[d]) + len(queues[d]) >= len(rows[s]) + 2]
    return max(others, key=lambda d: (len(queues[d]), -d)) if others else None

  def requeue(j: _Job, s: int) -> None:
    """A yielded request rejoins the queue where it balances shards: the fewest live + queued,
    its own first."""
    d = min(range(cfg.shards), key=lambda d: (len(rows[d]) + len(queues[d]), d != s, d))
    if policies[d].online:
      queues[d].append(j)
    else:  # started requests outrank every request still waiting under a static order
      queues[d].insert(sum(x.progress > 0 for x in queues[d]), j)

  def read(s: int) -> None:
    """The host reads shard `s`'s unread launch: requests that ended in it finish (their rows
    free up), the others' counts advance, and the requests that yielded meanwhile rejoin."""
    nonlocal started
    snapshot, landed, _ = unread[s]
    unread[s] = None
    for j, progress in snapshot:
      rid = j.meta.request_id
      if rid in finished:
        continue
      j.seen = progress
      if progress >= j.length:
        finished[rid] = j.length
        live_len.pop(rid, None)
        started -= 1
        for lst in (*rows, *queues):  # a free yield may have moved it since (divided rollout)
          if j in lst:
            lst.remove(j)
      else:
        live_len[rid] = int(progress)
    for j in landed:
      if j.meta.request_id not in finished:
        requeue(j, s)

  while True:
    active = [s for s in range(cfg.shards)
              if rows[s] or unread[s] is not None or donor(s) is not None]
    if not active:
      break
    s = min(active, key=lambda s: (t[s] if rows[s] else max(t[s], now), s))
    t[s] = max(t[s], now) if not rows[s] else t[s]  # an idle shard wakes when work appears
    now = t[s]
    prefill = 0
    while len(rows[s]) < cfg.slots and (d := donor(s)) is not None:
      queue = queues[d]
      j = queue.pop(policies[d].next_to_admit([x.meta for x in queue], finished, live_len))
      resumed_in_place = j.shard == s and (cfg.divided.keep_kv or
                                           j.yielded_at == shard_launches[s])
      if j.progress == 0 or not resumed_in_place:
        prefill += j.meta.prompt_len + int(j.progress)
        migrations += j.progress > 0 and j.shard != s
      started += j.progress == 0
      j.shard, j.since = s, j.seen
      rows[s].append(j)
      live_len[j.meta.request_id] = int(j.seen)
    if not rows[s]:  # nothing to run until the launch in flight is read
      read(s)
      continue
    prefill_tokens += prefill
    t[s] += prefill * cfg.prefill_ms_per_token
    bucket = bucket_for(len(rows[s]), buckets) if cfg.shrink else cfg.slots
    budget, advance = table.best_budget(bucket, accepted) if accepted else (0, 1.0)
    waiting = donor(s) is not None
    k = 1
    drain = cfg.drain_single_step and not waiting
    if cfg.multi_step > 1 and budget == 0 and not drain:  # the engine's token-cap rule
      # The engine counts a row's tokens as read plus the launch in flight's (it cannot know
      # that one ended inside it): progress, but for a row that ended in the unread launch.
      ended = {id(j): j.seen + unread[s][2] for j, _ in unread[s][0]} if unread[s] else {}
      left = [j.meta.max_new_tokens - ended.get(id(j), j.progress) for j in rows[s]
              if j.meta.max_new_tokens]
      if not left or (min(left) if waiting else max(left)) >= cfg.multi_step:
        k = cfg.multi_step
    dt = table.ms(bucket, budget)
    launch_start = t[s]
    t[s] += k * dt
    steps += k
    shard_launches[s] += 1
    peak_started = max(peak_started, started)
    spec_steps += budget > 0
    for j in rows[s]:
      if j.progress >= j.length:  # ended in the launch before, not read yet: a dead row
        continue
      step_tokens = min(advance * k, j.length - j.progress)
      busy += dt * min(k, math.ceil(step_tokens / advance - 1e-9))
      j.progress += step_tokens
      tokens += step_tokens
      if j.progress >= j.length:
        finish_at[j.meta.request_id] = t[s]
        step_finish_at[j.meta.request_id] = (  # the launch's step that made its last token
            launch_start + dt * max(math.ceil(step_tokens / advance - 1e-9), 1))
    if unread[s] is not None:  # the launch before this one, read while this one runs
      read(s)
    unread[s] = ([(j, j.progress) for j in rows[s]], [], k)
    if not (cfg.pipeline and waiting):  # unpipelined, or nothing waits: read at once
      read(s)
    rule, keep, free, parked = None, list(rows[s]), [], []
    for j in rows[s]:  # divided rollout: asked as rollout/divided.py asks, once per pass
      if not cfg.divided.should_yield(j.seen - j.since):
        continue
      if queues[s] and policies[s].online:
        if len(queues[s]) <= cfg.slots - len(keep):  # the queue fills the free slots anyway
          break
        if rule is None:  # the slots free now take its first picks; each yield the next
          rule = yield_rule(policies[s], [x.meta for x in queues[s]], finished, live_len,
                            cfg.divided.chunk, cfg.slots - len(rows[s]))
        j.since = j.seen  # offered again after another chunk
        if not rule(j.meta):
          continue
        parked.append(j)  # a real preemption: the slot goes to another, the KV row is parked
      else:  # a static order's yield, or one with an empty queue: free, requeued at once
        free.append(j)
      keep.remove(j)
      j.yielded_at = shard_launches[s]
    rows[s] = keep
    if parked:
      t[s] += len(parked) * cfg.divided.yield_ms + cfg.divided.pass_ms
      yields, passes = yields + len(parked), passes + 1
    if unread[s] is not None:  # parked ones are still in the launch in flight: they rejoin
      unread[s][1].extend(parked)  # once it is read
      parked = []
    for j in parked + free:
      requeue(j, s)
  finish = np.array([finish_at[j.meta.request_id] for j in work], np.float64)
  makespan = float(finish.max()) if len(finish) else 0.0
  return SimResult(finish, makespan, tail_time(finish) if len(finish) else 0.0,
                   busy / max(cfg.shards * cfg.slots * makespan, 1e-12), steps, spec_steps,
                   tokens, prefill_tokens, migrations, np.array(t), peak_started, yields,
                   passes, sum(shard_launches),
                   np.array([step_finish_at[j.meta.request_id] for j in work], np.float64))
