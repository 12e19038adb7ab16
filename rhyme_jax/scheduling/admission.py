"""Admission order: which queued request takes a slot when one frees.

A rollout waits for its longest response, so the longest work should start first (the list
scheduling argument: a long request admitted last ends last). Policies see only request
metadata (`RequestMeta`) and what has been generated so far; they never touch tokens or random
keys, so the order changes when a request runs but never what it samples (the engine's keys
depend on (seed, request_id, position) alone).

How an engine uses a policy (the rollout engine through `engine_order.EngineOrder`):
  queue = policy.order(metas)                       # once, before the first admission
  while a slot is free and queue:                   # each time slots free up
    i = policy.next_to_admit(queue, finished, live)  # finished: {request_id: length},
    meta = queue.pop(i)                             # live: {request_id: tokens so far}
Static policies (`online = False`) always return 0 from an ordered queue; online ones re-rank
as siblings finish (probe-first) or as yielded requests rejoin the queue in divided rollout
(history_residual, `ResidualPolicy`; rollout/divided.py and the simulator ask its
`yield_rule`). A policy assumes the request it returns is admitted.

HistoPipe's cross-step alternation (`predicted_policy(..., alternate=True)`): long->short on even
steps, short->long on odd, so where rollout and training overlap, tails interleave.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Hashable, Mapping, Protocol, Sequence

import numpy as np

from rhyme_jax.history.store import store_key
from rhyme_jax.scheduling.predictor import LengthPredictor

# history_residual ranks remaining work by this quantile (ResidualPolicy; None: the mean)
RESIDUAL_QUANTILE = 0.75

POLICIES = ("fifo", "random", "history", "history_alt", "probe", "history_probe",
            "history_residual", "oracle")


@dataclasses.dataclass(frozen=True)
class RequestMeta:
  """What scheduling knows of a request: ids, data order and size limits, never tokens."""

  request_id: int
  group_id: Hashable
  prompt_key: Hashable
  index: int  # position in data order: the tie-breaker, identical on every host
  max_new_tokens: int = 0
  prompt_len: int = 0

  @classmethod
  def from_request(cls, req, index: int) -> "RequestMeta":
    """From a `rollout.engine.Request`: prompt_key defaults to the prompt tokens, as there, and
    is the history store's key for it (`history.store.store_key`), as the drafter records it."""
    key = store_key(req.prompt_key if req.prompt_key is not None else req.prompt)
    group = req.group_id if req.group_id is not None else req.request_id
    return cls(int(req.request_id), group, key, int(index),
               int(req.params.max_new_tokens), len(req.prompt))


def metas_from_requests(requests: Sequence) -> list[RequestMeta]:
  return [RequestMeta.from_request(r, i) for i, r in enumerate(requests)]


class AdmissionPolicy(Protocol):
  """See the module docstring."""

  online: bool

  def order(self, queue: Sequence[RequestMeta]) -> list[RequestMeta]: ...

  def next_to_admit(self, queue: Sequence[RequestMeta], finished: Mapping[int, int],
                    live: Mapping[int, int]) -> int: ...


def longest_first(lengths: Sequence[float], index: Sequence[int], reverse: bool = False
                  ) -> list[int]:
  """Positions sorted by length, longest first (shortest first if `reverse`); ties in data
  order. A pure function: the same inputs give the same order on every host."""
  lengths, sign = np.asarray(lengths, np.float64), 1.0 if reverse else -1.0
  return sorted(range(len(lengths)), key=lambda i: (sign * lengths[i], index[i]))


class StaticPolicy:
  """An order fixed before the rollout from a per-request score (higher runs first)."""

  online = False

  def __init__(self, name: str, score):
    self.name, self._score = name, score

  def order(self, queue: Sequence[RequestMeta]) -> list[RequestMeta]:
    return [queue[i] for i in longest_first([self._score(m) for m in queue],
                                            [m.index for m in queue])]

  def next_to_admit(self, queue, finished, live) -> int:
    del finished, live
    if not queue:
      raise IndexError(f"{self.name}.next_to_admit: empty queue")
    return 0


def fifo_policy() -> StaticPolicy:
  return StaticPolicy("fifo", lambda m: -m.index)


def random_policy(seed: int) -> StaticPolicy:
  """A seeded random order (a baseline: what arrival order looks like with no structure)."""
  rng = np.random.default_rng(seed)
  cache: dict[int, float] = {}
  return StaticPolicy("random", lambda m: cache.setdefault(m.request_id, float(rng.random())))


def predicted_policy(predictor: LengthPredictor, step: int = 0, alternate: bool = False
                     ) -> StaticPolicy:
  """Longest predicted first; with `alternate`, shortest first on odd steps (HistoPipe)."""
  sign = -1.0 if alternate and step % 2 else 1.0
  return StaticPolicy("history_alt" if alternate else "history",
                      lambda m: sign * predictor.predict(m.prompt_key).length)


