"""The rollout engine: continuous batching over static-shape slots with lossless tree speculation.

Requests wait in a queue; B slots (B from a fixed set of buckets) each hold one live request
and its KV cache. A finished slot is refilled at once; when the queue is empty and the live
requests fit a smaller bucket they are moved into it, so the tail of a rollout stops paying
for empty slots. Each step verifies one draft tree per slot (budget T from a fixed set; T = 0
is plain decoding). Step functions are jitted once per (bucket, budget) and reused.

The engine is the narrow interface the trainer sees: `generate(requests) -> results` and
`update_params(model)`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_jax.models.attention import KVCache
from rhyme_jax.models.transformer import Transformer
from rhyme_jax.rollout import accept, step
from rhyme_jax.rollout.drafts import DraftQuery, DraftSource, DraftTree
from rhyme_jax.rollout.sampling import SamplingParams, needs_filtering


@dataclasses.dataclass
class Request:
  request_id: int
  prompt: Sequence[int]
  params: SamplingParams = SamplingParams()
  group_id: Hashable = None
  prompt_key: Hashable = None  # key into the history store; defaults to the prompt tokens


@dataclasses.dataclass
class RequestResult:
  request_id: int
  group_id: Hashable
  prompt: np.ndarray
  tokens: np.ndarray  # int32 response tokens (EOS / stop sequence included when hit)
  logprobs: np.ndarray  # float32, one per response token
  finish_reason: str  # "eos" | "stop" | "length" | "error"
  error: str | None = None
  steps: int = 0  # verify steps this request took part in
  drafted: int = 0  # draft tokens proposed for it
  accepted: int = 0  # draft tokens accepted
  finish_time: float = 0.0  # seconds since the start of the rollout


DRAFT_MODES = ("sync", "ahead", "ahead_only")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shapes and policies. `max_len` bounds prompt + response tokens per request."""

  max_len: int = 512
  buckets: tuple[int, ...] = (32, 16, 8, 4, 2, 1)
  budgets: tuple[int, ...] = (0, 8)  # draft budgets compiled (0 = plain decoding)
  # (max live requests, budget) thresholds, first match wins; budgets are capped to `budgets`.
  # The default follows TLT's observation: speculate more as the batch shrinks.
  budget_by_batch: tuple[tuple[int, int], ...] = ((1, 48), (4, 32), (20, 16), (32, 8))
  prefill_chunk: int = 64
  eos_ids: tuple[int, ...] = ()
  seed: int = 0
  # Where host drafting runs (drafters without `lookahead` always draft synchronously):
  # - "sync": before each step, on the critical path (the device waits);
  # - "ahead": the drafter's `lookahead` runs in a background thread on this step's contexts
  #   with a larger budget while the device verifies; next step each request gets the part of
  #   that tree continuing what it emitted (`DraftQuery.ahead`), and drafts synchronously only
  #   where the emitted tokens left the tree;
  # - "ahead_only": as "ahead", but never on the critical path: a request whose tokens left
  #   the tree gets no draft that step (its tree for the next step is drafted meanwhile).
  draft_mode: str = "sync"

  def __post_init__(self):
    if not self.buckets or any(b <= 0 for b in self.buckets):
      raise ValueError(f"buckets={self.buckets}: must be a non-empty list of positive sizes")
    if not self.budgets or any(t < 0 for t in self.budgets):
      raise ValueError(f"budgets={self.budgets}: must be a non-empty list of sizes >= 0")
    if self.max_len < 2:
      raise ValueError(f"max_len={self.max_len}: must be >= 2")
    if self.prefill_chunk <= 0:
      raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be > 0")
    if self.draft_mode not in DRAFT_MODES:
      raise ValueError(f"draft_mode={self.draft_mode!r}: expected one of {DRAFT_MODES}")

  @property
  def cache_len(self) -> int:
    return self.max_len + max(self.budgets) + 1


