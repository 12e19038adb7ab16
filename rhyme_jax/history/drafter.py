"""`HistoryDrafter`: HistoSpec (past epochs) + grouped (live siblings) drafts behind `DraftSource`.

What it drafts (the rule is `history.match_tree`, compiled in `history.fast_draft`): the
longest suffix of the request's response (START-prefixed, at most `max_match` tokens) found in
the prompt's kept past responses and in its group's live responses, falling back to shorter
suffixes down to one token while the longer ones do not branch; the continuations of every
match, weighted by epoch recency (`recency ** age`) and mixed over fallback levels, form a
weighted count trie; the drafted tree is its `budget` most probable nodes, best first, with
their path probabilities in `DraftTree.probs`. Siblings already ahead of the requester supply
continuations; its own response counts too (repeats within one response are drafts).

Sizes: the engine decides them. `DraftQuery.budget` (capped by `max_budget`) is the most nodes
returned; the tree is unpadded and best-first, so any prefix of it is a tree the engine may
truncate to by its own cost model (`probs` tell it what each node is worth). Nothing here
adapts the size to past acceptance (a halving budget collapses to 1-2 nodes under sampling).

Speed: every indexed sequence lives in one persistent `arena.Arena`; emitted tokens are
appended in place by `observe`; `propose` drafts all queries of a step in one compiled call.

Engine protocol: `propose(queries)` before each step; `observe(request_id, group_id,
new_tokens, drafted, accepted)` after it; `finish` when a request ends; `end_group` when no
further request of the group will run; optional `lookahead(queries)` (a deeper tree drafted
while the device verifies; next step `DraftQuery.ahead` carries its continuation and `propose`
takes it). Trainer: `record_group` per finished group (with its data epoch),
`epoch_summary()` for per-epoch acceptance metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Hashable, Sequence

import numpy as np

from rhyme_jax.history import arena as arena_lib, fast_draft, match_tree
from rhyme_jax.history.store import HistoryStore, store_key
from rhyme_jax.rollout.drafts import DraftBatch, DraftQuery, DraftTree

START = arena_lib.START  # sentinel opening every indexed response (never drafted)
HISTORY, SIBLING = 0, 1  # segment kinds
_NO_SEGS = np.zeros(0, np.int64)
PARALLEL_MIN = 16  # queries per batch from which drafting is split across threads


@dataclasses.dataclass
class _Request:
  group_id: Hashable
  seg: int  # its own segment in the arena (START + response so far)
  length: int  # response tokens in it (a Python int: cheaper than reading the arena's)
  key: Hashable = None  # its prompt's history-store key
  history: tuple = (None, 0, 0)  # (stamp, postings lo, hi) of its last look-up


@dataclasses.dataclass
class _Group:
  segs: list = dataclasses.field(default_factory=list)
  live: set = dataclasses.field(default_factory=set)
  array: np.ndarray | None = None  # segs as an array, rebuilt when a sibling joins


class HistoryDrafter:
  """DraftSource drafting token trees from a prompt's past responses and its live siblings."""

  def __init__(self, store: HistoryStore | None = None, *, use_history: bool = True,
               use_siblings: bool = True, max_budget: int = 64, max_match: int = 8,
               min_prob: float = 0.02, fallback_decay: float = 0.5, max_levels: int = 4,
               recency: float = 0.5, history_weight: float = 1.0, sibling_weight: float = 1.0,
               response_capacity: int = 320, index_cache: int = 512,
               idle_groups_kept: int = 256, compiled: bool = True, parallel: bool = False):
    if max_budget < 1 or max_match < 1 or max_levels < 1:
      raise ValueError(f"HistoryDrafter: max_budget ({max_budget}), max_match ({max_match}) and "
                       f"max_levels ({max_levels}) must be >= 1")
    if not 0.0 < min_prob <= 1.0:
      raise ValueError(f"HistoryDrafter: min_prob must be in (0, 1], got {min_prob}")
    if not 0.0 < recency <= 1.0 or not 0.0 < fallback_decay <= 1.0:
      raise ValueError(f"HistoryDrafter: recency ({recency}) and fallback_decay "
                       f"({fallback_decay}) must be in (0, 1]")
    if use_history and store is None:
      raise ValueError("HistoryDrafter: use_history=True needs a HistoryStore")
    self.store = store
    self.use_history, self.use_siblings = use_history, use_siblings
    self.max_budget, self.max_match, self.max_levels = max_budget, max_match, max_levels
    self.min_prob, self.fallback_decay, self.recency = min_prob, fallback_decay, recency
    self.history_weight, self.sibling_weight = history_weight, sibling_weight
    self.response_capacity = response_capacity
    self.compiled = compiled  # False: the readable reference (match_tree), query by query
    # parallel=True: batches of at least PARALLEL_MIN queries are split across numba's threads
    # (same trees as the serial kernel). Off by default: it pays only on idle cores. Replaying
    # 64 live rows on 2 cores it took 6.1 us/query against 8.4 serial when idle, but 390-1300
    # us/query with two other jobs on the machine (a chunk's thread waits for a core), against
    # 15-50 serial (bench/RESULTS.md).
    self.parallel = parallel
    self._threads = fast_draft.num_threads()
    if compiled:
      fast_draft.warmup(parallel)  # compiled (or loaded) now, not in the first rollout step
    self.index_cache, self.idle_groups_kept = index_cache, idle_groups_kept
    self.arena = arena_lib.Arena()
    self.postings = arena_lib.Postings()  # of the past responses (static): no scan
    self._scratch: fast_draft.Scratch | None = None  # the kernel's work space, kept
    # prompt key -> (store version, its segments, their postings id)
    self._history: collections.OrderedDict[Hashable, tuple[int, np.ndarray, int]] = (
        collections.OrderedDict())
    # Bumped whenever a history index is built or freed (postings ranges may move): with the
    # store's generation, the stamp a request's cached range is valid for.
    self._index_gen = 0
    self._requests: dict[int, _Request] = {}
    self._groups: dict[Hashable, _Group] = {}
    self._idle_groups: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    self.stats: dict[str, float] = collections.defaultdict(float)
    self._epoch_stats: dict[str, float] = collections.defaultdict(float)

  # --- trainer side -------------------------------------------------------------------------

  def record_group(self, prompt_key: Hashable, responses: Sequence[Sequence[int]],
                   rewards: Sequence[float] | None = None, epoch: int = 0) -> None:
    """Adds a finished group to the history store (drafts of later visits use it)."""
    if self.store is None:
      raise ValueError("HistoryDrafter.record_group: this drafter has no HistoryStore")
    self.store.add_group(store_key(prompt_key), epoch,
                         responses, rewards)

  def epoch_summary(self) -> dict[str, float]:
    """Acceptance since the last call (per data epoch, for the trainer's log), then resets:
    accepted_length = tokens emitted per verify step of a request (bonus included),
    hit_rate = accepted / drafted nodes, drafted_per_step, no_draft_frac (steps that had no
    draft), draft_us_per_query (host drafting time)."""
    s, self._epoch_stats = self._epoch_stats, collections.defaultdict(float)
    steps = max(s["steps"], 1)
    return {"accepted_length": s["emitted"] / steps,
            "hit_rate": s["accepted"] / max(s["drafted"], 1),
            "drafted_per_step": s["drafted"] / steps,
            "no_draft_frac": s["no_draft_steps"] / steps,
            "draft_us_per_query": 1e6 * s["propose_seconds"] / max(s["queries"], 1)}

  # --- indexes ------------------------------------------------------------------------------

  def _history_range(self, key: Hashable) -> tuple[int, int]:
    """The postings range of a prompt's kept past responses (built once per store version)."""
    version = self.store.version(key)
    cached = self._history.get(key)
    if cached is not None and cached[0] == version:
      self._history.move_to_end(key)
      return self.postings.range(cached[2])
    if cached is not None:
      self._free_history(key)
    if version is None:
      return (0, 0)
    t0 = time.perf_counter()
    groups = self.store.get(key) or []
    latest = max((g.epoch for g in groups), default=0)
    segs = np.array([self.arena.add(r, HISTORY, self.recency ** (latest - g.epoch))
                     for g in groups for r in g.responses], np.int64)
    pid = self.postings.add(self.arena, segs)
    self._index_gen += 1
    self._history[key] = (version, segs, pid)
    self.stats["history_index_builds"] += 1
    self.stats["history_index_seconds"] += time.perf_counter() - t0
    return self.postings.range(pid)

  def _trim_history(self) -> None:
    """Frees the least recently used indexes beyond `index_cache`: after a batch is drafted,
    so no index a query of the batch looked up goes while it is in use."""
    while len(self._history) > self.index_cache:
      self._free_history(next(iter(self._history)))

  def _free_history(self, key: Hashable) -> None:
    _, segs, pid = self._history.pop(key)
    self._index_gen += 1
    self.postings.free(pid)
    for s in segs.tolist():
      self.arena.free(s)

  def _group(self, group_id: Hashable) -> _Group:
    group = self._groups.get(group_id)
    if group is None:
      group = self._groups[group_id] = _Group()
    self._idle_groups.pop(group_id, None)
    return group

  def _request(self, request_id: int, group_id: Hashable, response: np.ndarray) -> _Request:
    """The request's state, its own segment synchronised with `response`."""
    req = self._requests.get(request_id)
    if req is None:
      seg = self.arena.add(np.asarray(response, np.int32), SIBLING, 1.0, self.response_capacity)
      req = self._requests[request_id] = _Request(group_id, seg, len(response))
      group = self._group(group_id)
      group.segs.append(seg)
      group.live.add(request_id)
      group.array = None
      return req
    if req.length < len(response):  # tokens `observe` did not report
      self.arena.extend(req.seg, np.asarray(response[req.length:], np.int32))
      req.length = len(response)
    return req

  # --- drafting -----------------------------------------------------------------------------

  def _draft_batch(self, queries: Sequence[DraftQuery], cap: int) -> Sequence[DraftTree]:
    """Every query's tree in one compiled call (the per-query Python here is the host cost the
    engine pays per request and step, so it is kept to look-ups and one tuple)."""
    reqs, groups = self._requests, self._groups
    history = self.use_history
    stamp = (self.store.generation, self._index_gen) if history else None
    gen0 = self._index_gen
    siblings = self.use_siblings
    rows, batch = [], []  # per query: its fast_draft.Q_* columns (flat); its request state
    seg_parts, seg_at, n_segs = [], {}, 0  # each group's segments once per batch
    width = 1
    for q in queries:
      budget = q.budget
      budget = 0 if budget < 0 else (budget if budget < cap else cap)
      if budget > width:
        width = budget
      req = reqs.get(q.request_id)
      if req is None or req.length < len(q.response):
        if req is None:  # a sibling joins: its group's segment list changes
          seg_at.pop(q.group_id, None)
        req = self._request(q.request_id, q.group_id, q.response)
      batch.append(req)
      plo = phi = 0
      if history:
        key = req.key
        if key is None:
          key = req.key = store_key(q.prompt_key)
        h = req.history
        if h[0] != stamp:  # the store or the indexes changed since its last look-up
          lo, hi = self._history_range(key)
          stamp = (self.store.generation, self._index_gen)  # (a build bumps it)
          h = req.history = (stamp, lo, hi)
        plo, phi = h[1], h[2]
      slo = shi = 0
      if siblings:
        at = seg_at.get(req.group_id)
        if at is None:
          group = groups[req.group_id]
          if group.array is None:
            group.array = np.array(group.segs, np.int64)
          at = seg_at[req.group_id] = (n_segs, n_segs + len(group.array))
          seg_parts.append(group.array)
          n_segs = at[1]
        slo, shi = at
      rows += (req.seg, slo, shi, budget, plo, phi)
    if history and self._index_gen != gen0:  # an index built or freed may have moved ranges
      for r, req in enumerate(batch):
        cached = self._history.get(req.key)
        lo, hi = self.postings.range(cached[2]) if cached is not None else (0, 0)
        req.history = (stamp, lo, hi)
        rows[6 * r + 4:6 * r + 6] = lo, hi
    n = len(batch)
    info = np.array(rows, np.int64).reshape(n, 6)
    q_segs = np.concatenate(seg_parts) if seg_parts else _NO_SEGS
    if not self.compiled:
      out = self._draft_reference(queries, info, q_segs)
      self._trim_history()
      return out
    out_tok = np.empty((n, width), np.int32)
    out_par = np.empty((n, width), np.int32)
    out_prob = np.empty((n, width), np.float32)
    out_n = np.empty(n, np.int64)
    threads = self._threads if self.parallel and n >= PARALLEL_MIN else 1
    self._scratch = fast_draft.draft(
        self.arena, self.postings, info, q_segs, out_tok, out_par, out_prob, out_n,
        max_match=self.max_match, min_prob=self.min_prob, decay=self.fallback_decay,
        max_levels=self.max_levels, kind_weights=(self.history_weight, self.sibling_weight),
        scratch=self._scratch, threads=threads)
    self._trim_history()
    sizes = out_n.tolist()
    self._drafted_nodes = sum(sizes)
    return DraftBatch(out_tok, out_par, out_prob, sizes)

  def _draft_reference(self, queries, info, q_segs) -> list[DraftTree]:
    """The same trees from `match_tree.draft_reference` (slow; for tests and comparisons)."""
    a, out, nodes = self.arena, [], 0
    for q, (seg, slo, shi, budget, _, _) in zip(queries, info.tolist()):
      req = self._requests[q.request_id]
      segs = []
      if self.use_history and req.key in self._history:
        segs += self._history[req.key][1].tolist()
      if self.use_siblings:
        segs += q_segs[slo:shi].tolist()
      view = [(a.segment(s), int(a.seg_kind[s]), float(a.seg_weight[s])) for s in segs]
      tokens, parents, probs = match_tree.draft_reference(
          view, a.segment(seg)[-self.max_match:], budget, min_prob=self.min_prob,
          decay=self.fallback_decay, max_levels=self.max_levels,
          kind_weights=(self.history_weight, self.sibling_weight))
      out.append(DraftTree(tokens, parents, np.ones(len(tokens), bool), probs))
      nodes += len(tokens)
    self._drafted_nodes = nodes
    return out

  def propose(self, queries: Sequence[DraftQuery]) -> Sequence[DraftTree]:
    t0 = time.perf_counter()
    if all(q.ahead is None for q in queries):
      out = self._draft_batch(queries, self.max_budget)
    else:
      out = self._propose_with_ahead(queries)
    self.stats["draft_tokens"] += self._drafted_nodes
    dt = time.perf_counter() - t0
    self.stats["propose_calls"] += 1
    self.stats["propose_queries"] += len(queries)
    self.stats["propose_seconds"] += dt
    self._epoch_stats["queries"] += len(queries)
    self._epoch_stats["propose_seconds"] += dt
    return out

  def _propose_with_ahead(self, queries: Sequence[DraftQuery]) -> list[DraftTree]:
    """Trees drafted ahead (best-first: their first `budget` nodes) where given, the rest
    drafted now; `_drafted_nodes` counts both."""
    todo = [i for i, q in enumerate(queries) if q.ahead is None]
    out: list[DraftTree | None] = [None] * len(queries)
    ahead = 0
    for i, q in enumerate(queries):
      if q.ahead is not None:
        self._request(q.request_id, q.group_id, q.response)
        budget = max(min(q.budget, self.max_budget), 0)
        out[i] = q.ahead.padded(min(budget, len(q.ahead.tokens)))
        self.stats["ahead_used"] += 1
        self.stats["ahead_tokens"] += out[i].size
        ahead += out[i].size
    self._drafted_nodes = 0
    if todo:
      for i, tree in zip(todo, self._draft_batch([queries[i] for i in todo], self.max_budget)):
        out[i] = tree
    self._drafted_nodes += ahead
    return out

  def lookahead(self, queries: Sequence[DraftQuery]) -> Sequence[DraftTree]:
    """Deeper trees for drafting ahead (up to q.budget nodes); changes nothing `propose` /
    `observe` read (the requests' segments are synchronised with their responses, a no-op
    when `observe` reported every token)."""
    t0 = time.perf_counter()
    out = self._draft_batch(queries, 1 << 30)
    self.stats["lookahead_queries"] += len(queries)
    self.stats["lookahead_seconds"] += time.perf_counter() - t0
    return out

  def observe(self, request_id: int, group_id: Hashable, new_tokens: np.ndarray,
              drafted: int, accepted: int) -> None:
    req = self._requests.get(request_id)
    new = np.asarray(new_tokens, np.int32).reshape(-1)
    if req is not None and len(new):
      self.arena.extend(req.seg, new)
      req.length += len(new)
    self.stats["observe_calls"] += 1
    self.stats["drafted_tokens"] += int(drafted)
    self.stats["accepted_tokens"] += int(accepted)
    e = self._epoch_stats
    e["steps"] += 1
    e["emitted"] += len(new)
    e["drafted"] += int(drafted)
    e["accepted"] += int(accepted)
    e["no_draft_steps"] += int(drafted) == 0

  def finish(self, request_id: int, group_id: Hashable) -> None:
    """Drops the request's state; its tokens stay in the group index for later siblings."""
    self._requests.pop(request_id, None)
    group = self._groups.get(group_id)
    if group is None:
      return
    group.live.discard(request_id)
    if not group.live:  # possibly more siblings later (divided rollout): keep a while
      self._idle_groups[group_id] = None
      self._idle_groups.move_to_end(group_id)
      while len(self._idle_groups) > self.idle_groups_kept:
        old, _ = self._idle_groups.popitem(last=False)
        self._drop_group(old)

  def end_group(self, group_id: Hashable) -> None:
    """Frees a group's sibling index (no further request of it will run)."""
    self._idle_groups.pop(group_id, None)
    self._drop_group(group_id)

  def _drop_group(self, group_id: Hashable) -> None:
    group = self._groups.pop(group_id, None)
    if group is None:
      return
    for rid in list(group.live):
      self._requests.pop(rid, None)
    for s in group.segs:
      self.arena.free(s)

  @property
  def live_groups(self) -> int:
    return len(self._groups)