def oracle_policy(true_lengths: Mapping[int, int]) -> StaticPolicy:
  """Longest true length first: the reference no predictor can beat by ordering alone."""
  return StaticPolicy("oracle", lambda m: float(true_lengths[m.request_id]))


class ContextAwarePolicy:
  """Seer's context-aware scheduling for groups, optionally seeded by history.

  A group no sibling of which has started is probed first: its first queued sample runs
  before any other group's second one (probes in order of their history prediction, then data
  order). Afterwards the group's estimate is the longest sibling seen so far, finished or still
  running (a running sibling's length is a lower bound), or its history prediction if longer;
  the queued request of the group with the longest estimate goes next.
  """

  online = True

  def __init__(self, predictor: LengthPredictor | None = None):
    self.name = "history_probe" if predictor is not None else "probe"
    self.predictor = predictor
    self._group: dict[int, Hashable] = {}
    self._prior: dict[Hashable, float] = {}
    self._started: set = set()

  def order(self, queue: Sequence[RequestMeta]) -> list[RequestMeta]:
    self._group = {m.request_id: m.group_id for m in queue}
    self._started = set()
    self._prior = {}
    if self.predictor is not None:
      for m in queue:
        if m.group_id not in self._prior:
          p = self.predictor.predict(m.prompt_key)
          self._prior[m.group_id] = p.length if p.known else 0.0
    return sorted(queue, key=lambda m: (-self._prior.get(m.group_id, 0.0), m.index))

  def group_estimates(self, finished: Mapping[int, int], live: Mapping[int, int]) -> dict:
    """{group: longest sibling length seen (finished or running), or its history prior}."""
    est = dict(self._prior)
    for done in (finished, live):
      for rid, n in done.items():
        g = self._group.get(rid)
        if g is not None and n > est.get(g, -1.0):
          est[g] = float(n)
    return est

  def next_to_admit(self, queue, finished, live) -> int:
    if not queue:
      raise IndexError(f"{self.name}.next_to_admit: empty queue")
    self._started |= self._seen(finished, live)
    best = self._pick(queue, finished, live, self._started)
    self._started.add(queue[best].group_id)  # admitted: its siblings are no longer probes
    return best

  def yield_rule(self, queue, finished, live, chunk: int,
                 free: int = 0) -> Callable[[RequestMeta], bool]:
    """Whether a running request gives its slot to the next queued pick, as this order would
    pick over the rest of the queue plus it (divided rollout): the first `free` picks fill the
    empty slots, each yes hands the next one on. Asks without admitting: the generic rule's
    `next_to_admit` would mark a probe started per running request asked, so one pass of yields
    used up the probes it yielded for and the freed slots went back to the yielded requests."""
    del chunk
    started, rest = self._started | self._seen(finished, live), list(queue)
    def take(k: int) -> bool:
      started.add(rest.pop(k).group_id)  # as admitting it would: its siblings are no probes
      return True
    for _ in range(min(free, len(rest))):
      take(self._pick(rest, finished, live, started))
    def rule(running: RequestMeta) -> bool:
      k = self._pick([*rest, running], finished, live, started) if rest else 0
      return k != len(rest) and take(k)
    return rule

  def _seen(self, finished, live) -> set:
    """Groups with a finished or running (started) request of this order's rollout."""
    return {self._group[rid] for rid in (*finished, *live) if rid in self._group}

  def _pick(self, queue, finished, live, started) -> int:
    """The index in `queue` admitted next given the `started` groups (no state changes). A
    request that has run (in `live`; in the simulator perhaps on another shard) is no probe,
    and its tokens so far bound its group's estimate."""
    probes = [i for i, m in enumerate(queue)
              if m.group_id not in started and m.request_id not in live]
    if probes:
      return min(probes, key=lambda i: (-self._prior.get(queue[i].group_id, 0.0),
                                        queue[i].index))
    est = self.group_estimates(finished, live)
    work = lambda m: max(est.get(m.group_id, 0.0), live.get(m.request_id, 0))
    return min(range(len(queue)), key=lambda i: (-work(queue[i]), queue[i].index))


