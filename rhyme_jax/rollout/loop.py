"""One rollout: the loop that runs `RolloutEngine.generate`'s requests to completion.

A `Rollout` holds what lives only as long as one `generate` call: the queue, the slots and
their device state, the step in flight, divided rollout's parked requests, the results so far.
Each pass of `run`:

  1. divided rollout: running requests that have generated `divide_every` tokens since they
     were (re)admitted may give their slot to a queued one (`_yield_pass`);
  2. free slots take queued requests in the admission order's choice (`_fill_slots`);
  3. with no queue, the live rows move into a smaller bucket where that pays (tail.py);
  4. the engine decides whether to draft (`RolloutEngine._plan`); drafts need the previous
     step's tokens and a bucket move a quiet state, so those read the step in flight first;
  5. the next step is drafted, packed and dispatched (`_dispatch`), and only then is the step
     before it read (`_process`): the host's bookkeeping overlaps the device's work. Without
     drafts a launch may run `EngineConfig.multi_step` plain steps in one call
     (`_launch_steps`), so that host work is paid once per several tokens per row.

The engine owns what outlives a rollout (compiled functions, params, the cost model, the
drafter); this module owns the order in which a rollout uses them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from rhyme_jax.rollout import accept, step
from rhyme_jax.rollout.divided import YieldRules, park, slots_to_yield
from rhyme_jax.rollout.interface import AdmissionOrder, EngineStats, Request, RequestResult
from rhyme_jax.rollout.live import LiveRequest, validate
from rhyme_jax.rollout.sampling import needs_filtering
from rhyme_jax.rollout.tail import FinishedLengths, bucket_target, drain_single


@dataclasses.dataclass
class _Step:
  """A dispatched step whose outputs are not read yet."""

  out: jax.Array  # its outputs as one array (step.to_wire)
  # (slot, LiveRequest, drafted, verified depth (-1: none), drafter probs per depth, gain expected)
  rows: list
  shape: tuple
  steps: int = 1  # decode steps the launch ran (plain steps only when > 1: multi_step)
  asked: bool = False  # drafts were asked for (even if the step ended up plain)
  # "auto" only: the gain the asking decision expected of asking (0.0: it did not ask)
  ask_gain: float | None = None
  timed: bool = False  # its completion-to-completion time is its shape's cost
  ahead: concurrent.futures.Future | None = None
  ahead_rows: list | None = None
  # since the step before was dispatched: (yields, requests prefilled, requests resumed, host
  # seconds outside blocking reads)
  events: tuple = (0, 0, 0, 0.0)


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - t0


class Rollout:
  """One `generate` call's state and loop; see the module docstring. `run` once."""

  def __init__(self, engine, requests: Sequence[Request], admission: AdmissionOrder | None):
    """`engine`: the `RolloutEngine` whose compiled parts the rollout uses (not imported here)."""
    self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
    self.engine = engine
    self.cfg = cfg = engine.config
    engine.stats = self.stats = EngineStats()
    self.admission = admission
    self.results: list[RequestResult | None] = [None] * len(requests)  # in their order
    self.position: dict[int, int] = {}  # request_id -> position (unique once valid)
    self.queue: list[Request] = []
    seen: set = set()
    for i, req in enumerate(requests):
      err = validate(req, seen, engine.model_config.vocab_size, cfg.max_len)
      seen.add(req.request_id)
      if err:
        self.results[i] = RequestResult(
            req.request_id, req.group_id, np.asarray(req.prompt, np.int32),
            np.zeros(0, np.int32), np.zeros(0, np.float32), "error", error=err)
      else:
        self.position[req.request_id] = i
        self.queue.append(req)
    if admission is not None:
      opening = list(admission.order(self.queue))
      if sorted(map(id, opening)) != sorted(map(id, self.queue)):
        raise ValueError("generate: admission.order(requests) must return a permutation of the "
                         "valid requests")
      self.queue = opening
    self.finished_len: dict[int, int] = {}  # request id -> response length, for online orders
    self.lengths = FinishedLengths(self.finished_len)  # and for bucket moves
    # request id -> tokens so far of each started, unfinished request (running or parked),
    # kept in place as steps are read, for online orders
    self.live_len: dict[int, int] = {}
    self.tracking = admission is not None
    self.group_left = collections.Counter(r.group_id for r in self.queue)  # live + queued
    self.filters = needs_filtering([r.params for r in self.queue])
    self.bucket = engine.bucket_for(len(self.queue))
    self.state = engine._new_state(self.bucket)
    self.slots: list[LiveRequest | None] = [None] * self.bucket
    self.overlap = cfg.draft_mode != "sync" and hasattr(engine.drafter, "lookahead")
    self.ahead_only = self.overlap and cfg.draft_mode == "ahead_only"
    if self.overlap and engine._pool is None:
      engine._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead")
    self.pending: _Step | None = None
    # Divided rollout (divided.py) with an online admission order: requests that yielded their
    # slot wait in the park pool, KV row and record.
    self.dividing = cfg.divide_every > 0 and getattr(admission, "online", False)
    self.pool = engine.park_pool() if self.dividing else None
    self.rules = (YieldRules(admission, self.finished_len, self.live_len, cfg.divide_every)
                  if self.dividing else None)
    if self.pool is not None:
      self.pool.reset()
      if engine.yield_steps is not None and hasattr(admission, "set_yield_cost"):
        admission.set_yield_cost(engine.yield_steps)
    self.landing: list[LiveRequest] = []  # parked while their last step is unread
    # A step's cost is the time from the previous step's outputs to its own: the device runs
    # steps in order, so this is its device time plus whatever kept the device idle before it
    # (the host reading the previous step, planning and drafting when speculation broke the
    # pipeline), and a step dispatched behind a speculative one does not inherit its time. Not
    # timed: a step behind a prefill or a bucket move (their device time lands in its
    # interval), and a plain step that drafts were asked for (then not verified).
    self.last_ready: float | None = None
    self.events = [0, 0, 0]  # yields, prefills and resumes dispatched since the last step
    # host time since the last step's dispatch, less blocking reads: (start, reads so far)
    self.host_from = (time.perf_counter(), 0.0)
    self.untimed = False  # a prefill or bucket move was dispatched since the previous step
    self.pass_s: float | None = None  # EMA of host_s: what a drained pipeline idles the device

  # ---- the loop --------------------------------------------------------------------------------

  def run(self) -> list[RequestResult]:
    """Runs every valid request to completion; results in the order of the requests."""
    engine, cfg = self.engine, self.cfg
    while self.queue or any(self.slots) or self.pending is not None:
      if self.dividing and self.queue:  # divided rollout: rows give way to queued requests
        self._yield_pass()
      self._fill_slots()
      live_idx = [i for i in range(self.bucket) if self.slots[i] is not None]
      target = bucket_target(self, live_idx)
      if self.pending is None and target < self.bucket:
        live_idx = self._move(live_idx, target)
      context = self._context(live_idx) if live_idx else (0, 0)  # (longest, in flight)
      speculate, ask_gain = (engine._plan(self.bucket, self.slots, live_idx, sum(context))
                             if live_idx else (False, None))
      moves = target < self.bucket
      if self.pending is not None and (speculate or moves or not cfg.pipeline or not live_idx):
        # Drafts need the step's emitted tokens, a bucket move a quiet state: read it now.
        self._process(self.pending, blocking=True)
        self.pending = None
        continue
      if not live_idx:
        break
      st = self._dispatch(live_idx, speculate, ask_gain, context)
      if self.pending is not None:  # read the previous step while this one runs
        self._process(self.pending, blocking=False)
      self.pending = st
    stats = self.stats
    stats.total_time_s = time.perf_counter() - self.t0
    stats.cpu_time_s = time.thread_time() - self.cpu0
    stats.parked_peak = self.pool.peak if self.pool is not None else 0
    stats.yield_rules = self.rules.built if self.rules is not None else 0
    return self.results

  # ---- a pass's parts, in loop order -----------------------------------------------------------

  def _yield_pass(self) -> None:
    """Marks the running requests that give way to queued ones and parks them (divided.py).
    Parked behind the step in flight (the device copies their KV after it), they rejoin the
    queue once that step is read, with its tokens (`_process`)."""
    ty = time.perf_counter()
    marked = slots_to_yield(self.slots, self.queue, self.rules, self.cfg.divide_every,
                            self.pool.free_rows())
    if marked:
      self.rules.changed()
    park(self.pool, self.slots, marked, self.queue, None if self.pending is None else self.landing)
    self.events[0] += len(marked)
    self.stats.yields += len(marked)
    self.stats.yield_passes += bool(marked)
    self.untimed = self.untimed or bool(marked)
    self.stats.yield_time_s += time.perf_counter() - ty

  def _fill_slots(self) -> None:
    """Admits queued requests into the free slots, in the admission order's choice; a parked
    request resumes with its tokens so far (the engine copies its KV row back)."""
    admission, queue, slots, pool = self.admission, self.queue, self.slots, self.pool
    admits, resumed = [], {}
    for i in range(self.bucket):
      if slots[i] is None and queue:
        k = 0 if admission is None else admission.next_to_admit(queue, self.finished_len,
                                                                self.live_len)
        if not 0 <= k < len(queue):
          raise ValueError(f"generate: admission.next_to_admit returned {k} for a queue of "
                           f"{len(queue)}")
        req = queue.pop(k)
        if self.rules is not None:
          self.rules.changed()
        admits.append((i, req))
        lv = pool.record(req.request_id) if pool is not None else None
        if lv is None:
          lv = LiveRequest(req)
          self.stats.admitted.append(req.request_id)
        else:
          resumed[req.request_id] = lv.tokens
          lv.since = len(lv.tokens)
        slots[i] = lv
        if self.tracking:
          self.live_len[req.request_id] = len(lv.tokens)
    self.state = self.engine._admit(self.state, admits, resumed, slots)
    self.events[1] += len(admits) - len(resumed)
    self.events[2] += len(resumed)
    self.untimed = self.untimed or bool(admits)

  def _move(self, live_idx: list[int], target: int) -> list[int]:
    """With nothing in flight, moves the live rows down to bucket `target` (one level per
    move: `RolloutEngine._shrink`); returns their new slots."""
    engine = self.engine
    while self.bucket > target:
      rows = live_idx + [i for i in range(len(self.slots)) if self.slots[i] is None]
      self.state, self.bucket = engine._shrink(self.state, self.bucket, rows)
      self.slots = [self.slots[i] for i in rows[:self.bucket]]
      live_idx = list(range(len(live_idx)))
      self.untimed = True
      self.stats.bucket_moves += 1
    return live_idx

  def _dispatch(self, live_idx: list[int], speculate: bool, ask_gain: float | None,
                context: tuple[int, int]) -> _Step:  # context: `_context(live_idx)`
    """Drafts (if `speculate`: `RolloutEngine._draft`), packs and dispatches the next step."""
    engine, stats, slots, bucket = self.engine, self.stats, self.slots, self.bucket
    longest, in_flight = context
    live_B = tuple(slots[i] is not None for i in range(bucket))
    wide, drafted = [], 0
    if speculate:
      td = time.perf_counter()
      trees, per_slot, p, t, wide = engine._draft(bucket, slots, live_idx, longest + in_flight,
                                                  self.overlap, self.ahead_only)
      stats.draft_time_s += time.perf_counter() - td
      rows = [(i, slots[i], *per_slot[i]) for i in live_idx]
      drafted = sum(r[2] for r in rows)
    else:
      trees, p, t = None, bucket, 1
      rows = [(i, slots[i], 0, 0, None, None) for i in live_idx]
    k = 1 if speculate else self._launch_steps(live_idx, in_flight, longest)
    s = engine._kv_len_for(longest + in_flight + t * k)
    wire = (engine._plain_roots(live_B) if t == 1 and not drafted else
            accept.pack(trees, live_B, p).wire())
    tv = time.perf_counter()
    self.state, out = engine._verify_wire(self.state, wire, self.filters, s, t, k)
    out.copy_to_host_async()  # queued behind the step: its outputs are on the host when read
    now = time.perf_counter()
    stats.dispatch_time_s += now - tv
    host_s = now - self.host_from[0] - (stats.device_time_s - self.host_from[1])
    self.host_from = (now, stats.device_time_s)
    self.pass_s = host_s if self.pass_s is None else (  # an EMA of the cost model's weight
        self.pass_s + engine.costs.ema * (host_s - self.pass_s))
    shape = (bucket, p, t, s)
    st = _Step(out, rows, shape, k, asked=speculate, ask_gain=ask_gain,
               timed=(t > 1 or not speculate) and not self.untimed,
               events=(*self.events, host_s))
    self.events = [0, 0, 0]
    self.untimed = False
    if wide:
      st.ahead = engine._pool.submit(_timed, engine.drafter.lookahead, wide)
      st.ahead_rows = [slots[i] for i in live_idx]
    stats.steps += k
    stats.launches += 1
    stats.spec_steps += t > 1
    stats.asked_steps += speculate
    stats.steps_by_shape[shape] += k
    stats.slot_steps += bucket * k
    stats.positions += p * k
    stats.live_positions += (len(live_idx) + drafted) * k
    stats.trace.append((bucket, p, len(live_idx), len(self.queue)))
    return st

  def _context(self, live_idx: list[int]) -> tuple[int, int]:
    """(The longest live row's length, the tokens per row the step in flight may add.)"""
    return (max(len(self.slots[i].req.prompt) + len(self.slots[i].tokens) for i in live_idx),
            0 if self.pending is None else self.pending.shape[2] * self.pending.steps)

  def _launch_steps(self, live_idx: list[int], in_flight: int, longest: int) -> int:
    """Plain steps the next launch runs: `EngineConfig.multi_step`, or 1 where a longer launch
    would step past token caps (an end at EOS cannot be foreseen): while requests wait, where
    any live row would reach its cap inside it (its slot would idle until the launch ends);
    with none waiting, where every row would (it would run on for nobody), or where
    `EngineConfig.drain_steps` says (`tail.drain_single`)."""
    k, waiting = self.cfg.multi_step, bool(self.queue or self.landing)  # landing: to requeue
    if k == 1 or (not waiting and drain_single(self, longest + in_flight)):
      return 1
    left = [self.slots[i].req.params.max_new_tokens - len(self.slots[i].tokens) - in_flight
            for i in live_idx]
    return 1 if (min(left) if waiting else max(left)) < k else k

  # ---- reading a step --------------------------------------------------------------------------

  def _process(self, st: _Step, blocking: bool) -> None:
    """Reads a step's outputs (blocking: no later step is queued, the device idles)."""
    engine, cfg, stats = self.engine, self.cfg, self.stats
    tw = time.perf_counter()
    wire = jax.device_get(st.out)  # one copy for the step's three outputs
    ready = time.perf_counter()
    waited = 0.0  # for drafts made ahead (not reading)
    tokens_BxT, logp_BxT, num_B = (a.tolist() for a in step.from_wire(wire))  # read per item
    stats.device_time_s += ready - tw
    stats.host_waits += blocking
    stats.timeline.append((ready - self.t0, st.shape, *st.events, st.steps))
    if st.timed and self.last_ready is not None:  # a multi-step launch: its mean step
      engine.costs.observe_time(st.shape, (ready - self.last_ready) / st.steps)
    self.last_ready = ready
    if st.ahead is not None:
      tw = time.perf_counter()
      wide_trees, seconds = st.ahead.result()
      waited = time.perf_counter() - tw
      stats.lookahead_wait_s += waited
      stats.lookahead_time_s += seconds
      for lv, tree in zip(st.ahead_rows, wide_trees):
        lv.ahead, lv.ahead_from = tree, len(lv.tokens)
    asked = st.shape[2] > 1 or st.asked
    multi = st.steps > 1  # a multi-step launch: each row's tokens are `steps` plain steps
    # The step's totals, added to stats once: rows counted when read (a discarded pipelined
    # row is not useful), tokens as kept (up to a row's end)
    accepted = useful = drafted_all = kept = 0
    eos_ids, drafter, costs = cfg.eos_ids, engine.drafter, engine.costs
    tracking, live_len = self.tracking, self.live_len
    for slot, lv, drafted, depth, offered, expected in st.rows:
      if lv.done:  # finished in an earlier step; this pipelined step's row is discarded
        continue
      emitted = num_B[slot]
      row, row_logp = tokens_BxT[slot], logp_BxT[slot]
      reason, n = None, emitted
      for k in range(emitted):
        lv.tokens.append(row[k])
        lv.logprobs.append(row_logp[k])
        reason = lv.finish_reason(eos_ids)
        if reason:
          n = k + 1
          break
      # verify steps the row took part in (up to its end) and drafts it had accepted
      took, got = (n, 0) if multi else (1, min(emitted - 1, n))  # drafts kept, to its end
      lv.steps += took
      useful += took
      lv.drafted += drafted
      lv.accepted += got
      drafted_all += drafted
      accepted += got
      if asked and depth >= 0:
        costs.observe_acceptance(lv.req.request_id, depth, emitted - 1, offered, expected)
      kept += n
      if tracking:
        live_len[lv.req.request_id] = len(lv.tokens)
      if drafter is not None:
        drafter.observe(lv.req.request_id, lv.req.group_id, np.asarray(row[:n], np.int32),
                        drafted, got)
      if reason:
        self._finish(slot, lv, reason)
    stats.useful_slot_steps += useful
    stats.drafted += drafted_all
    stats.accepted += accepted
    stats.tokens += kept
    if st.ask_gain is not None:  # "auto" weighed asking for drafts for this step
      if st.asked:
        costs.observe_asked(st.ask_gain, accepted)
      else:
        costs.not_asked()
    for lv in self.landing:  # parked while this step ran: now it may resume, or it has ended
      if lv.done:
        self.pool.drop(lv.req.request_id)
      else:
        self.queue.append(lv.req)
        self.rules.changed()
    self.landing.clear()
    stats.read_time_s += time.perf_counter() - ready - waited

  def _finish(self, slot: int, lv: LiveRequest, reason: str) -> None:
    """Records a finished request's result and frees what it held: its slot (unless it was
    parked in flight), the cost model's and the drafter's state for it."""
    rid, gid = lv.req.request_id, lv.req.group_id
    self.results[self.position[rid]] = lv.result(reason, time.perf_counter() - self.t0)
    lv.done = True
    self.finished_len[rid] = len(lv.tokens)
    self.live_len.pop(rid, None)
    if self.rules is not None:
      self.rules.changed()
    if self.slots[slot] is lv:  # a request parked in flight no longer holds its slot
      self.slots[slot] = None
    engine = self.engine
    engine.costs.forget(rid)
    if engine.drafter is not None:
      engine.drafter.finish(rid, gid)
      self.group_left[gid] -= 1
      if self.group_left[gid] == 0 and hasattr(engine.drafter, "end_group"):
        engine.drafter.end_group(gid)
