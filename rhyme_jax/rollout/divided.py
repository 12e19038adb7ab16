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
where a decode step takes ~4 ms, both measured one yield per call). A pass's copies go in
one call with the slot loading that admission makes anyway (`step.park_resume_load`): the rows
of the requests it yields out to the pool, then the rows of the parked requests it admits back,
so the dispatch and index transfers are paid once per pass, not per yield or per direction
(bench/schedsim.py's traces yield 3 to 5 requests per pass that yields; bench/divided_host.py
times the host side). The engine times a pass at warm-up (`YieldCost`) and tells the admission
order (`set_yield_cost`), which weighs it against what a yield can gain.

The pool's size is a compile-time constant, and a pass's copies come in a few sizes (powers of
two up to 8 rows each way, `MAX_PASS_ROWS`), so they compile at warm-up: at most four per
bucket, beside slot loading alone.
Started-and-unfinished requests are at most slots + park_rows: a full pool stops yields until a
parked request resumes.
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Any, Callable

import jax
import numpy as np

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled, kv_cache, step
from rhyme_jax.rollout.interface import yield_rule


@dataclasses.dataclass(frozen=True)
class YieldCost:
  """Device time of divided rollout's KV row copies (`ParkPool.warmup`), in seconds.

  A pass of the engine parks every request it yields and resumes every parked request it
  admits in the call that loads its admitted slots (`ParkPool.flush`), so a pass of n yields
  costs about `pass_seconds(n)` = fixed + n x per_row: the fixed part (the call's launch and
  index transfer, which slot loading alone would mostly pay too) once per pass, the per-row part
  (bytes) once per yield."""

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


# The most rows one call moves each way: a pass's yields are a few (3 to 5 in
# bench/schedsim.py's traces), and each width compiles per bucket at warm-up (an unrolled copy
# per row).
MAX_PASS_ROWS = 8


class ParkPool:
  """`rows` KV rows on the device for requests that yielded their slot, each with the engine's
  record of it (`LiveRequest`: tokens so far), keyed by request id.

  `park` and `resume` keep the books at once and queue the row copies; `flush` dispatches
  them with the pass's slot loading (`step.park_resume_load`). A pass that moves rows one way
  only pads the other with copies nobody reads: a slot into a spare pool row (the sink, never
  handed out), or the sink into a slot this call parks (its row is saved first in the same
  call; what the slot holds is dead until the pass admits another request there)."""

  def __init__(self, model_config, rows: int, cache_len: int, place: Callable[[Any], Any]):
    self.cache = place(KVCache.zeros(model_config, rows + 1, cache_len))  # + the sink
    self.rows = rows
    self.reset()

  def reset(self) -> None:
    """Forgets every parked request (the rows' contents are dead: overwritten on reuse)."""
    self._free = list(range(self.rows - 1, -1, -1))
    self._held: dict[int, tuple[int, Any]] = {}  # request id -> (row, record)
    self._parks: list[tuple[int, int]] = []  # queued copies: (pool row, slot)
    self._resumes: list[tuple[int, int]] = []  # (slot, pool row)
    self.peak = 0  # most requests parked at once (since `reset`)

  def free_rows(self) -> int:
    return len(self._free)

  def due(self) -> bool:
    """Whether copies wait for `flush`."""
    return bool(self._parks or self._resumes)

  def record(self, request_id: int):
    """The parked request's record, or None when it is not parked."""
    held = self._held.get(request_id)
    return None if held is None else held[1]

  def pass_sizes(self, batch: int) -> list[int]:
    """Rows one call moves each way (its index arrays' width), the compiled sizes for a batch
    of `batch` rows: powers of two up to the first that holds min(batch, pool rows,
    MAX_PASS_ROWS); a larger pass takes several calls."""
    return kv_cache.pair_widths(max(1, min(batch, self.rows, MAX_PASS_ROWS)))

  def park(self, parks: list[tuple[int, Any]]) -> None:
    """For each (slot, record): takes a free pool row for `slot`'s KV row and keeps `record`
    (its `.req.request_id` the key) until the request resumes or is dropped. The copy waits
    for `flush`, which the engine calls before anything writes to the slot."""
    if len(parks) > len(self._free):
      raise RuntimeError(f"ParkPool.park: {len(parks)} rows asked, {len(self._free)} free "
                         "(the engine checks free_rows first)")
    for slot, record in parks:
      row = self._free.pop()
      self._parks.append((row, slot))
      self._held[record.req.request_id] = (row, record)
    self.peak = max(self.peak, len(self._held))

  def drop(self, request_id: int) -> None:
    """Frees a parked request's row without copying it back (it finished in flight)."""
    self._free.append(self._held.pop(request_id)[0])

  def resume(self, resumes: list[tuple[int, int]]) -> None:
    """For each (slot, request id): the parked KV row goes back into `slot` at the next
    `flush`; frees the pool row (a row parked later in the same pass is copied before it)."""
    for slot, request_id in resumes:
      row, _ = self._held.pop(request_id)
      self._free.append(row)
      self._resumes.append((slot, row))

  def flush(self, state, ints_5xB: np.ndarray, floats_2xB: np.ndarray):
    """`state` (donated) after the queued copies and the slot loading (`step.load_slots`'
    arrays): one `park_resume_load` call when each way fits the widest pass size, else all
    the parks' calls, then the resumes', the loading in the last; `load_slots` alone when
    nothing is queued."""
    parks, resumes = self._parks, self._resumes
    self._parks, self._resumes = [], []
    if not parks and not resumes:
      return compiled.load_slots_jit(state, ints_5xB, floats_2xB)
    widest = self.pass_sizes(state.batch)[-1]
    if len(parks) <= widest and len(resumes) <= widest:
      calls = [(parks, resumes)]
    else:
      calls = ([(parks[i:i + widest], []) for i in range(0, len(parks), widest)] +
               [([], resumes[i:i + widest]) for i in range(0, len(resumes), widest)])
    unloaded = np.zeros_like(ints_5xB)  # LOAD_NEW unset: no slot changes
    for k, (out, back) in enumerate(calls):
      width = 1 << (max(len(out), len(back)) - 1).bit_length()
      out = out or [(self.rows, 0)]  # slot 0 into the sink
      back = back or [(out[0][1], self.rows)]  # the sink into a slot this call parks
      last = k == len(calls) - 1
      ints = step.pass_ints(kv_cache.padded_pairs(out, width),
                            kv_cache.padded_pairs(back, width), ints_5xB if last else unloaded)
      state, self.cache = compiled.park_resume_load_jit(state, self.cache, ints, floats_2xB)
    return state

  def warmup(self, state, reps: int = 0):
    """Compiles `park_resume_load` at every pass size for a bucket's state shape
    (`pass_sizes`). Returns the (donated) state back and, with `reps` > 0, what yields cost
    (`YieldCost`; else None), timed on rows 0.. of both, each call carrying the slot loading
    a pass makes with its copies (its launch is the part a yield pass would pay anyway):
      - queued: 4 x `reps` calls dispatched back to back and waited for once, per call: what
        a pass of yields adds to the device's queue in a rollout, where copies follow steps
        without a wait. Passes of one yield and of `YieldCost.rows` (up to 4: a typical
        pass in bench/schedsim.py's traces moves 3 to 5);
      - waited: the fastest pass of one yield waited for (adds a round trip to the host per
        pass, which a rollout never waits for)."""
    batch = state.batch
    ints, floats = np.zeros((5, batch), np.int32), np.ones((2, batch), np.float32)
    def one_pass(state, n):
      if n:
        self.park([(i, _stand_in(-1 - i)) for i in range(n)])
        self.resume([(i, -1 - i) for i in range(n)])
      return self.flush(state, ints, floats)

    for n in [0, *self.pass_sizes(batch)]:  # compiles (a width past the rows, padded)
      state = jax.block_until_ready(one_pass(state, min(n, self.rows)))
    if not reps:
      return state, None
    waited = []
    for _ in range(reps):
      t0 = time.perf_counter()
      state = jax.block_until_ready(one_pass(state, 1))
      waited.append(time.perf_counter() - t0)
    queued = {}
    many = max(1, min(4, self.rows, batch))
    for n in sorted({1, many}):
      t0 = time.perf_counter()
      for _ in range(4 * reps):
        state = one_pass(state, n)
      jax.block_until_ready(state)
      queued[n] = (time.perf_counter() - t0) / (4 * reps)
    return state, YieldCost(queued[1], min(waited), many, queued[many])


