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
where a decode step takes ~4 ms); the engine times them at warm-up and tells the admission
order (`set_yield_cost`), which weighs them against what a yield can gain.

The pool's size is a compile-time constant, so the copies compile once per bucket at warm-up.
Started-and-unfinished requests are at most slots + park_rows: a full pool stops yields until a
parked request resumes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled
from rhyme_jax.rollout.interface import yield_rule


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

  def records(self) -> list:
    return [rec for _, rec in self._held.values()]

  def park(self, cache: KVCache, slot: int, record) -> None:
    """Copies `slot`'s KV row of `cache` (not donated) into a free pool row and keeps
    `record` (its `.req.request_id` the key) until the request resumes or is dropped."""
    if not self._free:
      raise RuntimeError("ParkPool.park: no free row (the engine checks free_rows first)")
    row = self._free.pop()
    self.cache = compiled.copy_row_jit(self.cache, cache, np.int32(row), np.int32(slot))
    self._held[record.req.request_id] = (row, record)
    self.peak = max(self.peak, len(self._held))

  def drop(self, request_id: int) -> None:
    """Frees a parked request's row without copying it back (it finished in flight)."""
    self._free.append(self._held.pop(request_id)[0])

  def resume(self, cache: KVCache, slot: int, request_id: int) -> KVCache:
    """`cache` (donated) with the parked request's KV row written into `slot`; frees its row."""
    row, _ = self._held.pop(request_id)
    self._free.append(row)
    return compiled.copy_row_jit(cache, self.cache, np.int32(slot), np.int32(row))

  def warmup(self, cache: KVCache, reps: int = 0) -> tuple[KVCache, float, float]:
    """Compiles both copies for a bucket's cache shape. Returns the (donated) cache back and,
    with `reps` > 0, a yield's cost in seconds two ways (else nan, nan):
      - queued: 4 x `reps` rounds (both copies) dispatched back to back, waited for once, per
        round: what a yield adds to the device's queue in a rollout, where copies follow
        steps without a wait (the engine's measure of a yield);
      - waited: the fastest single round waited for (adds a round trip to the host per yield,
        which a rollout never waits for)."""
    def round_trip(cache):
      self.cache = compiled.copy_row_jit(self.cache, cache, np.int32(0), np.int32(0))
      return compiled.copy_row_jit(cache, self.cache, np.int32(0), np.int32(0))

    cache = jax.block_until_ready(round_trip(cache))  # compiles
    waited = []
    for _ in range(reps):
      t0 = time.perf_counter()
      cache = jax.block_until_ready(round_trip(cache))
      waited.append(time.perf_counter() - t0)
    if not reps:
      return cache, float("nan"), float("nan")
    t0 = time.perf_counter()
    for _ in range(4 * reps):
      cache = round_trip(cache)
    jax.block_until_ready(cache)
    return cache, (time.perf_counter() - t0) / (4 * reps), min(waited)


def slots_to_yield(slots, queue, admission, finished: dict, live: dict, every: int,
                   room: int) -> list[int]:
  """Slots whose request should give way to a queued one, at most `room` (free pool rows).

  A request is asked once per `every` tokens it generates in a slot (`LiveRequest.since` marks
  the last time). The order decides for all requests asked in one pass, the queue standing
  (`interface.yield_rule`: an order with its own `yield_rule` finds its queued pick once, not
  once per running request). Only while more requests wait than slots free up, so a yield
  never leaves a slot empty for lack of work.
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
      rule = yield_rule(admission, queue, finished, live, every)
    if rule(lv.req):
      out.append(i)
  return out


def park(pool: ParkPool, cache: KVCache, slots: list, marked: list[int], queue: list,
         landing: list | None) -> None:
  """Parks the requests of slots `marked`: KV row and record into the pool (the device copies
  the row after every step already dispatched), slot freed. The request rejoins `queue` at
  once, or, while a step holding it is in flight (`landing` given), its record waits in
  `landing` for the engine to read that step."""
  for i in marked:
    lv = slots[i]
    pool.park(cache, i, lv)
    slots[i] = None
    if landing is None:
      queue.append(lv.req)
    else:
      landing.append(lv)
