"""The rollout engine: continuous batching over static-shape slots with lossless tree speculation.

Requests wait in a queue; B slots (B from a fixed set of buckets) each hold one live request
and its KV cache. A finished slot is refilled at once; when the queue is empty and the live
requests fit a smaller bucket they are moved into it, so the tail of a rollout stops paying
for empty slots. Each step packs the live rows' roots and draft nodes on one token axis of a
compiled size (accept.pack; a plain step is the roots alone). The engine alone sizes drafts:
the cost model (cost_model.CostModel) picks, per step, the shape and the nodes per row with the
most expected tokens per second, and plain steps are dispatched before the previous step is
read, so the host's bookkeeping overlaps the device. Step functions are jitted once per shape
(bucket, packed size, tokens per row, cache bucket) at warm-up.

Requests are admitted in arrival order, or in the order of an `AdmissionOrder` (scheduling/:
longest predicted first, cross-step alternation, Seer probe-first); the order changes when a
request runs, never what it samples. The engine is the narrow interface the trainer sees:
`generate(requests, admission=None) -> results` and `update_params(model)`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_jax.models.attention import KVCache, resolve_attention
from rhyme_jax.models.transformer import Transformer
from rhyme_jax.rollout import accept, compiled, step, warmup
from rhyme_jax.rollout.compiled import TRACE_COUNTS  # noqa: F401  (re-exported for tests)
from rhyme_jax.rollout.cost_model import CostModel
from rhyme_jax.rollout.divided import ParkPool, YieldCost, YieldRules, park, slots_to_yield
from rhyme_jax.rollout.drafts import DraftSource, cleaned_drafts
from rhyme_jax.rollout.interface import (  # noqa: F401  (the interface, re-exported)
    DRAFT_MODES, SPECULATE, AdmissionOrder, EngineConfig, EngineStats, Request, RequestResult)
from rhyme_jax.rollout.live import LiveRequest, tree_depths, validate
from rhyme_jax.rollout.sampling import needs_filtering


@dataclasses.dataclass
class _Step:
  """A dispatched step whose outputs are not read yet."""

  out: jax.Array  # its outputs as one array (step.to_wire)
  # (slot, LiveRequest, drafted nodes, depth of the verified tree (-1: nothing to learn), the
  # verified nodes' drafter probabilities summed per depth (None: it gave none), and the gain
  # the cost model expected of them)
  rows: list
  shape: tuple
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


class RolloutEngine:
  """Generates responses for many requests; see the module docstring."""

  def __init__(self, model: Transformer, config: EngineConfig, drafter: DraftSource | None = None):
    self.config = config
    self.model_config = model.cfg
    self.graphdef, self.params = nnx.split(model)
    self._leaves, treedef = jax.tree.flatten(self.params)
    self._verify_fn, self._prefill_fn = compiled.model_fns(self.graphdef, treedef)
    # The attention implementation every step compiles with (logs why once if it falls back);
    # a kernel reads only live KV, so it needs no cache-length buckets.
    self.attention_impl = resolve_attention(config.attention, model.cfg, config.cache_len)
    self.kv_lengths = (config.kv_lengths() if self.attention_impl == "xla"
                       else (config.cache_len,))
    self._seed = jnp.uint32(config.seed)
    # A plain step's packed roots depend only on which slots are live: the last one packed is
    # kept (as its one wire array) and reused while they stay the same, most plain steps.
    self._plain_wire: tuple[tuple, np.ndarray] | None = None
    self.drafter = drafter
    self.costs = CostModel()
    self.stats = EngineStats()
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # for drafting ahead
    self._parked: ParkPool | None = None  # divided rollout's KV rows, made on first use
    # What yields' row copies cost on this device (warm-up, ParkPool.warmup): passes of one
    # and of several yields, queued as a rollout dispatches them.
    self.yield_cost: YieldCost | None = None

  @property
  def yield_seconds(self) -> float | None:
    """A pass of one yield (its two row copies), queued: the cost handed to the admission
    order (a yield that shares its pass with others costs less: `yield_cost.per_row`)."""
    return None if self.yield_cost is None else self.yield_cost.one

  @property
  def yield_seconds_waited(self) -> float | None:
    """The same pass, waited for (for comparison; adds a host round trip no rollout makes)."""
    return None if self.yield_cost is None else self.yield_cost.one_waited

  @property
  def yield_steps(self) -> float | None:
    """`yield_seconds` in decode steps: over a plain step of the largest bucket at the longest
    cache length (warm-up times); None before a warm-up with park rows."""
    if self.yield_cost is None:
      return None
    b = max(self.config.buckets)
    return self.yield_cost.one / self.costs.warm[(b, b, 1, self.kv_lengths[-1])]

  def _place(self, tree):
    """`tree` on the params' mesh (replicated) when they have one, so the first step sees the
    placement every later step does (otherwise it would compile a second variant)."""
    sharding = self._leaves[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.device_put(tree, jax.sharding.NamedSharding(sharding.mesh,
                                                             jax.sharding.PartitionSpec()))
    return tree

  def park_pool(self) -> ParkPool:
    if self._parked is None:
      self._parked = ParkPool(self.model_config, self.config.park_rows, self.config.cache_len,
                              self._place)
    return self._parked

  def _new_state(self, bucket: int) -> step.DecodeState:
    """A fresh state, placed as every later step's (`_place`)."""
    return self._place(step.DecodeState.empty(KVCache.zeros(self.model_config, bucket,
                                                            self.config.cache_len)))

  def _shrink(self, state: step.DecodeState, bucket: int, order: list[int]):
    """Moves rows `order` into the next smaller bucket (one level at a time, so only
    len(buckets) - 1 regroup shapes ever compile)."""
    smaller = max(b for b in self.config.buckets if b < bucket)
    return compiled.regroup_jit(state, jnp.asarray(order[:smaller], jnp.int32)), smaller

  def shapes(self, bucket: int) -> list[tuple[int, int]]:
    """(P, T) of every compiled step of a bucket, plain first."""
    return [(bucket, 1)] + list(self.config.spec_shapes(bucket))

  def warmup(self, filters: bool = False) -> None:
    """Compiles every step shape, the prefill, slot loading and bucket moves up front, so a
    rollout never compiles; times each step shape to seed the cost model (`warmup.warm_up`)."""
    warmup.warm_up(self, filters)

  def update_params(self, model_or_params) -> None:
    """Swaps in new weights (same structure); compiled functions are kept."""
    if isinstance(model_or_params, nnx.Module):
      _, self.params = nnx.split(model_or_params)
    else:
      self.params = model_or_params
    self._leaves = jax.tree.leaves(self.params)

  def verify(self, state: step.DecodeState, trees: accept.PackedTrees, filters: bool,
             max_kv_len: int, max_q_len: int):
    """One jitted verify step (`step.verify_step`) with this engine's params: the new state and
    the step's outputs as one array (`step.to_wire`; `step.from_wire` reads it), the trees
    crossing to the device as one array too (`PackedTrees.wire`)."""
    return self._verify_wire(state, trees.wire(), filters, max_kv_len, max_q_len)

  def _verify_wire(self, state: step.DecodeState, wire: np.ndarray, filters: bool,
                   max_kv_len: int, max_q_len: int):
    return self._verify_fn(self._leaves, state, wire, self._seed, filters=filters,
                           max_kv_len=max_kv_len, max_q_len=max_q_len,
                           attention_impl=self.attention_impl)

  def _plain_roots(self, live_B: tuple[bool, ...]) -> np.ndarray:
    """The wire array of a plain step over the live slots `live_B` (`_plain_wire`)."""
    if self._plain_wire is None or self._plain_wire[0] != live_B:
      self._plain_wire = live_B, accept.pack([None] * len(live_B), live_B, len(live_B)).wire()
    return self._plain_wire[1]

  def bucket_for(self, n: int) -> int:
    """The smallest bucket holding n requests (the largest bucket if none does)."""
    fits = [b for b in self.config.buckets if b >= n]
    return min(fits) if fits else max(self.config.buckets)

  def _kv_len_for(self, need: int) -> int:
    return min((s for s in self.kv_lengths if s >= need),
               default=self.config.cache_len)

  # ---- request handling ------------------------------------------------------------------------

  def _admit(self, state: step.DecodeState, admits: list[tuple[int, Request]],
             resumed: dict[int, list] | None = None) -> step.DecodeState:
    """Prefills all but the last prompt token of each (slot, request); the last becomes the
    slot's root. A request in `resumed` ({request id: its tokens so far}) yielded its slot
    earlier (divided rollout): its KV row comes back from the park pool instead (all of them in
    one copy), and its last token is the root. Slot parameters are set for all admitted
    requests in one call."""
    if not admits:
      return state
    t0 = time.perf_counter()
    c = self.config.prefill_chunk
    cache = state.cache
    b = state.batch
    ints_5xB = np.zeros((5, b), np.int32)  # step.load_slots' rows: new, length, root, ...
    floats_2xB = np.ones((2, b), np.float32)  # temperature, top-p
    back = []  # (slot, request id) of resumed requests
    for slot, req in admits:
      prompt = np.asarray(req.prompt, np.int32)
      done = resumed.get(req.request_id) if resumed else None
      if done is not None:  # the KV of the prompt and all but its last token is parked
        back.append((slot, req.request_id))
        cached, last = len(prompt) + len(done) - 1, done[-1]
      else:
        cached, last = len(prompt) - 1, prompt[-1]
        for start in range(0, cached, c):
          # (slot, start, chunk) as one numpy array: jit moves it with the call in one transfer
          args = np.zeros(2 + c, np.int32)
          piece = prompt[start:min(start + c, cached)]
          args[:2] = slot, start
          args[2:2 + len(piece)] = piece
          cache = self._prefill_fn(self._leaves, cache, args)
          self.stats.prefill_chunks += 1
      p = req.params
      ints_5xB[:, slot] = 1, cached, last, req.request_id, p.top_k
      floats_2xB[:, slot] = p.temperature, p.top_p
    if back:
      cache = self._parked.resume(cache, back)
    state = compiled.load_slots_jit(state.replace(cache=cache), ints_5xB, floats_2xB)
    self.stats.prefill_time_s += time.perf_counter() - t0  # dispatch time (runs async)
    return state

  # ---- the loop --------------------------------------------------------------------------------

  def _plan(self, bucket: int, slots: list, live_idx: list[int]) -> tuple[bool, float | None]:
    """Whether to draft this step, and the gain expected of asking (None unless "auto" weighed
    it; 0.0 when it does not ask): "always" does; "auto" asks the cost model whether any
    speculative shape could beat a plain step with chains at each request's acceptance, scaled
    by what asking delivered so far."""
    mode = self.config.speculate if self.drafter is not None else "never"
    shapes = self.config.spec_shapes(bucket)
    if mode == "never" or not shapes:
      return False, None
    if mode == "always":
      return True, None
    s = self.kv_lengths[-1]
    cap = max(t for _, t in shapes) - 1
    values = [self.costs.node_values(slots[i].req.request_id, np.arange(1, cap + 1), None)
              for i in live_idx]
    shape, take, _ = self.costs.choose((bucket, bucket, 1, s),
                                       [(bucket, p, t, s) for p, t in shapes], values,
                                       len(live_idx), scale=self.costs.ask_scale)
    if shape[1] == bucket:
      return False, 0.0
    return True, float(sum(v[:n].sum() for v, n in zip(values, take)))

  def generate(self, requests: Sequence[Request], admission: AdmissionOrder | None = None
               ) -> list[RequestResult]:
    """Runs every request to completion; results in the order of `requests`.

    `admission` picks which queued request takes each free slot (default: arrival order).
    A request that cannot run (empty or too-long prompt, bad sampling params) gets a result with
    finish_reason "error" and a message; the others run as usual.
    """
    t0, cpu0 = time.perf_counter(), time.thread_time()
    self.stats = stats = EngineStats()
    cfg = self.config
    results: dict[int, RequestResult] = {}
    queue: list[Request] = []
    seen: set = set()
    for req in requests:
      err = validate(req, seen, self.model_config.vocab_size, self.config.max_len)
      seen.add(req.request_id)
      if err:
        results[id(req)] = RequestResult(req.request_id, req.group_id,
                                         np.asarray(req.prompt, np.int32), np.zeros(0, np.int32),
                                         np.zeros(0, np.float32), "error", error=err)
      else:
        queue.append(req)
    order = [id(r) for r in requests]
    if admission is not None:
      opening = list(admission.order(queue))
      if sorted(map(id, opening)) != sorted(map(id, queue)):
        raise ValueError("generate: admission.order(requests) must return a permutation of the "
                         "valid requests")
      queue = opening
    finished_len: dict[int, int] = {}  # request id -> response length, for online orders
    # request id -> tokens so far of each started, unfinished request (running or parked), kept
    # in place as steps are read, for online orders
    live_len: dict[int, int] = {}
    tracking = admission is not None
    group_left = collections.Counter(r.group_id for r in queue)  # live + queued per group
    filters = needs_filtering([r.params for r in queue])
    bucket = self.bucket_for(len(queue))
    state = self._new_state(bucket)
    slots: list[LiveRequest | None] = [None] * bucket
    overlap = cfg.draft_mode != "sync" and hasattr(self.drafter, "lookahead")
    ahead_only = overlap and cfg.draft_mode == "ahead_only"
    if overlap and self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead")
    pending: _Step | None = None
    # Divided rollout (divided.py) with an online admission order: requests that yielded their
    # slot wait in the park pool, KV row and record.
    dividing = cfg.divide_every > 0 and getattr(admission, "online", False)
    pool = self.park_pool() if dividing else None
    rules = YieldRules(admission, finished_len, live_len, cfg.divide_every) if dividing else None
    if pool is not None:
      pool.reset()
      if self.yield_steps is not None and hasattr(admission, "set_yield_cost"):
        admission.set_yield_cost(self.yield_steps)
    landing: list[LiveRequest] = []  # parked while their last step is unread
    # A step's cost is the time from the previous step's outputs to its own: the device runs
    # steps in order, so this is its device time plus whatever kept the device idle before it
    # (the host reading the previous step, planning and drafting when speculation broke the
    # pipeline), and a step dispatched behind a speculative one does not inherit its time.
    # Not timed: a step behind a prefill or a bucket move (their device time lands in its
    # interval), and a plain step that drafts were asked for (then not verified).
    last_ready = None
    events = [0, 0, 0]  # yields, prefills and resumes dispatched since the last step
    # host time since the last step's dispatch, less blocking reads: (start, reads so far)
    host_from = (time.perf_counter(), 0.0)
    untimed = False  # a prefill or bucket move was dispatched since the previous step

    def finish(slot: int, lv: LiveRequest, reason: str) -> None:
      results[id(lv.req)] = lv.result(reason, time.perf_counter() - t0)
      lv.done = True
      finished_len[lv.req.request_id] = len(lv.tokens)
      live_len.pop(lv.req.request_id, None)
      if rules is not None:
        rules.changed()
      if slots[slot] is lv:  # a request parked in flight no longer holds its slot
        slots[slot] = None
      self.costs.forget(lv.req.request_id)
      if self.drafter is not None:
        self.drafter.finish(lv.req.request_id, lv.req.group_id)
        group_left[lv.req.group_id] -= 1
        if group_left[lv.req.group_id] == 0 and hasattr(self.drafter, "end_group"):
          self.drafter.end_group(lv.req.group_id)

    def process(st: _Step, blocking: bool) -> None:
      """Reads a step's outputs (blocking: no later step is queued, the device idles)."""
      nonlocal last_ready
      tw = time.perf_counter()
      wire = jax.device_get(st.out)  # one copy for the step's three outputs
      ready = time.perf_counter()
      waited = 0.0  # for drafts made ahead (not reading)
      # Python lists: the row loop below reads them element by element
      tokens_BxT, logp_BxT, num_B = (a.tolist() for a in step.from_wire(wire))
      stats.device_time_s += ready - tw
      stats.host_waits += blocking
      stats.timeline.append((ready - t0, st.shape, *st.events))
      if st.timed and last_ready is not None:
        self.costs.observe_time(st.shape, ready - last_ready)
      last_ready = ready
      if st.ahead is not None:
        tw = time.perf_counter()
        wide_trees, seconds = st.ahead.result()
        waited = time.perf_counter() - tw
        stats.lookahead_wait_s += waited
        stats.lookahead_time_s += seconds
        for lv, tree in zip(st.ahead_rows, wide_trees):
          lv.ahead, lv.ahead_from = tree, len(lv.tokens)
      asked = st.shape[2] > 1 or st.asked
      # The step's totals, added to stats once: rows counted when read (a discarded pipelined
      # row is not useful), tokens as kept (up to a row's end)
      accepted = useful = drafted_all = kept = 0
      eos_ids, drafter = cfg.eos_ids, self.drafter
      for slot, lv, drafted, depth, offered, expected in st.rows:
        if lv.done:  # finished in an earlier step; this pipelined step's row is discarded
          continue
        emitted = num_B[slot]
        lv.steps += 1
        useful += 1
        lv.drafted += drafted
        lv.accepted += emitted - 1
        drafted_all += drafted
        accepted += emitted - 1
        if asked and depth >= 0:
          self.costs.observe_acceptance(lv.req.request_id, depth, emitted - 1, offered, expected)
        row, row_logp = tokens_BxT[slot], logp_BxT[slot]
        reason, n = None, emitted
        for k in range(emitted):
          lv.tokens.append(row[k])
          lv.logprobs.append(row_logp[k])
          reason = lv.finish_reason(eos_ids)
          if reason:
            n = k + 1
            break
        kept += n
        if tracking:
          live_len[lv.req.request_id] = len(lv.tokens)
        if drafter is not None:
          drafter.observe(lv.req.request_id, lv.req.group_id, np.asarray(row[:n], np.int32),
                          drafted, emitted - 1)
        if reason:
          finish(slot, lv, reason)
      stats.useful_slot_steps += useful
      stats.drafted += drafted_all
      stats.accepted += accepted
      stats.tokens += kept
      if st.ask_gain is not None:  # "auto" weighed asking for drafts for this step
        if st.asked:
          self.costs.observe_asked(st.ask_gain, accepted)
        else:
          self.costs.not_asked()
      for lv in landing:  # parked while this step ran: now it may resume, or it has ended
        if lv.done:
          pool.drop(lv.req.request_id)
        else:
          queue.append(lv.req)
          rules.changed()
      landing.clear()
      stats.read_time_s += time.perf_counter() - ready - waited

    while queue or any(slots) or pending is not None:
      admits = []
      if dividing and queue:  # divided rollout: rows give way to queued requests
        ty = time.perf_counter()
        marked = slots_to_yield(slots, queue, rules, cfg.divide_every, pool.free_rows())
        if marked:
          rules.changed()
        # Parked behind the step in flight (the device copies their KV after it); they rejoin
        # the queue once that step is read, with its tokens (`process`).
        park(pool, state.cache, slots, marked, queue,
             None if pending is None else landing)
        events[0] += len(marked)
        stats.yields += len(marked)
        stats.yield_passes += bool(marked)
        untimed = untimed or bool(marked)
        stats.yield_time_s += time.perf_counter() - ty
      resumed = {}
      for i in range(bucket):
        if slots[i] is None and queue:
          k = 0 if admission is None else admission.next_to_admit(queue, finished_len, live_len)
          if not 0 <= k < len(queue):
            raise ValueError(f"generate: admission.next_to_admit returned {k} for a queue of "
                             f"{len(queue)}")
          req = queue.pop(k)
          if rules is not None:
            rules.changed()
          admits.append((i, req))
          lv = pool.record(req.request_id) if pool is not None else None
          if lv is None:
            lv = LiveRequest(req)
            stats.admitted.append(req.request_id)
          else:
            resumed[req.request_id] = lv.tokens
            lv.since = len(lv.tokens)
          slots[i] = lv
          if tracking:
            live_len[req.request_id] = len(lv.tokens)
      state = self._admit(state, admits, resumed)
      events[1] += len(admits) - len(resumed)
      events[2] += len(resumed)
      untimed = untimed or bool(admits)
      live_idx = [i for i in range(bucket) if slots[i] is not None]
      if pending is None:
        while not queue and live_idx and self.bucket_for(len(live_idx)) < bucket:
          rows = live_idx + [i for i in range(len(slots)) if slots[i] is None]
          state, bucket = self._shrink(state, bucket, rows)
          slots = [slots[i] for i in rows[:bucket]]
          live_idx = list(range(len(live_idx)))
          untimed = True
      speculate, ask_gain = self._plan(bucket, slots, live_idx) if live_idx else (False, None)
      shrinks = not queue and self.bucket_for(len(live_idx)) < bucket
      if pending is not None and (speculate or shrinks or not cfg.pipeline or not live_idx):
        process(pending, blocking=True)  # drafts need the emitted tokens, moves a quiet state
        pending = None
        continue
      if not live_idx:
        break
      in_flight = 0 if pending is None else pending.shape[2]
      longest = max(len(slots[i].req.prompt) + len(slots[i].tokens) for i in live_idx)
      td = time.perf_counter()
      trees: list = [None] * bucket
      counts, depths, offered = [0] * bucket, [0] * bucket, [None] * bucket
      expected = [None] * bucket
      p, t = bucket, 1
      wide = []
      if speculate:
        shapes = self.config.spec_shapes(bucket)
        cap = max(t for _, t in shapes) - 1
        queries = []
        for i in live_idx:
          q, miss = slots[i].query(cap)
          stats.ahead_hits += q.ahead is not None
          stats.ahead_misses += miss
          if overlap:  # drafted ahead from this step's context while the device runs it
            wide.append(dataclasses.replace(q, budget=cfg.lookahead_budget, ahead=None))
          if ahead_only and q.ahead is None:
            q = dataclasses.replace(q, budget=0)
          queries.append(q)
        cleaned = cleaned_drafts(self.drafter.propose(queries), [q.budget for q in queries])
        values = [self.costs.node_values(slots[i].req.request_id, tree_depths(c[1]), c[2])
                  for i, c in zip(live_idx, cleaned)]
        s = self._kv_len_for(longest + in_flight + cap + 1)
        cands = [(bucket, p_, t_, s) for p_, t_ in shapes]
        if cfg.speculate == "always":
          shape, take, _ = self.costs.choose(None, cands[-1:], values, len(live_idx))
        else:
          shape, take, _ = self.costs.choose((bucket, bucket, 1, s), cands, values,
                                             len(live_idx))
        p, t = shape[1], shape[2]
        for k, i in enumerate(live_idx):
          n = take[k]
          if not n:
            if len(cleaned[k][0]) or not queries[k].budget:
              depths[i] = -1  # drafts unverified, or no room to draft: nothing learnt
            continue
          toks, pars, probs = cleaned[k]
          trees[i] = (toks[:n], pars[:n])
          node_depths = tree_depths(pars[:n])
          counts[i], depths[i] = n, int(node_depths.max())
          expected[i] = float(values[k][:n].sum())
          if probs is not None:  # the drafter's probability verified at each depth
            offered[i] = np.bincount(node_depths - 1, weights=probs[:n])
      draft_s = time.perf_counter() - td
      stats.draft_time_s += draft_s
      s = self._kv_len_for(longest + in_flight + t)
      live_B = tuple(slots[i] is not None for i in range(bucket))
      wire = (self._plain_roots(live_B) if t == 1 and not any(counts) else
              accept.pack(trees, live_B, p).wire())
      tv = time.perf_counter()
      state, out = self._verify_wire(state, wire, filters, s, t)
      out.copy_to_host_async()  # queued behind the step: its outputs are on the host when read
      now = time.perf_counter()
      stats.dispatch_time_s += now - tv
      host_s = now - host_from[0] - (stats.device_time_s - host_from[1])
      host_from = (now, stats.device_time_s)
      shape = (bucket, p, t, s)
      rows = [(i, slots[i], counts[i], depths[i], offered[i], expected[i]) for i in live_idx]
      st = _Step(out, rows, shape, asked=speculate, ask_gain=ask_gain,
                 timed=(t > 1 or not speculate) and not untimed,
                 events=(*events, host_s))
      events = [0, 0, 0]
      untimed = False
      if wide:
        st.ahead = self._pool.submit(_timed, self.drafter.lookahead, wide)
        st.ahead_rows = [slots[i] for i in live_idx]
      stats.steps += 1
      stats.spec_steps += t > 1
      stats.asked_steps += speculate
      stats.steps_by_shape[shape] += 1
      stats.slot_steps += bucket
      stats.positions += p
      stats.live_positions += len(live_idx) + sum(counts)
      stats.trace.append((bucket, p, len(live_idx), len(queue)))
      if pending is not None:  # read the previous step while this one runs
        process(pending, blocking=False)
      pending = st
    stats.total_time_s = time.perf_counter() - t0
    stats.cpu_time_s = time.thread_time() - cpu0
    stats.parked_peak = pool.peak if pool is not None else 0
    stats.yield_rules = rules.built if rules is not None else 0
    return [results[k] for k in order]

