"""The rollout engine: continuous batching over static-shape slots with lossless tree speculation.

Requests wait in a queue; B slots (B from a fixed set of buckets) each hold one live request
and its KV cache. A finished slot is refilled at once; when the queue is empty and the live
requests fit a smaller bucket they are moved into it where the cost model says the saving
pays for the move, so the tail of a rollout stops paying for empty slots on a device whose
steps cost by the row. Each step packs the live rows' roots and draft nodes on one token axis of a
compiled size (accept.pack; a plain step is the roots alone). The engine alone sizes drafts:
the cost model (cost_model.CostModel) picks, per step, the shape and the nodes per row with the
most expected tokens per second, and plain steps are dispatched before the previous step is
read, so the host's bookkeeping overlaps the device; with `multi_step` > 1 a stretch of plain
steps runs several per compiled call. Step functions are jitted once per shape (bucket, packed
size, tokens per row, cache bucket, plain steps per call) at warm-up.

Requests are admitted in arrival order, or in the order of an `AdmissionOrder` (scheduling/:
longest predicted first, cross-step alternation, Seer probe-first); the order changes when a
request runs, never what it samples. The engine is the narrow interface the trainer sees:
`generate(requests, admission=None) -> results` and `update_params(model)`. It owns what
outlives a rollout (compiled functions, params, the cost model, the drafter) and the decisions
made per step (admission's prefill, whether and what to draft); one rollout's loop and state
are loop.Rollout's. Admission prefills a GRPO group's prompt once: the group's other samples
get a copy of that KV row (bench/prefill_share.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging
from flax import nnx

from rhyme_jax.models.attention import KVCache, resolve_attention
from rhyme_jax.models.transformer import Transformer
from rhyme_jax.rollout import accept, compiled, kv_cache, loop, step, warmup
from rhyme_jax.rollout.compiled import TRACE_COUNTS  # noqa: F401  (re-exported for tests)
from rhyme_jax.rollout.cost_model import CostModel
from rhyme_jax.rollout.divided import ParkPool, YieldCost
from rhyme_jax.rollout.drafts import DraftSource, cleaned_drafts
from rhyme_jax.rollout.interface import (  # noqa: F401  (the interface, re-exported)
    DRAFT_MODES, DRAIN_STEPS, SPECULATE, AdmissionOrder, EngineConfig, EngineStats, Request,
    RequestResult)
from rhyme_jax.rollout.live import tree_depths


# The most prompt copies one call makes (`RolloutEngine._admit`); a larger pass takes several.
MAX_SHARED = 8


def _holders(slots: list, fresh: set[int]) -> dict:
  """{group id: (slot, request)} of the requests in `slots` whose rows hold their prompt's KV
  before this pass prefills (every occupant but the fresh ones, slots in `fresh`)."""
  out = {}
  for i, lv in enumerate(slots):
    if lv is not None and i not in fresh:
      out.setdefault(lv.req.group_id, (i, lv.req))
  return out

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
    # Seconds to move a state out of each bucket into the next smaller (warm-up)
    self.move_seconds: dict[int, float] = {}
    self.warmed: set[bool] = set()  # the `filters` values warm-up compiled steps for

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
    rollout never compiles; times each step shape to seed the cost model (`warmup.warm_up`).
    Steps compile for one `filters`: True serves rollouts with a top-p / top-k request
    (`SamplingParams.filters`), False the others; `generate` warns of a rollout that needs a
    value no warm-up compiled (call this once per value used, as the trainer does)."""
    self.stats = EngineStats()  # the warm-up's own prefills count toward no rollout
    warmup.warm_up(self, filters)
    self.warmed.add(bool(filters))

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
                   max_kv_len: int, max_q_len: int, steps: int = 1):
    """`verify` on a wire array; `steps` > 1: that many plain steps in one call (T = 1)."""
    return self._verify_fn(self._leaves, state, wire, self._seed, filters=filters,
                           max_kv_len=max_kv_len, max_q_len=max_q_len,
                           attention_impl=self.attention_impl, steps=steps)

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
             resumed: dict[int, list] | None = None, slots: list | None = None
             ) -> step.DecodeState:
    """Prefills all but the last prompt token of each (slot, request); the last becomes the
    slot's root. A request in `resumed` ({request id: its tokens so far}) yielded its slot
    earlier (divided rollout): its KV row comes back from the park pool instead, and its last
    token is the root. Slot parameters are set for all admitted requests in one call, which
    also makes the pass's row copies (`ParkPool.flush`: the rows of requests that yielded this
    pass, before prefill writes to their slots, and the resumed ones).

    A fresh request whose prompt another request of `slots` (the slots' `LiveRequest`s after
    this admission) holds, running, resumed or prefilled first in this pass, gets a copy of
    that row instead of its own prefill (`kv_cache.copy_rows_within`, a pass's copies in one
    call): GRPO samples G requests per prompt, and the prompt's KV is the same computation
    for each, so what is sampled does not change."""
    pool = self._parked
    if not admits and not (pool is not None and pool.due()):
      return state
    t0 = time.perf_counter()
    b = state.batch
    ints_5xB = np.zeros((5, b), np.int32)  # step.load_slots' rows: new, length, root, ...
    floats_2xB = np.ones((2, b), np.float32)  # temperature, top-p
    back, fresh = [], []  # (slot, request id) of resumed requests; (slot, prompt, request)
    for slot, req in admits:
      prompt = np.asarray(req.prompt, np.int32)
      done = resumed.get(req.request_id) if resumed else None
      if done is not None:  # the KV of the prompt and all but its last token is parked
        back.append((slot, req.request_id))
        cached, last = len(prompt) + len(done) - 1, done[-1]
      else:
        fresh.append((slot, prompt, req))
        cached, last = len(prompt) - 1, prompt[-1]
      p = req.params
      ints_5xB[:, slot] = 1, cached, last, req.request_id, p.top_k
      floats_2xB[:, slot] = p.temperature, p.top_p
    if pool is not None:
      pool.resume(back)
      state = pool.flush(state, ints_5xB, floats_2xB)
    else:
      state = compiled.load_slots_jit(state, ints_5xB, floats_2xB)
    c = self.config.prefill_chunk
    cache = state.cache
    holders = _holders(slots, {slot for slot, _, _ in fresh}) if fresh and slots else {}
    copies = []  # (slot, slot whose row holds the same prompt)
    for slot, prompt, req in fresh:
      held = holders.get(req.group_id)
      if held is not None and np.array_equal(np.asarray(held[1].prompt), prompt):
        copies.append((slot, held[0]))
        continue
      holders[req.group_id] = (slot, req)
      for start in range(0, len(prompt) - 1, c):
        # (slot, start, chunk) as one numpy array: jit moves it with the call in one transfer
        args = np.zeros(2 + c, np.int32)
        piece = prompt[start:min(start + c, len(prompt) - 1)]
        args[:2] = slot, start
        args[2:2 + len(piece)] = piece
        cache = self._prefill_fn(self._leaves, cache, args)
        self.stats.prefill_chunks += 1
    for at in range(0, len(copies), MAX_SHARED):
      part = kv_cache.padded_pairs(copies[at:at + MAX_SHARED])  # a compiled width
      cache = compiled.copy_within_jit(cache, part)
    self.stats.prefill_shared += len(copies)
    state = state.replace(cache=cache)
    self.stats.prefill_time_s += time.perf_counter() - t0  # dispatch time (runs async)
    return state

  def shared_sizes(self, bucket: int) -> list[int]:
    """Widths of the prompt copies' calls a bucket compiles: powers of two up to the first
    that holds min(bucket - 1, MAX_SHARED) (at least one slot holds the source)."""
    return kv_cache.pair_widths(min(bucket - 1, MAX_SHARED))

  # ---- the loop --------------------------------------------------------------------------------

  def _plan(self, bucket: int, slots: list, live_idx: list[int], context: int
            ) -> tuple[bool, float | None]:
    """Whether to draft this step, and the gain expected of asking (None unless "auto" weighed
    it; 0.0 when it does not ask): "always" does; "auto" asks the cost model whether any
    speculative shape could beat a plain step with chains at each request's acceptance, scaled
    by what asking delivered so far. `context`: as `_draft`'s, so each shape is weighed at the
    cache length its step would run in."""
    mode = self.config.speculate if self.drafter is not None else "never"
    shapes = self.config.spec_shapes(bucket)
    if mode == "never" or not shapes:
      return False, None
    if mode == "always":
      return True, None
    cap = max(t for _, t in shapes) - 1
    values = [self.costs.node_values(slots[i].req.request_id, np.arange(1, cap + 1), None)
              for i in live_idx]
    shape, take, _ = self.costs.choose(*self._shapes_at(bucket, shapes, context), values,
                                       len(live_idx), scale=self.costs.ask_scale)
    if shape[1] == bucket:
      return False, 0.0
    return True, float(sum(v[:n].sum() for v, n in zip(values, take)))

  def _shapes_at(self, bucket: int, shapes, context: int) -> tuple[tuple, list]:
    """(The plain step, the speculative (P, T) shapes) as cost-model shapes, each at the cache
    length its step would run in (the loop's `_kv_len_for(context + T)`): near a length
    boundary a plain step may still fit the shorter length that a tree step leaves."""
    return ((bucket, bucket, 1, self._kv_len_for(context + 1)),
            [(bucket, p, t, self._kv_len_for(context + t)) for p, t in shapes])

  def _draft(self, bucket: int, slots: list, live_idx: list[int], context: int,
             lookahead: bool, ahead_only: bool):
    """Asks the drafter for every live row and lets the cost model pick the step's shape and
    each row's nodes. `context`: the longest row's length, tokens in flight included;
    `lookahead`: also return the rows' queries to draft ahead from while the step runs;
    `ahead_only`: rows without a tree drafted ahead get none. Returns (trees per slot, per slot
    (drafted nodes, verified depth (-1: nothing to learn), drafter probabilities summed per
    depth, expected gain), packed size P, tokens per row T, the queries to draft ahead)."""
    cfg, stats = self.config, self.stats  # stats: the running rollout's (loop.Rollout sets it)
    shapes = cfg.spec_shapes(bucket)
    cap = max(t for _, t in shapes) - 1
    queries, wide = [], []
    for i in live_idx:
      q, miss = slots[i].query(cap)
      stats.ahead_hits += q.ahead is not None
      stats.ahead_misses += miss
      if lookahead:  # drafted ahead from this step's context while the device runs it
        wide.append(dataclasses.replace(q, budget=cfg.lookahead_budget, ahead=None))
      if ahead_only and q.ahead is None:
        q = dataclasses.replace(q, budget=0)
      queries.append(q)
    cleaned = cleaned_drafts(self.drafter.propose(queries), [q.budget for q in queries])
    values = [self.costs.node_values(slots[i].req.request_id, tree_depths(c[1]), c[2])
              for i, c in zip(live_idx, cleaned)]
    plain, cands = self._shapes_at(bucket, shapes, context)
    if cfg.speculate == "always":
      shape, take, _ = self.costs.choose(None, cands[-1:], values, len(live_idx))
    else:
      shape, take, _ = self.costs.choose(plain, cands, values, len(live_idx))
    trees: list = [None] * bucket
    per_slot = [(0, 0, None, None)] * bucket
    for k, i in enumerate(live_idx):
      n = take[k]
      if not n:
        if len(cleaned[k][0]) or not queries[k].budget:
          per_slot[i] = (0, -1, None, None)  # drafts unverified, or no room: nothing learnt
        continue
      toks, pars, probs = cleaned[k]
      trees[i] = (toks[:n], pars[:n])
      node_depths = tree_depths(pars[:n])
      # the drafter's probability verified at each depth
      offered = None if probs is None else np.bincount(node_depths - 1, weights=probs[:n])
      per_slot[i] = (n, int(node_depths.max()), offered, float(values[k][:n].sum()))
    return trees, per_slot, shape[1], shape[2], wide

  def generate(self, requests: Sequence[Request], admission: AdmissionOrder | None = None
               ) -> list[RequestResult]:
    """Runs every request to completion; results in the order of `requests`.

    `admission` picks which queued request takes each free slot (default: arrival order).
    A request that cannot run (empty or too-long prompt, bad sampling params) gets a result with
    finish_reason "error" and a message; the others run as usual. The loop and the rollout's
    state live in loop.Rollout; `stats` holds this call's counters.
    """
    rollout = loop.Rollout(self, requests, admission)
    need = rollout.filters
    if self.warmed and need not in self.warmed:
      absl_logging.warning(
          "generate: these requests %s top-p / top-k, but warm-up compiled steps only for "
          "requests that %s; each step shape compiles inside this rollout (call "
          "warmup(filters=%s) first)", "use" if need else "do not use",
          "do not" if need else "do", need)
    return rollout.run()
