"""Divided rollout (Seer): a request yields its slot every few tokens, its KV kept on device.

A GRPO step waits for its longest response. Admission order alone cannot shorten that tail
once the longest requests are running: their slots are taken until they end. With divided
rollout a request that has generated `EngineConfig.divide_every` tokens since it was
(re)admitted offers its slot back: the engine asks the admission order (an online one, e.g.
scheduling's "history_residual": longest expected remaining work first) whether a queued request
should run instead. If so, the request's KV row is copied into a pool of `park_rows` rows on
the device (`ParkPool`), it rejoins the queue with its tokens so far, and a later admission
copies the row back into whichever slot frees. Nothing is recomputed, and since sampling keys
depend on (seed, request, position) alone, the tokens are those of an undivided rollout.

The pool's size is a compile-time constant, so the copies compile once per bucket at warm-up.
Started-and-unfinished requests are at most slots + park_rows: a full pool stops yields until a
parked request resumes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled


class ParkPool:
  """`rows` KV rows on the device for requests that yielded their slot, keyed by request id."""

  def __init__(self, model_config, rows: int, cache_len: int, place: Callable[[Any], Any]):
    self.cache = place(KVCache.zeros(model_config, rows, cache_len))
    self.rows = rows
    self._free = list(range(rows - 1, -1, -1))
    self._row_of: dict[int, int] = {}
    self.peak = 0  # most requests parked at once (since `reset`)

  def reset(self) -> None:
    """Forgets every parked request (the rows' contents are dead: overwritten on reuse)."""
    self._free = list(range(self.rows - 1, -1, -1))
    self._row_of = {}
    self.peak = 0

  def free_rows(self) -> int:
    return len(self._free)

  def __contains__(self, request_id: int) -> bool:
    return request_id in self._row_of

  def park(self, cache: KVCache, slot: int, request_id: int) -> None:
    """Copies `slot`'s KV row of `cache` (not donated) into a free pool row."""
    if not self._free:
      raise RuntimeError("ParkPool.park: no free row (the engine checks free_rows first)")
    row = self._free.pop()
    self.cache = compiled.copy_row_jit(self.cache, cache, jnp.int32(row), jnp.int32(slot))
    self._row_of[request_id] = row
    self.peak = max(self.peak, len(self._row_of))

  def resume(self, cache: KVCache, slot: int, request_id: int) -> KVCache:
    """`cache` (donated) with the parked request's KV row written into `slot`; frees its row."""
    row = self._row_of.pop(request_id)
    self._free.append(row)
    return compiled.copy_row_jit(cache, self.cache, jnp.int32(slot), jnp.int32(row))

  def warmup(self, cache: KVCache) -> KVCache:
    """Compiles both copies for a bucket's cache shape; returns the (donated) cache."""
    self.cache = compiled.copy_row_jit(self.cache, cache, jnp.int32(0), jnp.int32(0))
    return compiled.copy_row_jit(cache, self.cache, jnp.int32(0), jnp.int32(0))


def slots_to_yield(slots, queue, admission, finished: dict, live: dict, every: int,
                   room: int) -> list[int]:
  """Slots whose request should give way to a queued one, at most `room` (free pool rows).

  A request is asked once per `every` tokens it generates in a slot (`LiveRequest.since` marks
  the last time): it yields when `admission.next_to_admit`, offered the queue plus this request,
  picks another. Only while more requests wait than slots free up, so a yield never leaves a
  slot empty for lack of work.
  """
  out: list[int] = []
  free = sum(lv is None for lv in slots)
  for i, lv in enumerate(slots):
    if len(out) >= room or len(queue) <= free + len(out):
      break
    if lv is None or lv.done or lv.draining or len(lv.tokens) - lv.since < every:
      continue
    lv.since = len(lv.tokens)
    if admission.next_to_admit(list(queue) + [lv.req], finished, live) != len(queue):
      out.append(i)
  return out


def divide(pool: ParkPool, cache: KVCache, slots: list, queue: list, parked: dict, admission,
           finished: dict, live: dict, every: int, in_flight_rows: list) -> int:
  """One round of divided rollout before the engine's admissions; returns the slots freed.

  Marks the rows that should yield (`slots_to_yield`, within the pool's free rows), then parks
  every marked row whose last step has been read, i.e. that is not in the step still in
  flight (`in_flight_rows`: its (slot, LiveRequest, ...) rows): its KV row is copied into the
  pool, its slot freed, its request appended to `queue` and its record kept in `parked` (by
  request id) until an admission resumes it. A marked row still in flight is left out of the
  next step and parked on the next round.
  """
  room = pool.free_rows() - sum(lv is not None and lv.draining for lv in slots)
  for i in slots_to_yield(slots, queue, admission, finished, live, every, room):
    slots[i].draining = True
  busy = [row[1] for row in in_flight_rows]
  freed = 0
  for i, lv in enumerate(slots):
    if lv is not None and lv.draining and not any(lv is r for r in busy):
      pool.park(cache, i, lv.req.request_id)
      lv.draining, slots[i] = False, None
      parked[lv.req.request_id] = lv
      queue.append(lv.req)
      freed += 1
  return freed
