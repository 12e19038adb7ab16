"""Measured step times per (bucket, verify budget), and the speculation choice they imply.

The rollout engine runs one compiled step per (bucket B, draft budget T). What a step costs is a
measurement, not a formula: on a GPU a 135M model's step is launch-bound and nearly flat in B,
on a CPU it grows with B. `StepTimeTable` holds such measurements, interpolates between them
(piecewise linear in B, then in T; linear extrapolation past the largest measured B), and by
default makes them non-decreasing in B and in T (a larger shape never runs faster; measured
inversions are timing noise).

`best_budget` is the tail policy's cost model in its simplest form: verify a T-token tree only
where the step time per emitted token falls, T(B, T) / a(T) < T(B, 0), with a(T) the mean
accepted length the drafter achieves at budget T.

Built-in tables (bench/RESULTS.md, 2026-11-22):
- "h100": bench/engine_overhead.py on 1 x H100 80GB, bfloat16, SmolLM2-135M shapes, the
  engine's ms per decode step (host work + dispatch + outputs) at B in {1, 8, 64} and
  T in {0, 16}.
- "cpu": bench/forward.py on the 2-core AMD EPYC (shared), float32 SmolLM2-135M, decode ms per
  step at B in {1, 8, 32}, plain decoding only (T = 0).
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np

BUILTIN = {
    "h100": {(1, 0): 3.63, (8, 0): 2.45, (64, 0): 3.51,
             (1, 16): 2.74, (8, 16): 3.24, (64, 16): 7.30},
    "cpu": {(1, 0): 69.46, (8, 0): 277.25, (32, 0): 901.35},
}
# Prefill per prompt token, same sources' bench/forward.py runs (batch 1, 128-token prompt):
# H100 bf16 3.1 ms, CPU float32 1300.4 ms.
PREFILL_MS_PER_TOKEN = {"h100": 3.1 / 128, "cpu": 1300.4 / 128}


class StepTimeTable:
  """Milliseconds per engine step for (bucket, budget), from measurements."""

  def __init__(self, ms: Mapping[tuple[int, int], float], name: str = "custom",
               monotone: bool = True):
    if not ms:
      raise ValueError(f"step-time table {name!r} is empty")
    self.name = name
    self.buckets = sorted({b for b, _ in ms})
    self.budgets = sorted({t for _, t in ms})
    grid = np.full((len(self.buckets), len(self.budgets)), np.nan)
    for (b, t), v in ms.items():
      if b < 1 or t < 0 or not v > 0:
        raise ValueError(f"step-time table {name!r}: bad entry (bucket={b}, budget={t}) -> {v}")
      grid[self.buckets.index(b), self.budgets.index(t)] = float(v)
    if np.isnan(grid).any():
      b, t = np.argwhere(np.isnan(grid))[0]
      raise ValueError(f"step-time table {name!r}: missing (bucket={self.buckets[b]}, "
                       f"budget={self.budgets[t]}); measure every bucket at every budget")
    if monotone:
      grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=0), axis=1)
    self.grid = grid

  @classmethod
  def builtin(cls, name: str) -> "StepTimeTable":
    if name not in BUILTIN:
      raise ValueError(f"step-time table {name!r}: expected one of {sorted(BUILTIN)} or a file")
    return cls(BUILTIN[name], name)

  @classmethod
  def from_file(cls, path: str) -> "StepTimeTable":
    """JSON: [{"bucket": 8, "budget": 0, "ms": 2.45}, ...] (one object per measured shape)."""
    with open(path) as f:
      rows = json.load(f)
    try:
      ms = {(int(r["bucket"]), int(r["budget"])): float(r["ms"]) for r in rows}
    except (KeyError, TypeError) as e:
      raise ValueError(f"{path}: expected a JSON list of {{bucket, budget, ms}} objects ({e})")
    return cls(ms, path)

  @classmethod
  def load(cls, spec: str) -> "StepTimeTable":
    return cls.builtin(spec) if spec in BUILTIN else cls.from_file(spec)

  def _along_bucket(self, bucket: float) -> np.ndarray:
    """Step times at every measured budget for `bucket` (linear; extrapolated past the end)."""
    bs = self.buckets
    if len(bs) == 1 or bucket <= bs[0]:
      return self.grid[0]
    i = min(int(np.searchsorted(bs, bucket)), len(bs) - 1)
    lo, hi = i - 1, i
    w = (bucket - bs[lo]) / (bs[hi] - bs[lo])
    return self.grid[lo] + w * (self.grid[hi] - self.grid[lo])

  def ms(self, bucket: int, budget: int = 0) -> float:
    """Interpolated step time; budgets above the largest measured one are not extrapolated."""
    if budget > self.budgets[-1]:
      raise ValueError(f"step-time table {self.name!r}: budget {budget} beyond the measured "
                       f"{self.budgets[-1]}")
    row = self._along_bucket(bucket)
    return float(np.interp(budget, self.budgets, row))

  def best_budget(self, bucket: int, accepted: Mapping[int, float]) -> tuple[int, float]:
    """(budget, tokens per request per step) minimising step time per emitted token, among
    {0} and the budgets of `accepted` ({budget: mean accepted length, bonus included})."""
    best, best_rate, best_tokens = 0, self.ms(bucket, 0), 1.0
    for budget, a in sorted(accepted.items()):
      if budget <= 0 or budget > self.budgets[-1]:
        continue
      rate = self.ms(bucket, budget) / a
      if rate < best_rate:
        best, best_rate, best_tokens = budget, rate, float(a)
    return best, best_tokens

  def describe(self) -> str:
    cells = ", ".join(f"({b},{t}): {self.grid[i, j]:.2f}"
                      for i, b in enumerate(self.buckets) for j, t in enumerate(self.budgets))
    return f"{self.name} ms/step by (bucket, budget), made non-decreasing: {cells}"


def bucket_for(live: int, buckets: Sequence[int]) -> int:
  """The smallest bucket holding `live` requests (the engine's rule)."""
  fits = [b for b in buckets if b >= live]
  return min(fits) if fits else max(buckets)