class ResidualPolicy:
  """Longest remaining work first, re-ranked as requests run (for divided rollout).

  LRPT (longest remaining processing time first) minimises the makespan of preemptible jobs
  on identical machines when remaining times are known; here they are expected values: a
  request of prompt k with n tokens so far (it yielded its slot, Seer's divided rollout) still
  needs E[L - n | L > n] over k's history lengths, shrunk toward every prompt's
  (`LengthPredictor.remaining_tokens`): a request that has run long is predicted long (its
  short siblings drop out of the conditional).

  `quantile` (default 0.75): rank by that quantile of the same remaining-length distribution
  (`LengthPredictor.remaining_quantile`), ties by its mean. A makespan is the latest start +
  length, so a prompt whose samples may run to the cap must start early even when its mean is
  short; the mean averages that risk away and admits such a sample last (on the recorded H200
  GRPO trace at 64 slots, 44% of responses at the cap, the upper quartile's makespan was 0.910
  of the oracle's against the mean's 0.975: bench/RESULTS.md, 2026-11-27). None: the mean,
  which at n = 0 is the prompt's mean history length (without divided rollout, as "history").

  Ranking fresh requests against yielded ones starts nearly all early, their KV kept for more
  sequences than rows: `kv_budget` caps the started and unfinished ones (the simulator's KV
  pool; the engine stops yields at a full park pool instead), past it only started ones resume.

  A yield costs two KV row copies and their dispatch, `yield_cost` decode steps of the batch
  (timed at warm-up: `set_yield_cost`); pure LRPT swaps near-equal requests every chunk, on a
  GPU for more than the tail it cut. So a request yields only to m more remaining work: the W
  tokens of work left make about W / (m + chunk) yields of Y steps each, the margin lets the
  makespan slip about m steps, least at m + chunk = sqrt(Y W) (`yield_margin`). W shrinks as
  tokens are generated, so the margin falls to plain LRPT over the last chunks.

  Reads a yielded request's tokens so far from `live` (len(live) = requests started and
  unfinished); ties go to data order, identical on every host.
  """

  online = True
  name = "history_residual"
  # Its rule reads nothing that moves while only running requests advance but the tokens so
  # far, which only shrink its margin: the engine may keep it across passes.
  stable_rule = True

  def __init__(self, predictor: LengthPredictor, kv_budget: int | None = None,
               yield_cost: float = 0.0, quantile: float | None = RESIDUAL_QUANTILE):
    if kv_budget is not None and kv_budget < 1:
      raise ValueError(f"ResidualPolicy: kv_budget={kv_budget}: must be >= 1 or None")
    if quantile is not None and not 0 < quantile < 1:
      raise ValueError(f"ResidualPolicy: quantile={quantile}: must be in (0, 1) or None")
    self.predictor, self.kv_budget, self.quantile = predictor, kv_budget, quantile
    self.set_yield_cost(yield_cost)
    self._cache: dict[tuple[Hashable, int, int], tuple[float, float]] = {}
    self._keys: dict[int, tuple[RequestMeta, int, tuple[float, int]]] = {}  # next_to_admit's
    self._work = (0, 0.0)  # (requests, mean expected length) of the last `order`
    self._ids: frozenset = frozenset()  # its request ids

  def set_yield_cost(self, steps: float) -> None:
    """One yield's cost in decode steps of the batch (its two KV row copies / a step)."""
    if not math.isfinite(steps) or steps < 0:
      raise ValueError(f"ResidualPolicy: yield_cost={steps}: must be a finite number >= 0")
    self.yield_cost = float(steps)

  def yield_margin(self, chunk: int, done: float = 0.0) -> float:
    """Expected remaining tokens a queued request needs beyond a running one's to take its
    slot: sqrt(yield_cost x work left) - chunk, at least 0, where the work left is the opening
    work of the last `order` (requests x mean expected length) less `done`, the tokens its
    requests generated since (finished responses and started requests' tokens so far)."""
    n, mean = self._work
    return max(0.0, math.sqrt(self.yield_cost * max(n * mean - done, 0.0)) - chunk)

  def done_tokens(self, finished: Mapping[int, int], live: Mapping[int, int]) -> float:
    """Tokens the last `order`'s requests generated: finished lengths and counts so far."""
    return float(sum(n for d in (finished, live) for rid, n in d.items() if rid in self._ids))

  def remaining(self, meta: RequestMeta, generated: int) -> float:
    """The request's remaining work as ranked: the mean where `quantile` is None, else the
    quantile (whole tokens) plus mean / (cap + 1), below one token: equal quantiles (every
    prompt's samples may run to the cap) rank by the mean."""
    return self.estimate(meta, generated)[1]

  def estimate(self, meta: RequestMeta, generated: int) -> tuple[float, float]:
    """(mean remaining tokens, remaining work as ranked), kept per (prompt, tokens, cap)."""
    k = (meta.prompt_key, generated, meta.max_new_tokens)
    est = self._cache.get(k)
    if est is None:
      cap = meta.max_new_tokens or (1 << 30)
      mean = ranked = self.predictor.remaining_tokens(meta.prompt_key, int(generated), cap)
      if self.quantile is not None:
        ranked = (self.predictor.remaining_quantile(meta.prompt_key, int(generated), cap,
                                                    self.quantile) + mean / (cap + 1))
      est = self._cache[k] = (mean, ranked)
    return est

  def order(self, queue: Sequence[RequestMeta]) -> list[RequestMeta]:
    self._cache, self._keys = {}, {}
    self._ids = frozenset(m.request_id for m in queue)
    # the work the yield margin weighs is the expected (mean) one, however requests rank
    expected, ranked = zip(*[self.estimate(m, 0) for m in queue]) if queue else ((), ())
    self._work = (len(queue), float(np.mean(expected)) if expected else 0.0)
    perm = longest_first(ranked, [m.index for m in queue])
    return [queue[i] for i in perm]

  def yield_rule(self, queue, finished, live, chunk: int,
                 free: int = 0) -> Callable[[RequestMeta], bool]:
    """Whether a running request (tokens so far in `live`) gives its slot to the next queued
    pick, best first as `next_to_admit` ranks: when that one has more remaining work by over
    `yield_margin` (by a whole token where ranked by a quantile). The first `free` picks fill
    the empty slots; each yes hands the next one on. Found once for all the requests asked
    while `queue` and `live` stay as they are (a kept rule's margin is a little larger)."""
    picks = self._eligible(queue, live)
    heapq.heapify(picks)
    for _ in range(min(free, len(picks))):
      heapq.heappop(picks)
    margin = self.yield_margin(chunk, self.done_tokens(finished, live))
    whole = math.floor if self.quantile is not None else (lambda x: x)

    def rule(running: RequestMeta) -> bool:
      left = self.remaining(running, live.get(running.request_id, 0))
      if not picks or not whole(-picks[0][0][0]) > whole(left) + margin:
        return False
      heapq.heappop(picks)  # this slot goes to that pick: the next yes compares with the next
      return True
    return rule

  def should_yield(self, queue, running: RequestMeta, finished, live, chunk: int) -> bool:
    """`yield_rule` for one running request."""
    return self.yield_rule(queue, finished, live, chunk)(running)

  def next_to_admit(self, queue, finished, live) -> int:
    del finished
    if not queue:
      raise IndexError(f"{self.name}.next_to_admit: empty queue")
    return min(self._eligible(queue, live))[1]

  def _eligible(self, queue, live) -> list[tuple[tuple[float, int], int]]:
    """(sort key, position) of each queued request `next_to_admit` may pick; least key first.
    The engine asks once per admission and once per pass that offers yields, over the whole
    queue, between two decode steps. A queued request's work does not change while it waits,
    so its key is kept per request id (`_keys`: the meta it was made for, its tokens so far,
    the key) and a pass is a dict lookup per queued request."""
    # At the cap of its own started requests (the simulator's shards share one `live`) only
    # started requests resume.
    started_only = (self.kv_budget is not None and any(m.request_id in live for m in queue)
                    and sum(rid in self._ids for rid in live) >= self.kv_budget)
    keys, get, out = self._keys, live.get, []
    for i, m in enumerate(queue):
      rid = m.request_id
      n = get(rid)
      if n is None:
        if started_only:
          continue
        n = 0
      kept = keys.get(rid)
      if kept is not None and kept[0] is m and kept[1] == n:
        key = kept[2]
      else:
        key = (-self.remaining(m, n), m.index)
        keys[rid] = (m, n, key)
      out.append((key, i))
    return out


