"""Balancing predicted work across data-parallel rollout shards and hosts (HistoPipe tier 1).

Each group (all G samples of a prompt, kept together so sibling drafting and group advantages
stay on one shard) goes to one of D shards. Longest-processing-time first (LPT): groups in
decreasing predicted work, each to the currently least loaded shard.

Deterministic without communication: work is an integer (predicted tokens, rounded once), ties
between equal works go by data order and ties between equal loads to the lowest shard index, and
nothing else enters. Every host that holds the same history and the same data order computes the
same assignment, bit for bit (no float sums whose order could differ between hosts).

Bound (Graham 1969): LPT's makespan is at most (4/3 - 1/(3m)) of the optimum on m shards.
Sketch: let job n (the smallest, w.l.o.g. the one finishing last) start at load s. Then
s <= (W - p_n)/m <= OPT - p_n/m, so LPT <= OPT + p_n (1 - 1/m). If p_n <= OPT/3 this is at most
(4/3 - 1/(3m)) OPT. If p_n > OPT/3, every job exceeds OPT/3, so the optimum holds at most two jobs
per shard, and LPT on such instances is optimal (it pairs the largest with the smallest fitting
jobs). `optimal_makespan` (exact, small instances) lets tests check the bound and its tightness.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Sequence

import numpy as np

from rhyme_jax.scheduling.admission import RequestMeta
from rhyme_jax.scheduling.predictor import LengthPredictor


def lpt_assign(work: Sequence[int], num_shards: int, index: Sequence[int] | None = None
               ) -> np.ndarray:
  """Shard (int64[n]) for each of n jobs with integer `work`, by LPT.

  `index` (default 0..n-1) is the tie-breaker among equal works: the data order, so the result
  is a function of (work, data order, num_shards) alone.
  """
  work = np.asarray(work)
  if work.size == 0:  # np.asarray([]) is float64: no jobs, nothing to check
    work = work.astype(np.int64)
  if work.ndim != 1:
    raise ValueError(f"lpt_assign: work must be 1-D, got shape {work.shape}")
  if not np.issubdtype(work.dtype, np.integer):
    raise TypeError(f"lpt_assign: work must be integers (for bit-identical results on every "
                    f"host), got {work.dtype}; round predicted tokens first")
  if num_shards < 1:
    raise ValueError(f"lpt_assign: num_shards must be >= 1, got {num_shards}")
  if np.any(work < 0):
    raise ValueError("lpt_assign: negative work")
  n = len(work)
  index = np.arange(n) if index is None else np.asarray(index)
  order = sorted(range(n), key=lambda i: (-int(work[i]), int(index[i])))
  heap = [(0, s) for s in range(num_shards)]  # (load, shard): least load, then lowest shard
  shard = np.zeros(n, np.int64)
  for i in order:
    load, s = heapq.heappop(heap)
    shard[i] = s
    heapq.heappush(heap, (load + int(work[i]), s))
  return shard


def shard_loads(work: Sequence[int], shard: Sequence[int], num_shards: int) -> np.ndarray:
  return np.bincount(np.asarray(shard, np.int64), weights=np.asarray(work, np.float64),
                     minlength=num_shards).astype(np.int64)


def optimal_makespan(work: Sequence[int], num_shards: int) -> int:
  """The exact minimum makespan, by branch and bound (small instances: n <~ 12)."""
  jobs = sorted((int(w) for w in work), reverse=True)
  if not jobs:
    return 0
  best = int(shard_loads(jobs, lpt_assign(np.array(jobs), num_shards), num_shards).max())
  lower = max(jobs[0], -(-sum(jobs) // num_shards))
  loads = [0] * num_shards

  def search(k: int) -> None:
    nonlocal best
    if best == lower:
      return
    if k == len(jobs):
      best = min(best, max(loads))
      return
    tried = set()
    for s in range(num_shards):
      if loads[s] in tried or loads[s] + jobs[k] >= best:
        continue  # shards with equal loads are interchangeable
      tried.add(loads[s])
      loads[s] += jobs[k]
      search(k + 1)
      loads[s] -= jobs[k]

  search(0)
  return best


def lpt_bound(num_shards: int) -> float:
  """Graham's worst-case ratio of LPT to the optimum on `num_shards` shards."""
  return 4 / 3 - 1 / (3 * num_shards)


def group_work(predicted_length: Sequence[float], group_size: Sequence[int]) -> np.ndarray:
  """Integer predicted tokens per group: round(per-sample length) x samples. A response is at
  least one token, so a predictor with no history yet (every prediction 0) still gives every
  group work, and LPT deals the groups round-robin instead of all to the lowest shard."""
  return (np.rint(np.maximum(np.asarray(predicted_length, np.float64), 1.0)).astype(np.int64)
          * np.asarray(group_size, np.int64))


def assign_groups(group_ids: Sequence[Hashable], work: Sequence[int], num_shards: int
                  ) -> dict[Hashable, int]:
  """{group_id: shard} by LPT; `group_ids` in data order (their position breaks ties)."""
  if len(set(group_ids)) != len(group_ids):
    raise ValueError("assign_groups: group_ids must be distinct")
  if len(group_ids) != len(work):
    raise ValueError(f"assign_groups: {len(group_ids)} groups but {len(work)} works")
  shard = lpt_assign(np.asarray(work), num_shards)
  return {g: int(s) for g, s in zip(group_ids, shard)}


def plan_shards(metas: Sequence[RequestMeta], predictor: LengthPredictor, num_shards: int
                ) -> dict[Hashable, int]:
  """{group_id: shard} for a step's requests: LPT over predicted group work (the trainer calls
  this on every host with the same requests in the same order and gets the same plan)."""
  groups: dict[Hashable, list[RequestMeta]] = {}
  for m in sorted(metas, key=lambda m: m.index):
    groups.setdefault(m.group_id, []).append(m)
  ids = list(groups)
  lengths = [predictor.predict(groups[g][0].prompt_key).length for g in ids]
  return assign_groups(ids, group_work(lengths, [len(groups[g]) for g in ids]), num_shards)


def plan_hosts(keys: Sequence[Hashable], group_size: int, predictor: LengthPredictor,
               num_hosts: int) -> tuple[list[list[int]], np.ndarray]:
  """Which of a round's prompts (`keys`, the whole round in data order) each host samples.

  Returns (per host, the indices of its prompts in data order; int64[n] predicted work per
  prompt: G x its predicted length, rounded as `group_work`). LPT over that work, ties by data
  order, so every host that holds the same history derives the same plan without
  communication (rl.hosts, --balance_hosts)."""
  work = group_work([predictor.predict(k).length for k in keys], [group_size] * len(keys))
  host = lpt_assign(work, num_hosts)
  return [np.flatnonzero(host == h).tolist() for h in range(num_hosts)], work
