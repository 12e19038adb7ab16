"""`HistoryDrafter`: HistoSpec (past epochs) + grouped (live siblings) drafts behind `DraftSource`.

Per prompt, a suffix index over its stored past responses is built lazily on first use and
cached (rebuilt when the store's entry changes). Per group, a sibling index grows as the engine
reports emitted tokens through `observe`; every request of the group (itself included: repeats
within one response are drafts too) drafts from it. Every indexed sequence starts with the
`START` sentinel, so a response that has barely begun still matches the openings of others.

Per request the draft budget adapts like the released HistoSpec code: start at `start_budget`,
double after a fully accepted draft (the deepest path accepted), halve otherwise, within
[1, max_budget] and never above the engine's per-query budget.

Engine protocol: `propose(queries)` before each step, `observe(request_id, group_id,
new_tokens, drafted, accepted)` after it (`new_tokens` = tokens the request emitted in the step,
`accepted` = draft tokens accepted, bonus excluded), `finish` when a request ends, `end_group`
when no further request of the group will run. The trainer calls `record_group` for each
finished group (the next epoch drafts from it) and `begin_epoch` at epoch boundaries.

Drafting off the critical path: a request's next draft depends on what the current step emits,
so it cannot simply be computed while that step runs. `lookahead` drafts a deeper tree from the
context *before* the step (the engine runs it in a background thread while the device
verifies); next step the engine passes the subtree continuing the emitted tokens as
`DraftQuery.ahead`, and `propose` takes it (cut to the adaptive budget) instead of matching
again. It is the walk the synchronous draft would start, anchored on a longer context: the
matched suffix plus the emitted tokens. When the emitted tokens left that tree, `propose`
drafts synchronously as before.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Hashable, Sequence

import numpy as np

from rhyme_jax.history.store import HistoryStore, prompt_key as hash_prompt
from rhyme_jax.history.suffix_index import SuffixIndex
from rhyme_jax.history.tree_draft import Source, build_tree, match_sources, tree_depth
from rhyme_jax.rollout.drafts import DraftQuery, DraftTree

START = -1  # sentinel opening every indexed response (never drafted)


def store_key(key: Hashable) -> Hashable:
  """The history-store key of a prompt key: token sequences (the engine's default key is the
  prompt's token tuple) become their stable hash; str / int keys pass through."""
  if isinstance(key, (tuple, list, np.ndarray)):
    return hash_prompt(key)
  return key


@dataclasses.dataclass
class _Request:
  group_id: Hashable
  budget: int
  last_depth: int = 0  # depth of the last proposed tree (0 = nothing drafted)
  seq_id: int | None = None  # its sequence in the group's sibling index
  indexed: int = 0  # response tokens already in the sibling index


@dataclasses.dataclass
class _Group:
  index: SuffixIndex
  live: set = dataclasses.field(default_factory=set)


class HistoryDrafter:
  """DraftSource drafting token trees from a prompt's past responses and its live siblings."""

  def __init__(self, store: HistoryStore | None = None, *, use_history: bool = True,
               use_siblings: bool = True, min_match: int = 2, max_match: int = 8,
               min_prob: float = 0.1, start_budget: int = 2, max_budget: int = 16,
               fallback_decay: float = 0.5, history_weight: float = 1.0,
               sibling_weight: float = 1.0, index_cache: int = 512,
               idle_groups_kept: int = 256):
    if not 1 <= min_match <= max_match:
      raise ValueError(f"HistoryDrafter: need 1 <= min_match ({min_match}) <= max_match "
                       f"({max_match})")
    if not 1 <= start_budget <= max_budget:
      raise ValueError(f"HistoryDrafter: need 1 <= start_budget ({start_budget}) <= max_budget "
                       f"({max_budget})")
    if not 0.0 < min_prob <= 1.0:
      raise ValueError(f"HistoryDrafter: min_prob must be in (0, 1], got {min_prob}")
    if use_history and store is None:
      raise ValueError("HistoryDrafter: use_history=True needs a HistoryStore")
    self.store = store
    self.use_history = use_history
    self.use_siblings = use_siblings
    self.min_match, self.max_match = min_match, max_match
    self.min_prob = min_prob
    self.start_budget, self.max_budget = start_budget, max_budget
    self.fallback_decay = fallback_decay
    self.history_weight, self.sibling_weight = history_weight, sibling_weight
    # Strings asked about: a match (<= max_match) plus a path of <= 2 * max_budget + 1 tokens
    # (a tree drafted ahead spans this step's draft, its bonus token and the next draft).
    self.index_depth = max_match + 2 * max_budget + 2
    self.index_cache = index_cache
    self.idle_groups_kept = idle_groups_kept
    self.epoch = 0
    self._history: collections.OrderedDict[Hashable, tuple[int, SuffixIndex]] = (
        collections.OrderedDict())
    self._requests: dict[int, _Request] = {}
    self._groups: dict[Hashable, _Group] = {}
    self._idle_groups: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    self.stats: dict[str, float] = collections.defaultdict(float)

  # --- trainer side -------------------------------------------------------------------------

  def begin_epoch(self, epoch: int) -> None:
    """Marks an epoch boundary; `record_group` defaults to this epoch."""
    self.epoch = int(epoch)

  def record_group(self, prompt_key: Hashable, responses: Sequence[Sequence[int]],
                   rewards: Sequence[float] | None = None, epoch: int | None = None) -> None:
    """Adds a finished group to the history store (drafts of later visits use it)."""
    if self.store is None:
      raise ValueError("HistoryDrafter.record_group: this drafter has no HistoryStore")
    self.store.add_group(store_key(prompt_key), self.epoch if epoch is None else epoch,
                         responses, rewards)

  # --- indexes ------------------------------------------------------------------------------

  def _history_index(self, key: Hashable) -> SuffixIndex | None:
    version = self.store.version(key)
    if version is None:
      return None
    cached = self._history.get(key)
    if cached is not None and cached[0] == version:
      self._history.move_to_end(key)
      return cached[1]
    t0 = time.perf_counter()
    index = SuffixIndex(self.index_depth)
    for r in self.store.responses(key):
      index.add_sequence(np.concatenate([[START], r]))
    self._history[key] = (version, index)
    self._history.move_to_end(key)
    while len(self._history) > self.index_cache:
      self._history.popitem(last=False)
    self.stats["history_index_builds"] += 1
    self.stats["history_index_seconds"] += time.perf_counter() - t0
    return index

  def _request(self, request_id: int, group_id: Hashable) -> _Request:
    req = self._requests.get(request_id)
    if req is None:
      req = _Request(group_id, self.start_budget)
      self._requests[request_id] = req
    return req

  def _group(self, group_id: Hashable) -> _Group:
    group = self._groups.get(group_id)
    if group is None:
      group = _Group(SuffixIndex(self.index_depth))
      self._groups[group_id] = group
    self._idle_groups.pop(group_id, None)
    return group

  def _feed_sibling(self, request_id: int, req: _Request, tokens: np.ndarray) -> None:
    if not self.use_siblings or len(tokens) == 0:
      return
    group = self._group(req.group_id)
    group.live.add(request_id)
    if req.seq_id is None:
      req.seq_id = group.index.add_sequence([START])
    group.index.extend(req.seq_id, tokens)
    req.indexed += len(tokens)

  # --- DraftSource --------------------------------------------------------------------------

  def budget_of(self, request_id: int) -> int:
    """The adaptive draft budget a request would get now (start_budget if unseen)."""
    req = self._requests.get(request_id)
    return self.start_budget if req is None else req.budget

  def context(self, response: np.ndarray) -> np.ndarray:
    """The tail matched against the indexes (START-prefixed while the response is short)."""
    tail = np.asarray(response, np.int64)[-self.max_match:]
    if len(response) < self.max_match:
      tail = np.concatenate([[START], tail])
    return tail

  def _draft(self, q: DraftQuery, budget: int) -> DraftTree:
    """A best-first tree of <= budget tokens from the matched suffixes (padded to q.budget)."""
    response = np.asarray(q.response, np.int64).reshape(-1)
    sources: list[Source] = []
    ctx = self.context(response)
    # An empty response is [START] alone: one token, but anchored at the start of every
    # indexed response, so it drafts how past responses (or siblings) began.
    min_len = 1 if len(response) == 0 else self.min_match
    if budget > 0 and self.use_history:
      index = self._history_index(store_key(q.prompt_key))
      if index is not None:
        sources += match_sources(index, ctx, min_len=min_len, max_len=self.max_match,
                                 weight=self.history_weight, decay=self.fallback_decay)
    if budget > 0 and self.use_siblings and q.group_id in self._groups:
      sources += match_sources(self._groups[q.group_id].index, ctx, min_len=min_len,
                               max_len=self.max_match, weight=self.sibling_weight,
                               decay=self.fallback_decay)
    tree, _ = build_tree(sources, max(budget, 0), min_prob=self.min_prob, pad_to=q.budget)
    return tree

  def propose(self, queries: Sequence[DraftQuery]) -> list[DraftTree]:
    t0 = time.perf_counter()
    out = []
    for q in queries:
      req = self._request(q.request_id, q.group_id)
      if self.use_siblings and req.indexed < len(q.response):  # tokens observe did not report
        self._feed_sibling(q.request_id, req, np.asarray(q.response[req.indexed:], np.int64))
      budget = max(min(req.budget, q.budget, self.max_budget), 0)
      if q.ahead is not None:  # drafted ahead (best-first order): its first `budget` nodes
        tree = q.ahead.padded(budget).padded(q.budget)
        self.stats["ahead_used"] += 1
        self.stats["ahead_tokens"] += tree.size
      else:
        tree = self._draft(q, budget)
      req.last_depth = tree_depth(tree)
      self.stats["draft_tokens"] += tree.size
      out.append(tree)
    self.stats["propose_calls"] += 1
    self.stats["propose_queries"] += len(queries)
    self.stats["propose_seconds"] += time.perf_counter() - t0
    return out

  def lookahead(self, queries: Sequence[DraftQuery]) -> list[DraftTree]:
    """Deeper trees for drafting ahead (up to q.budget tokens, enough for this step's adaptive
    draft, its bonus and the next one); reads budgets, indexes and the store and changes nothing
    `propose` / `observe` read (a history index may be built and cached)."""
    t0 = time.perf_counter()
    out = []
    for q in queries:
      # No use drafting deeper than this step's draft, its bonus and the next adaptive budget
      # (at most twice this one): trees past that would be cut anyway.
      req = self._requests.get(q.request_id)
      now = self.start_budget if req is None else req.budget
      cap = min(now, self.max_budget) + 1 + min(2 * now, self.max_budget)
      out.append(self._draft(q, min(q.budget, cap)))
    self.stats["lookahead_queries"] += len(queries)
    self.stats["lookahead_seconds"] += time.perf_counter() - t0
    return out

  def observe(self, request_id: int, group_id: Hashable, new_tokens: np.ndarray,
              drafted: int, accepted: int) -> None:
    t0 = time.perf_counter()
    req = self._request(request_id, group_id)
    depth = req.last_depth if req.last_depth > 0 else int(drafted)
    if depth > 0:  # budgets move only on steps that drafted something
      if accepted >= depth:
        req.budget = min(2 * req.budget, self.max_budget)
      else:
        req.budget = max(req.budget // 2, 1)
    req.last_depth = 0
    self._feed_sibling(request_id, req, np.asarray(new_tokens, np.int64).reshape(-1))
    self.stats["observe_calls"] += 1
    self.stats["drafted_tokens"] += int(drafted)
    self.stats["accepted_tokens"] += int(accepted)
    self.stats["observe_seconds"] += time.perf_counter() - t0

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
        self._groups.pop(old, None)

  def end_group(self, group_id: Hashable) -> None:
    """Frees a group's sibling index (no further request of it will run)."""
    self._groups.pop(group_id, None)
    self._idle_groups.pop(group_id, None)

  @property
  def live_groups(self) -> int:
    return len(self._groups)