def make_policy(name: str, *, predictor: LengthPredictor | None = None, step: int = 0,
                seed: int = 0, true_lengths: Mapping[int, int] | None = None,
                kv_budget: int | None = None, yield_cost: float = 0.0,
                residual_quantile: float | None = RESIDUAL_QUANTILE) -> AdmissionPolicy:
  """A policy by name (one of POLICIES); names the missing input when one is needed.
  `kv_budget`, `yield_cost`, `residual_quantile`: "history_residual"'s cap on
  started-and-unfinished requests, the cost of a yield in decode steps and the quantile of
  remaining work it ranks by (None: the mean) (`ResidualPolicy`)."""
  if name == "fifo":
    return fifo_policy()
  if name == "random":
    return random_policy(seed)
  if name.startswith("history") and predictor is None:
    raise ValueError(f"admission policy {name!r} needs a length predictor")
  if name == "history":
    return predicted_policy(predictor, step)
  if name == "history_alt":
    return predicted_policy(predictor, step, alternate=True)
  if name == "probe":
    return ContextAwarePolicy()
  if name == "history_probe":
    return ContextAwarePolicy(predictor)
  if name == "history_residual":
    return ResidualPolicy(predictor, kv_budget, yield_cost, residual_quantile)
  if name == "oracle":
    if true_lengths is None:
      raise ValueError("admission policy 'oracle' needs the true lengths")
    return oracle_policy(true_lengths)
  raise ValueError(f"admission policy {name!r}: expected one of {POLICIES}")