@dataclasses.dataclass
class EngineStats:
  """Counters of one `generate` call (peers' names: mean accepted length, slot utilisation)."""

  steps: int = 0  # verify steps (target forward passes of the decode phase)
  prefill_chunks: int = 0
  prefill_time_s: float = 0.0  # admitting requests: prompt prefill and slot loading
  tokens: int = 0  # response tokens emitted
  useful_slot_steps: int = 0
  slot_steps: int = 0
  drafted: int = 0
  accepted: int = 0
  draft_time_s: float = 0.0  # host drafting on the critical path (device idle meanwhile)
  device_time_s: float = 0.0  # dispatch to outputs on the host (background drafting overlaps it)
  lookahead_time_s: float = 0.0  # background drafting, overlapped with device_time_s
  lookahead_wait_s: float = 0.0  # waiting for background drafting after the device finished
  ahead_hits: int = 0  # queries given the continuation of a tree drafted ahead
  ahead_misses: int = 0  # queries whose emitted tokens left their tree drafted ahead (or ended it)
  total_time_s: float = 0.0
  steps_by_shape: dict = dataclasses.field(default_factory=collections.Counter)
  trace: list = dataclasses.field(default_factory=list)  # per step: (bucket, budget, live, queued)

  @property
  def mean_accepted_length(self) -> float:
    """Tokens emitted per slot-verify (bonus included): 1.0 means no speculation gain."""
    return self.tokens / max(self.useful_slot_steps, 1)

  @property
  def forwards_per_token(self) -> float:
    return self.steps / max(self.tokens, 1)

  @property
  def slot_utilisation(self) -> float:
    return self.useful_slot_steps / max(self.slot_steps, 1)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.total_time_s, 1e-9)

  def summary(self) -> dict:
    return dict(steps=self.steps, tokens=self.tokens, tokens_per_s=self.tokens_per_s,
                mean_accepted_length=self.mean_accepted_length,
                forwards_per_token=self.forwards_per_token,
                slot_utilisation=self.slot_utilisation, drafted=self.drafted,
                accepted=self.accepted, draft_time_s=self.draft_time_s,
                device_time_s=self.device_time_s, lookahead_time_s=self.lookahead_time_s,
                lookahead_wait_s=self.lookahead_wait_s, ahead_hits=self.ahead_hits,
                ahead_misses=self.ahead_misses, total_time_s=self.total_time_s)


@dataclasses.dataclass
class _Live:
  req: Request
  tokens: list
  logprobs: list
  steps: int = 0
  drafted: int = 0
  accepted: int = 0
  ahead: DraftTree | None = None  # drafted ahead from the context before the last step
  ahead_from: int = -1  # response length that tree continues


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = fn(*args)
  return out, time.perf_counter() - t0


# Compiled once per process, model structure and shape (`_model_fns` below), so engines over
# the same model share compilations. TRACE_COUNTS counts traces (= compilations) per function,
# for tests and logs.
TRACE_COUNTS: collections.Counter = collections.Counter()


def _counted(kind, fn):
  @functools.wraps(fn)
  def wrapped(*args, **kw):
    TRACE_COUNTS[kind] += 1  # runs once per trace
    return fn(*args, **kw)
  return wrapped


@functools.lru_cache(maxsize=16)
def _model_fns(graphdef, treedef):
  """Verify and prefill jitted for one model structure, taking the params as a flat list.

  Looked up once per engine (hashing an NNX graphdef costs milliseconds, flattening a params
  State with its key sorting almost one), so a step's dispatch hashes and flattens neither.
  Engines over the same structure share these functions and their compilations.
  """
  def verify(leaves, state, trees, seed, *, filters):
    return step.verify_step(graphdef, jax.tree.unflatten(treedef, leaves), state, trees, seed,
                            filters=filters)

  def prefill(leaves, cache, slot, chunk, start):
    return step.prefill_chunk(graphdef, jax.tree.unflatten(treedef, leaves), cache, slot,
                              chunk, start)

  return (jax.jit(_counted("step", verify), static_argnames=("filters",), donate_argnums=(1,)),
          jax.jit(_counted("prefill", prefill), donate_argnums=(1,)))


_load_jit = jax.jit(_counted("load", step.load_slots), donate_argnums=(0,))
_regroup_jit = jax.jit(_counted("regroup", step.regroup))


