"""A rollout's tail: when the live rows move into a smaller bucket.

Once nothing is queued, finishes leave empty slots that every step still computes. Moving the
live rows into a smaller bucket stops that, at a price: the regroup copies the KV cache (timed
at warm-up, `RolloutEngine.move_seconds`) and must wait for the step in flight, so the pipeline
drains and the device idles for one host pass. Whether that pays depends on the device: a CPU's
step time scales with the rows, so the first steps repay a move; an H100's hardly changes
below a few dozen rows (bench/forward.py: 2.14 / 1.49 / 2.02 ms at 1 / 8 / 32 rows), so a move
there mostly costs. So the engine asks its cost model (`CostModel.bucket_to_run`), over the
steps the rows are expected to still run, estimated from the lengths this rollout's finished
requests reached (`FinishedLengths`). `EngineConfig.bucket_moves = "always"` moves at once.
A move changes where rows run, never what they sample.

The same holds for launches of several plain steps (`EngineConfig.multi_step`) once nothing
waits: `drain_single` decides when one-step launches report ends, and free rows for a move,
sooner.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np


def suffix_sums(parts: Sequence[np.ndarray]) -> tuple[list[int], list[float]]:
  """(sorted lengths, sums of each suffix with the empty one last) of the concatenated `parts`,
  for `longer_than` in O(log n) (Python lists: bisect on a few hundred lengths beats numpy's
  call overhead, and the engine asks between decode steps). Also the history predictor's
  (scheduling/predictor.py) residual life."""
  lengths = np.sort(np.concatenate(parts)) if len(parts) else np.zeros(0, np.int64)
  sums = np.concatenate([np.cumsum(lengths[::-1])[::-1], [0]]).astype(np.float64)
  return lengths.tolist(), sums.tolist()


def longer_than(table: tuple[list[int], list[float]], n: int) -> tuple[int, float]:
  """(how many, their sum) of a `suffix_sums` table's lengths greater than n (integer sums,
  exact in float64)."""
  lengths, sums = table
  at = bisect.bisect_right(lengths, n)
  return len(lengths) - at, sums[at]


class FinishedLengths:
  """Response lengths of a rollout's finished requests, and what they say about a live one."""

  def __init__(self, finished: dict):
    self.finished = finished  # request id -> response length (the rollout's map, read live)
    self._table = suffix_sums([])

  def expected_left(self, n: int, cap: int) -> float:
    """Tokens a request with `n` so far and token cap `cap` is expected to still generate: the
    mean of L - n over the finished lengths L > n and its cap (counted as one such length: a
    request longer than every finished one may run to its cap)."""
    if len(self._table[0]) != len(self.finished):
      self._table = suffix_sums([np.fromiter(self.finished.values(), np.int64)])
    count, total = longer_than(self._table, n)
    return (total - n * count + cap - n) / (count + 1)


def bucket_target(rollout, live_idx: list[int]) -> int:
  """The bucket the live rows (`live_idx`) of `rollout` (a loop.Rollout) should run in: its
  bucket while requests wait or no smaller one holds them; else the smallest that does
  ("always", or before a warm-up timed the moves), or the cost model's choice over the most
  steps any row is expected to run (its expected tokens over the tokens per row-step so far),
  each move's warm-up time and one drained host pass (`Rollout.pass_s`). Counts the passes the
  cost model held the rows out of a smaller bucket (`EngineStats.moves_held`)."""
  engine, bucket, pending = rollout.engine, rollout.bucket, rollout.pending
  fit = engine.bucket_for(len(live_idx))
  if rollout.queue or not live_idx or fit >= bucket:
    return bucket
  if engine.config.bucket_moves == "always" or not engine.move_seconds:
    return fit  # (nothing to weigh before a warm-up)
  rows = [rollout.slots[i] for i in live_idx]
  in_flight = 0 if pending is None else pending.shape[2] * pending.steps  # tokens per row
  longest = max(len(lv.req.prompt) + len(lv.tokens) for lv in rows) + in_flight
  # tokens a row gets per step so far (above 1 where speculation accepted drafts)
  st = rollout.stats
  per_step = max(st.tokens / max(st.useful_slot_steps, 1), 1.0)
  steps_left = max(rollout.lengths.expected_left(len(lv.tokens), lv.req.params.max_new_tokens)
                   for lv in rows) / per_step
  smaller = [b for b in engine.config.buckets if fit <= b < bucket]
  target = engine.costs.bucket_to_run(bucket, smaller, engine._kv_len_for(longest + 1),
                                      engine.move_seconds, rollout.pass_s or 0.0, steps_left)
  rollout.stats.moves_held += target == bucket
  return target


def drain_single(rollout, longest: int) -> bool:
  """With no request waiting, whether the next launch of `rollout` (a loop.Rollout) runs one
  plain step rather than `multi_step` (`EngineConfig.drain_steps`). A launch of k steps makes
  its rows' ends known only when it is read, a launch later when pipelined, so the rollout's
  end and each bucket move come up to 2k steps late; with nothing waiting its one gain is host
  time. "cost": one step where a drained host pass (`Rollout.pass_s`) takes less than the
  step's time in the cost model at the rows' bucket and the cache length that holds `longest`
  positions (the longest row's, with the launch in flight's) and the step, so that pipelining
  hides the extra passes."""
  mode = rollout.cfg.drain_steps
  if mode != "cost":
    return mode == "single"
  if rollout.pass_s is None:
    return False
  engine, bucket = rollout.engine, rollout.bucket
  shape = (bucket, bucket, 1, engine._kv_len_for(longest + 1))
  return rollout.pass_s < engine.costs.time(shape)
