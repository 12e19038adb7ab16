"""Divided rollout (Seer): a request yields its slot every few tokens, its KV kept on device.

A GRPO step waits for its longest response. Admission order alone cannot shorten that tail
once the longest requests are running: their slots are taken until they end. With divided
rollout a request that has generated `EngineConfig.divide_every` tokens since it was
(re)admitted offers its slot back: the engine asks the admission order (an online one, e.g.
scheduling's "history_residual": longest expected remaining work first) whether a queued request
should run instead. If so, the request's KV row is copied into a pool of `park_rows` rows on
the device (`ParkPool`), it rejoins the queue with its tokens so far, and a later admission
copies the row back into whichever slot frees. Nothing is recomputed, and since sampling keys
depend on (seed, request, position) alone, the tokens are those of an undivided rollout. A row
parks while the step before is still in flight (the device copies after it); the request may
resume only once the engine has read that step, so the pipeline never stops for a yield. Each
yield costs two row copies (~2 ms each for SmolLM2-135M on the 2-core CPU, 0.18 ms on an H200
where a decode step takes ~4 ms, both measured one yield per call). A pass parks all the
requests it yields in one call and resumes all the parked requests it admits in another
(`kv_cache.copy_rows`), so the dispatch and index transfer are paid per pass, not per yield
(bench/schedsim.py's traces yield 3 to 5 requests per pass that yields). The engine times a
pass at warm-up (`YieldCost`) and tells the admission order (`set_yield_cost`), which weighs it
against what a yield can gain.

The pool's size is a compile-time constant, and a pass's copies come in a few sizes (powers of
two up to 8 rows, `MAX_PASS_ROWS`), so they compile at warm-up: at most four per bucket.
Started-and-unfinished requests are at most slots + park_rows: a full pool stops yields until a
parked request resumes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled
from rhyme_jax.rollout.interface import yield_rule


@dataclasses.dataclass(frozen=True)
class YieldCost:
  """Device time of divided rollout's KV row copies (`ParkPool.warmup`), in seconds.

  A pass of the engine parks every request it yields in one call and resumes every parked
  request it admits in another (`ParkPool.park`, `ParkPool.resume`), so a pass of n yields
  costs about `pass_seconds(n)` = fixed + n x per_row: the fixed part (dispatch, index
  transfer, launch) is paid once per pass, the per-row part (bytes) once per yield."""

  one: float  # a pass of one yield (its two copies), queued as a rollout dispatches them
  one_waited: float  # the same, each pass waited for (for comparison)
  rows: int  # the larger pass timed
  many: float  # a pass of `rows` yields, queued

  @property
  def per_row(self) -> float:
    return max(0.0, (self.many - self.one) / (self.rows - 1)) if self.rows > 1 else self.one

  @property
  def fixed(self) -> float:
    return max(0.0, self.one - self.per_row)

  def pass_seconds(self, yields: int) -> float:
    return self.fixed + yields * self.per_row if yields else 0.0


# The most rows one copy call moves: a pass's yields are a few (3 to 5 in bench/schedsim.py's
# traces), and each width compiles per bucket at warm-up (an unrolled copy per row).
MAX_PASS_ROWS = 8


class ParkPool:
  """`rows` KV rows on the device for requests that yielded their slot, each with the engine's
  record of it (`LiveRequest`: tokens so far), keyed by request id."""

  def __init__(self, model_config, rows: int, cache_len: int, place: Callable[[Any], Any]):
    self.cache = place(KVCache.zeros(model_config, rows, cache_len))
    self.rows = rows
    self.reset()

  def reset(self) -> None:
    """Forgets every parked request (the rows' contents are dead: overwritten on reuse)."""
    self._free = list(range(self.rows - 1, -1, -1))
    self._held: dict[int, tuple[int, Any]] = {}  # request id -> (row, record)
    self.peak = 0  # most requests parked at once (since `reset`)

  def free_rows(self) -> int:
    return len(self._free)

  def record(self, request_id: int):
    """The parked request's record, or None when it is not parked."""
    held = self._held.get(request_id)
    return None if held is None else held[1]

  def pass_sizes(self, batch: int) -> list[int]:
    """Rows one copy call moves (its index array's width), the compiled sizes for a batch of
    `batch` rows: powers of two up to the first that holds min(batch, pool rows,
    MAX_PASS_ROWS); a larger pass takes several calls."""
    most = max(1, min(batch, self.rows, MAX_PASS_ROWS))
    return [1 << k for k in range(most.bit_length() + (most & (most - 1) > 0))]

  def _copies(self, dst: KVCache, src: KVCache, pairs: list[tuple[int, int]],
              batch: int) -> KVCache:
    """`dst` (donated) with the (destination row, source row) `pairs` copied from `src`: one
    `kv_cache.copy_rows` call per MAX_PASS_ROWS pairs, each padded to the smallest
    `pass_sizes` width that holds them by repeating its last pair (copying a row twice writes
    the same values); one host-to-device transfer of indices per call."""
    widest = self.pass_sizes(batch)[-1]
    for at in range(0, len(pairs), widest):
      part = pairs[at:at + widest]
      part += part[-1:] * ((1 << (len(part) - 1).bit_length()) - len(part))  # a pass size
      dst = compiled.copy_rows_jit(dst, src, np.array(part, np.int32).T)
    return dst

  def park(self, cache: KVCache, parks: list[tuple[int, Any]]) -> None:
    """For each (slot, record): copies `slot`'s KV row of `cache` (not donated) into a free
    pool row and keeps `record` (its `.req.request_id` the key) until the request resumes or
    is dropped. All of them in one call (one per MAX_PASS_ROWS)."""
    if len(parks) > len(self._free):
      raise RuntimeError(f"ParkPool.park: {len(parks)} rows asked, {len(self._free)} free "
                         "(the engine checks free_rows first)")
    if not parks:
      return
    pairs = []
    for slot, record in parks:
      row = self._free.pop()
      pairs.append((row, slot))
      self._held[record.req.request_id] = (row, record)
    self.cache = self._copies(self.cache, cache, pairs, cache.batch)
    self.peak = max(self.peak, len(self._held))

  def drop(self, request_id: int) -> None:
    """Frees a parked request's row without copying it back (it finished in flight)."""
    self._free.append(self._held.pop(request_id)[0])

  def resume(self, cache: KVCache, resumes: list[tuple[int, int]]) -> KVCache:
    """`cache` (donated) with each (slot, request id)'s parked KV row written into `slot`, in
    one call (one per MAX_PASS_ROWS); frees their rows."""
    if not resumes:
      return cache
    pairs = []
    for slot, request_id in resumes:
      row, _ = self._held.pop(request_id)
      self._free.append(row)
      pairs.append((slot, row))
    return self._copies(cache, self.cache, pairs, cache.batch)

  def warmup(self, cache: KVCache, reps: int = 0) -> tuple[KVCache, YieldCost | None]:
    """Compiles both copies at every pass size for a bucket's cache shape (`pass_sizes`).
    Returns the (donated) cache back and, with `reps` > 0, what yields cost (`YieldCost`;
    else None), timed on rows 0.. of both:
      - queued: 4 x `reps` passes (parks, then resumes) dispatched back to back and waited for
        once, per pass: what a pass of yields adds to the device's queue in a rollout, where
        copies follow steps without a wait. Passes of one yield and of `YieldCost.rows`
        (up to 4: a typical pass in bench/schedsim.py's traces moves 3 to 5);
      - waited: the fastest pass of one yield waited for (adds a round trip to the host per
        pass, which a rollout never waits for)."""
    batch = cache.batch
    def round_trip(cache, n):
      pairs = [(i, i) for i in range(n)]
      self.cache = self._copies(self.cache, cache, pairs, batch)
      return self._copies(cache, self.cache, pairs, batch)

    for n in self.pass_sizes(batch):  # compiles
      cache = jax.block_until_ready(round_trip(cache, n))
    if not reps:
      return cache, None
    waited = []
    for _ in range(reps):
      t0 = time.perf_counter()
      cache = jax.block_until_ready(round_trip(cache, 1))
      waited.append(time.perf_counter() - t0)
    queued = {}
    many = max(1, min(4, self.rows, batch))
    for n in sorted({1, many}):
      t0 = time.perf_counter()
      for _ in range(4 * reps):
        cache = round_trip(cache, n)
      jax.block_until_ready(cache)
      queued[n] = (time.perf_counter() - t0) / (4 * reps)
    return cache, YieldCost(queued[1], min(waited), many, queued[many])


class YieldRules:
  """The admission order's yield rule (`interface.yield_rule`) for the engine's passes.

  Built when a pass first asks. An order with `stable_rule` (history_residual) keeps its rule
  across passes until the engine reports a change (`changed`: a request queued, admitted or
  finished), since nothing else it reads moves: most passes only advance running requests,
  whose counts the rule reads from the engine's live map when asked. Those passes then skip
  the order's work over the whole queue. Other orders get a new rule every pass."""

  def __init__(self, admission, finished: dict, live: dict, every: int):
    self._args = (admission, finished, live, every)
    self._keep = bool(getattr(admission, "stable_rule", False))
    self._rule = None
    self.built = 0  # rules built (tests and benches count them)

  def changed(self) -> None:
    self._rule = None

  def get(self, queue) -> Callable[[Any], bool]:
    if self._rule is None or not self._keep:
      admission, finished, live, every = self._args
      self._rule = yield_rule(admission, queue, finished, live, every)
      self.built += 1
    return self._rule


def slots_to_yield(slots, queue, rules: YieldRules, every: int, room: int) -> list[int]:
  """Slots whose request should give way to a queued one, at most `room` (free pool rows).

  A request is asked once per `every` tokens it generates in a slot (`LiveRequest.since` marks
  the last time). The order decides for all requests asked in one pass, the queue standing
  (`rules`: an order with its own `yield_rule` finds its queued pick once per rule, not once
  per running request). Only while more requests wait than slots free up, so a yield never
  leaves a slot empty for lack of work.
  """
  out: list[int] = []
  free = sum(lv is None for lv in slots)
  rule = None
  for i, lv in enumerate(slots):
    if len(out) >= room or len(queue) <= free + len(out):
      break
    if lv is None or lv.done or len(lv.tokens) - lv.since < every:
      continue
    lv.since = len(lv.tokens)
    if rule is None:
      rule = rules.get(queue)
    if rule(lv.req):
      out.append(i)
  return out


def park(pool: ParkPool, cache: KVCache, slots: list, marked: list[int], queue: list,
         landing: list | None) -> None:
  """Parks the requests of slots `marked`: KV row and record into the pool (the device copies
  the row after every step already dispatched), slot freed. The request rejoins `queue` at
  once, or, while a step holding it is in flight (`landing` given), its record waits in
  `landing` for the engine to read that step."""
  pool.park(cache, [(i, slots[i]) for i in marked])
  for i in marked:
    lv = slots[i]
    slots[i] = None
    if landing is None:
      queue.append(lv.req)
    else:
      landing.append(lv)