def _stand_in(request_id: int):
  """A record for warm-up's passes: what `ParkPool.park` reads of a `LiveRequest`."""
  return types.SimpleNamespace(req=types.SimpleNamespace(request_id=request_id))


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
    self._rule, self._free = None, 0
    self.built = 0  # rules built (tests and benches count them)

  def changed(self) -> None:
    self._rule = None

  def get(self, queue, free: int) -> Callable[[Any], bool]:
    """The rule for a pass with `free` empty slots (the order's first picks fill them)."""
    if self._rule is None or not self._keep or free != self._free:
      admission, finished, live, every = self._args
      self._rule, self._free = yield_rule(admission, queue, finished, live, every, free), free
      self.built += 1
    return self._rule


def slots_to_yield(slots, queue, rules: YieldRules, every: int, room: int) -> list[int]:
  """Slots whose request should give way to a queued one, at most `room` (free pool rows).

  A request is asked once per `every` tokens it generates in a slot (`LiveRequest.since` marks
  the last time). The order decides for all requests asked in one pass, the queue standing
  (`rules`: an order with its own `yield_rule` finds its queued picks once per rule, not once
  per running request); the empty slots take its first picks, and each request that yields
  gives way to the next (`interface.yield_rule`). Only while more requests wait than slots
  free up, so a yield never leaves a slot empty for lack of work.
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
      rule = rules.get(queue, free)
    if rule(lv.req):
      out.append(i)
  return out


def park(pool: ParkPool, slots: list, marked: list[int], queue: list,
         landing: list | None) -> None:
  """Parks the requests of slots `marked`: KV row (copied at the pass's `ParkPool.flush`,
  after every step already dispatched) and record into the pool, slot freed. The request
  rejoins `queue` at once, or, while a step holding it is in flight (`landing` given), its
  record waits in `landing` for the engine to read that step."""
  pool.park([(i, slots[i]) for i in marked])
  for i in marked:
    lv = slots[i]
    slots[i] = None
    if landing is None:
      queue.append(lv.req)
    else:
      landing.append(lv)