class RolloutEngine:
  """Generates responses for many requests; see the module docstring."""

  def __init__(self, model: Transformer, config: EngineConfig, drafter: DraftSource | None = None):
    self.config = config
    self.model_config = model.cfg
    self.graphdef, self.params = nnx.split(model)
    self._leaves, treedef = jax.tree.flatten(self.params)
    self._verify_fn, self._prefill_fn = _model_fns(self.graphdef, treedef)
    self._seed = jnp.uint32(config.seed)
    self.drafter = drafter
    self.stats = EngineStats()
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # for drafting ahead

  def _new_state(self, bucket: int) -> step.DecodeState:
    """A fresh state; on the params' mesh (replicated) when they have one, so the first step
    sees the placement every later step does (otherwise it would compile a second variant)."""
    state = step.DecodeState.empty(KVCache.zeros(self.model_config, bucket,
                                                 self.config.cache_len))
    sharding = self._leaves[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      state = jax.device_put(state, jax.sharding.NamedSharding(sharding.mesh,
                                                               jax.sharding.PartitionSpec()))
    return state

  def _shrink(self, state: step.DecodeState, bucket: int, order: list[int]):
    """Moves rows `order` into the next smaller bucket (one level at a time, so only
    len(buckets) - 1 regroup shapes ever compile)."""
    smaller = max(b for b in self.config.buckets if b < bucket)
    return _regroup_jit(state, jnp.asarray(order[:smaller], jnp.int32)), smaller

  def warmup(self, filters: bool = False) -> None:
    """Compiles every (bucket, budget) step, the prefill, slot loading and bucket moves up front,
    so a rollout never compiles."""
    buckets = sorted(self.config.buckets, reverse=True)
    dummy = [(0, Request(-1, [0, 0], SamplingParams()))]
    for bucket in buckets:
      # Every call as a rollout makes it: on a fresh state and on states that steps returned
      # (their placement may differ from a fresh one's on a multi-device mesh).
      state = self._admit(self._new_state(bucket), dummy)
      for _ in range(2):
        for budget in self.config.budgets:
          trees = accept.pack_trees([DraftTree.empty(budget)] * bucket, budget)
          state, _ = self.verify(state, trees, filters)
        state = self._admit(state, dummy)
      if bucket != buckets[-1]:
        self._shrink(state, bucket, list(range(bucket)))

  def update_params(self, model_or_params) -> None:
    """Swaps in new weights (same structure); compiled functions are kept."""
    if isinstance(model_or_params, nnx.Module):
      _, self.params = nnx.split(model_or_params)
    else:
      self.params = model_or_params
    self._leaves = jax.tree.leaves(self.params)

  def verify(self, state: step.DecodeState, trees: accept.TreeBatch, filters: bool = False):
    """One jitted verify step (`step.verify_step`) with this engine's params."""
    return self._verify_fn(self._leaves, state, trees, self._seed, filters=filters)

  # ---- policies --------------------------------------------------------------------------------

  def bucket_for(self, n: int) -> int:
    """The smallest bucket holding n requests (the largest bucket if none does)."""
    fits = [b for b in self.config.buckets if b >= n]
    return min(fits) if fits else max(self.config.buckets)

  def budget_for(self, live: int) -> int:
    """Draft budget for a step with `live` requests: from the thresholds, capped to a compiled
    budget; 0 without a drafter or above every threshold."""
    if self.drafter is None:
      return 0
    want = 0
    for max_live, budget in self.config.budget_by_batch:
      if live <= max_live:
        want = budget
        break
    fits = [t for t in self.config.budgets if t <= want]
    return max(fits) if fits else min(self.config.budgets)

  def _fit_budget(self, budget: int, trees: list[DraftTree]) -> tuple[int, list[DraftTree]]:
    """The smallest compiled budget holding every proposed tree (0 when all are empty): a
    step verifies only as many tree slots as its drafts use, so small drafts cost little."""
    need = max(t.size for t in trees)
    fit = min((t for t in self.config.budgets if t >= need), default=budget)
    if fit >= budget:
      return budget, trees
    return fit, [t.padded(fit) for t in trees]

  # ---- request handling ------------------------------------------------------------------------

  def _validate(self, req: Request, seen: set) -> str | None:
    """A reason this request cannot run, or None."""
    try:
      req.params.validate()
    except ValueError as e:
      return f"request {req.request_id}: invalid sampling params: {e}"
    n = len(req.prompt)
    if req.request_id in seen:
      return f"request {req.request_id}: duplicate request_id"
    if n == 0:
      return f"request {req.request_id}: empty prompt"
    vocab = self.model_config.vocab_size
    bad = [t for t in req.prompt if not 0 <= int(t) < vocab]
    if bad:
      return f"request {req.request_id}: prompt token {bad[0]} outside the vocabulary [0, {vocab})"
    if n + req.params.max_new_tokens > self.config.max_len:
      return (f"request {req.request_id}: prompt of {n} tokens + max_new_tokens="
              f"{req.params.max_new_tokens} exceeds the engine's max_len={self.config.max_len}")
    return None

  def _admit(self, state: step.DecodeState, admits: list[tuple[int, Request]]
             ) -> step.DecodeState:
    """Prefills all but the last prompt token of each (slot, request); the last becomes the
    slot's root. Slot parameters are set for all admitted requests in one call."""
    if not admits:
      return state
    t0 = time.perf_counter()
    c = self.config.prefill_chunk
    cache = state.cache
    b = state.batch
    new = np.zeros(b, bool)
    length, root, request, top_k = (np.zeros(b, np.int32) for _ in range(4))
    temperature, top_p = np.ones(b, np.float32), np.ones(b, np.float32)
    for slot, req in admits:
      prompt = np.asarray(req.prompt, np.int32)
      body = prompt[:-1]
      for start in range(0, len(body), c):
        chunk = np.zeros(c, np.int32)
        piece = body[start:start + c]
        chunk[:len(piece)] = piece
        cache = self._prefill_fn(self._leaves, cache, jnp.int32(slot),
                             jnp.asarray(chunk), jnp.int32(start))
        self.stats.prefill_chunks += 1
      p = req.params
      new[slot] = True
      length[slot], root[slot], request[slot] = len(body), prompt[-1], req.request_id
      temperature[slot], top_p[slot], top_k[slot] = p.temperature, p.top_p, p.top_k
    state = _load_jit(state.replace(cache=cache), new, length, root, request, temperature,
                      top_p, top_k)
    self.stats.prefill_time_s += time.perf_counter() - t0  # dispatch time (runs async)
    return state

  def _query(self, lv: _Live, budget: int) -> DraftQuery:
    """What the drafter sees of a live request, with the continuation of its tree drafted
    ahead (if any) past the tokens emitted since."""
    ahead = None
    if lv.ahead is not None:
      ahead = lv.ahead.after(lv.tokens[lv.ahead_from:])
      self.stats.ahead_misses += ahead is None
      lv.ahead = None
    room = lv.req.params.max_new_tokens - len(lv.tokens) - 1
    key = lv.req.prompt_key if lv.req.prompt_key is not None else tuple(lv.req.prompt)
    return DraftQuery(lv.req.request_id, lv.req.group_id, key,
                      np.asarray(lv.req.prompt, np.int32), np.asarray(lv.tokens, np.int32),
                      max(min(budget, room), 0), ahead)

  def _finish_reason(self, live: _Live) -> str | None:
    p = live.req.params
    toks = live.tokens
    if toks and toks[-1] in self.config.eos_ids:
      return "eos"
    for s in p.stop_sequences:
      if len(toks) >= len(s) and tuple(toks[-len(s):]) == tuple(s):
        return "stop"
    if len(toks) >= p.max_new_tokens:
      return "length"
    return None

  # ---- the loop --------------------------------------------------------------------------------

  def generate(self, requests: Sequence[Request]) -> list[RequestResult]:
    """Runs every request to completion; results in the order of `requests`.

    A request that cannot run (empty or too-long prompt, bad sampling params) gets a result with
    finish_reason "error" and a message; the others run as usual.
    """
    t0 = time.perf_counter()
    self.stats = stats = EngineStats()
    results: dict[int, RequestResult] = {}
    queue: collections.deque[Request] = collections.deque()
    seen: set = set()
    for req in requests:
      err = self._validate(req, seen)
      seen.add(req.request_id)
      if err:
        results[id(req)] = RequestResult(req.request_id, req.group_id,
                                         np.asarray(req.prompt, np.int32), np.zeros(0, np.int32),
                                         np.zeros(0, np.float32), "error", error=err)
      else:
        queue.append(req)
    order = [id(r) for r in requests]
    group_left = collections.Counter(r.group_id for r in queue)  # live + queued per group
    filters = needs_filtering([r.params for r in queue])
    bucket = self.bucket_for(len(queue))
    state = self._new_state(bucket)
    slots: list[_Live | None] = [None] * bucket
    overlap = self.config.draft_mode != "sync" and hasattr(self.drafter, "lookahead")
    ahead_only = overlap and self.config.draft_mode == "ahead_only"
    if overlap and self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookahead")
    pool = self._pool

    while queue or any(slots):
      admits = []
      for i in range(bucket):
        if slots[i] is None and queue:
          admits.append((i, queue.popleft()))
          slots[i] = _Live(admits[-1][1], [], [])
      state = self._admit(state, admits)
      live_idx = [i for i in range(bucket) if slots[i] is not None]
      while not queue and self.bucket_for(len(live_idx)) < bucket:
        rows = live_idx + [i for i in range(len(slots)) if slots[i] is None]
        state, bucket = self._shrink(state, bucket, rows)
        slots = [slots[i] for i in rows[:bucket]]
        live_idx = list(range(len(live_idx)))

      budget = self.budget_for(len(live_idx))
      td = time.perf_counter()
      trees = [DraftTree.empty(budget)] * bucket
      queries, wide = [], []
      if budget > 0:
        for i in live_idx:
          q = self._query(slots[i], budget)
          stats.ahead_hits += q.ahead is not None
          if overlap:  # what to draft ahead from this step's context (the emitted tokens
            # are unknown yet: a tree spanning this step's draft, its bonus and the next draft)
            wide.append(dataclasses.replace(q, budget=2 * q.budget + 1, ahead=None))
          if ahead_only and q.ahead is None:  # nothing drafted ahead fits: no draft this step
            q = dataclasses.replace(q, budget=0)
          queries.append(q)
        for i, tree in zip(live_idx, self.drafter.propose(queries)):
          trees[i] = tree
        budget, trees = self._fit_budget(budget, trees)
      tree_batch = accept.pack_trees(trees, budget)
      stats.draft_time_s += time.perf_counter() - td

      tdev = time.perf_counter()
      state, out = self.verify(state, tree_batch, filters)
      ahead = None
      if wide:  # drafts for the next step while the device runs this one
        ahead = pool.submit(_timed, self.drafter.lookahead, wide)
      tokens_BxN, logp_BxN, num_B = jax.device_get(
          (out.tokens_BxN, out.logprobs_BxN, out.num_emitted_B))
      stats.device_time_s += time.perf_counter() - tdev
      if ahead is not None:
        tw = time.perf_counter()
        wide_trees, seconds = ahead.result()
        stats.lookahead_wait_s += time.perf_counter() - tw
        stats.lookahead_time_s += seconds
        for i, tree in zip(live_idx, wide_trees):
          slots[i].ahead, slots[i].ahead_from = tree, len(slots[i].tokens)
      stats.steps += 1
      stats.steps_by_shape[(bucket, budget)] += 1
      stats.slot_steps += bucket
      stats.useful_slot_steps += len(live_idx)
      stats.trace.append((bucket, budget, len(live_idx), len(queue)))

      for i in live_idx:
        lv = slots[i]
        drafted = int(tree_batch.valid_BxT[i].sum()) if budget else 0
        emitted = int(num_B[i])
        lv.steps += 1
        lv.drafted += drafted
        lv.accepted += emitted - 1
        stats.drafted += drafted
        stats.accepted += emitted - 1
        reason, new = None, []
        for k in range(emitted):
          lv.tokens.append(int(tokens_BxN[i, k]))
          lv.logprobs.append(float(logp_BxN[i, k]))
          new.append(lv.tokens[-1])
          reason = self._finish_reason(lv)
          if reason:
            break
        stats.tokens += len(new)
        if self.drafter is not None:
          self.drafter.observe(lv.req.request_id, lv.req.group_id, np.asarray(new, np.int32),
                               drafted, emitted - 1)
        if reason:
          results[id(lv.req)] = RequestResult(
              lv.req.request_id, lv.req.group_id, np.asarray(lv.req.prompt, np.int32),
              np.asarray(lv.tokens, np.int32), np.asarray(lv.logprobs, np.float32), reason,
              steps=lv.steps, drafted=lv.drafted, accepted=lv.accepted,
              finish_time=time.perf_counter() - t0)
          if self.drafter is not None:
            self.drafter.finish(lv.req.request_id, lv.req.group_id)
            group_left[lv.req.group_id] -= 1
            if group_left[lv.req.group_id] == 0 and hasattr(self.drafter, "end_group"):
              self.drafter.end_group(lv.req.group_id)
          slots[i] = None
    stats.total_time_s = time.perf_counter() - t0
    return [results[k] for k in order]
