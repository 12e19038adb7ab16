"""Response-length prediction: from past epochs (HistoPipe) and from finished siblings (Seer).

RL revisits every prompt once per epoch, and a prompt's response length is stable between epochs
in *rank* (a hard problem stays long) even when the whole length distribution drifts (responses
grow or shrink as the policy trains). So the predictor works in ranks: for each kept epoch it
turns a prompt's group statistic (mean / max / a quantile of its G lengths) into a quantile rank
among all prompts seen in that epoch, averages the ranks over the kept epochs (recent epochs
weigh more), and maps the rank back to tokens through the newest epoch's distribution (the
newest holding at least half as many prompts as the largest: `mapping_epoch`). A prompt whose
one kept epoch is the newest gets that epoch's statistic itself.

Lengths come from a `LengthSource`: `StoreLengths` reads a `history.store.HistoryStore`,
`LengthTable` holds lengths alone (simulator, tests, or a trainer that keeps no responses).

The predictor also answers the engine's tail cost model (`remaining_tokens`): the expected
number of tokens a live request still has to generate, given how many it already has, from the
prompt's own past lengths (the empirical residual life E[L - n | L > n]), and the divided
rollout's order a quantile of that same residual life (`remaining_quantile`).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from rhyme_jax.rollout.tail import longer_than, suffix_sums

STATS = ("mean", "max", "median", "q75", "q90")


class LengthSource(Protocol):
  """Read-only per-prompt response lengths by epoch (oldest epoch first). A source may also
  carry `generation`, a stamp that changes whenever its content does: the predictor then
  drops its caches by itself; without one it keeps them until `refresh`."""

  def keys(self) -> Iterable[Hashable]: ...

  def epoch_lengths(self, key: Hashable) -> Sequence[tuple[int, np.ndarray]]: ...


class LengthTable:
  """A `LengthSource` holding only lengths: {key: {epoch: int64[G]}}; keeps `epochs_kept`."""

  def __init__(self, epochs_kept: int = 1):
    if epochs_kept < 1:
      raise ValueError(f"LengthTable: epochs_kept must be >= 1, got {epochs_kept}")
    self.epochs_kept = int(epochs_kept)
    self._table: dict[Hashable, dict[int, np.ndarray]] = {}
    self.generation = 0  # bumped by every `add`

  def add(self, key: Hashable, epoch: int, lengths: Sequence[int]) -> None:
    """Records lengths of `key` in `epoch` (appended to that epoch's when it has some)."""
    arr = np.asarray(lengths, np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
      raise ValueError(f"LengthTable.add: negative length for key {key!r}")
    per_epoch = self._table.setdefault(key, {})
    per_epoch[int(epoch)] = np.concatenate([per_epoch.get(int(epoch), np.zeros(0, np.int64)), arr])
    for old in sorted(per_epoch)[:-self.epochs_kept]:
      del per_epoch[old]
    self.generation += 1

  def keys(self) -> list[Hashable]:
    return list(self._table)

  def epoch_lengths(self, key: Hashable) -> list[tuple[int, np.ndarray]]:
    per_epoch = self._table.get(key, {})
    return [(e, per_epoch[e]) for e in sorted(per_epoch)]


class StoreLengths:
  """A `LengthSource` over a `history.store.HistoryStore` (`store.epoch_lengths`)."""

  def __init__(self, store):
    self.store = store

  @property
  def generation(self) -> int:
    return self.store.generation  # changes on add, eviction and reload

  def keys(self) -> list[Hashable]:
    return list(self.store.keys())

  def epoch_lengths(self, key: Hashable) -> list[tuple[int, np.ndarray]]:
    return list(self.store.epoch_lengths(key))


def group_stat(lengths: np.ndarray, stat: str) -> float:
  """One number summarising a group's lengths (the group's predicted per-sample length)."""
  lengths = np.asarray(lengths, np.float64)
  if stat == "mean":
    return float(lengths.mean())
  if stat == "max":
    return float(lengths.max())
  if stat == "median":
    return float(np.median(lengths))
  if stat in ("q75", "q90"):
    return float(np.quantile(lengths, int(stat[1:]) / 100))
  raise ValueError(f"group_stat: stat={stat!r}: expected one of {STATS}")


def _quantile_rank(values: np.ndarray, x: float) -> float:
  """Rank of x among sorted `values` in [0, 1], the inverse of `np.quantile`'s linear
  interpolation (position / (n - 1)); ties take their middle position."""
  if len(values) == 1:
    return 0.5
  lo = np.searchsorted(values, x, side="left")
  hi = np.searchsorted(values, x, side="right")
  if lo == hi:  # not in the population: interpolate between its neighbours
    if lo == 0 or lo == len(values):
      return 0.0 if lo == 0 else 1.0
    a, b = values[lo - 1], values[lo]
    return float((lo - 1 + (x - a) / (b - a)) / (len(values) - 1))
  return float((lo + hi - 1) / 2 / (len(values) - 1))


def mapping_epoch(populations: Mapping[int, np.ndarray]) -> int:
  """The epoch whose lengths ranks map back to tokens through: the newest holding at least
  half as many prompts as the largest. The newest epoch alone tracks drift best, but a step
  into an epoch it holds a step's prompts or fewer (with one epoch kept the previous epoch
  shrinks as it grows), and mapping through two or three group statistics squeezed every
  prediction onto a line between them, or onto one value where they were equal (two capped
  groups): LPT then dealt equal work round-robin and orders fell back to data order."""
  largest = max(len(v) for v in populations.values())
  return max(e for e, v in populations.items() if 2 * len(v) >= largest)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Per-sample predicted length of a prompt's responses, and whether history backs it."""

  length: float
  known: bool


class LengthPredictor:
  """Predicts per-prompt response lengths from the epochs a `LengthSource` keeps.

  stat: the group statistic ranked per epoch ("max" predicts a group's tail, "mean" its work).
  recency: weight of an epoch relative to the next newer one when ranks are averaged.
  residual_prior: in `remaining_tokens`, the weight (in samples) of all prompts' residual life
    against the prompt's own kept lengths.
  """

  def __init__(self, source: LengthSource, stat: str = "mean", recency: float = 0.5,
               residual_prior: float = 4.0):
    if stat not in STATS:
      raise ValueError(f"LengthPredictor: stat={stat!r}: expected one of {STATS}")
    if not 0 < recency <= 1:
      raise ValueError(f"LengthPredictor: recency={recency}: must be in (0, 1]")
    if not residual_prior >= 0:
      raise ValueError(f"LengthPredictor: residual_prior={residual_prior}: must be >= 0")
    self.source, self.stat, self.recency = source, stat, float(recency)
    self.residual_prior = float(residual_prior)
    self._population: dict[int, np.ndarray] | None = None
    self._all_lengths: tuple[list[int], list[float]] | None = None
    self._own_lengths: dict[Hashable, tuple[list[int], list[float]]] = {}
    self._generation = getattr(source, "generation", None)

  def refresh(self) -> None:
    """Forgets the cached populations and residual-life tables. Automatic for a source with a
    `generation` stamp (a history store, a `LengthTable`); call it after changing another."""
    self._population = None
    self._all_lengths = None
    self._own_lengths = {}
    self._generation = getattr(self.source, "generation", None)

  def _check_source(self) -> None:
    """Drops the caches when the source's content changed since they were built."""
    if getattr(self.source, "generation", None) != self._generation:
      self.refresh()

  def _populations(self) -> dict[int, np.ndarray]:
    """Sorted group statistics of every prompt, per epoch."""
    self._check_source()
    if self._population is None:
      per_epoch: dict[int, list[float]] = {}
      for key in self.source.keys():
        for epoch, lengths in self.source.epoch_lengths(key):
          if len(lengths):
            per_epoch.setdefault(epoch, []).append(group_stat(lengths, self.stat))
      self._population = {e: np.sort(np.asarray(v)) for e, v in per_epoch.items()}
    return self._population

  def predict(self, key: Hashable) -> Prediction:
    """The prompt's predicted per-sample length; unknown prompts get the population median."""
    pops = self._populations()
    if not pops:
      return Prediction(0.0, False)
    newest = pops[mapping_epoch(pops)]
    history = [(e, l) for e, l in self.source.epoch_lengths(key) if len(l)]
    if not history:
      return Prediction(float(np.median(newest)), False)
    if len(history) == 1 and history[0][0] == max(pops):
      return Prediction(group_stat(history[0][1], self.stat), True)
    latest = max(e for e, _ in history)
    ranks, weights = [], []
    for epoch, lengths in history:
      ranks.append(_quantile_rank(pops[epoch], group_stat(lengths, self.stat)))
      weights.append(self.recency ** (latest - epoch))
    rank = float(np.average(ranks, weights=weights))
    return Prediction(float(np.quantile(newest, min(max(rank, 0.0), 1.0))), True)

  def predict_many(self, keys: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """(float64[R] predicted lengths, bool[R] known) for `keys`."""
    preds = [self.predict(k) for k in keys]
    return (np.array([p.length for p in preds], np.float64),
            np.array([p.known for p in preds], bool))

  # ---- tail cost model hook -----------------------------------------------------------------

  def _tables(self, key: Hashable) -> tuple:
    """`suffix_sums` tables of every prompt's kept lengths and of `key`'s (cached until
    the source changes)."""
    self._check_source()
    if self._all_lengths is None:
      kept = [l for k in self.source.keys() for _, l in self.source.epoch_lengths(k)]
      self._all_lengths = suffix_sums(kept)
    if key not in self._own_lengths:
      self._own_lengths[key] = suffix_sums([l for _, l in self.source.epoch_lengths(key)])
    return self._all_lengths, self._own_lengths[key]

  def remaining_tokens(self, key: Hashable, generated: int, max_new_tokens: int) -> float:
    """Expected tokens still to come for a live request of prompt `key` with `generated` tokens.

    E[L - n | L > n], the residual life: over the prompt's kept lengths longer than n, with the
    residual life over every prompt's lengths counted as `residual_prior` more samples. A group
    of G = 8 kept lengths leaves one or two beyond a long-running request's n, whose mean alone
    is noise: on the recorded SmolLM2 GSM8K T=0.6 trace (64 slots, flat H100 step times,
    divided rollout every 16 tokens) the own-lengths-only estimate finished at 1.032 of the
    oracle's makespan, shrunk with a prior of 2-16 samples at 0.986 (bench/RESULTS.md). Half
    the remaining room when the request outran all history (no evidence either way). Always
    in [1, max_new_tokens - generated] while room is left.
    """
    room = max_new_tokens - generated
    if room <= 0:
      return 0.0
    every, own = self._tables(key)
    n_every, sum_every = longer_than(every, generated)
    if not n_every:
      return max(room / 2, 1.0)
    # every prompt's residual life: all there is once the request outran its own lengths
    residual = sum_every / n_every - generated
    n_own, sum_own = longer_than(own, generated)
    if n_own:
      k = self.residual_prior
      residual = (sum_own - n_own * generated + k * residual) / (n_own + k)
    return float(min(max(residual, 1.0), room))

  def remaining_quantile(self, key: Hashable, generated: int, max_new_tokens: int,
                         q: float) -> float:
    """The q-quantile of the tokens still to come for a live request of prompt `key`.

    The distribution is the one whose mean is `remaining_tokens`: L - n over the prompt's kept
    lengths L > n, one sample each, mixed with every prompt's lengths L > n weighing
    `residual_prior` samples in all. The smallest r in [1, max_new_tokens - n] whose share
    of that mixture at or below r reaches q (the room when none does); half the room when the
    request outran all history. An upper quantile ranks a prompt whose samples may run to the
    cap by that risk, where the mean averages it away (`admission.ResidualPolicy`).
    """
    room = max_new_tokens - generated
    if room <= 0:
      return 0.0
    every, own = (lengths for lengths, _ in self._tables(key))
    start_every, start_own = (bisect.bisect_right(xs, generated) for xs in (every, own))
    n_every, n_own = len(every) - start_every, len(own) - start_own
    if not n_every:
      return max(room / 2, 1.0)
    k = self.residual_prior if n_own else 1.0  # the prior alone once the request outran its own

    def share(r: int) -> float:  # the mixture's weight at L - n <= r
      x = generated + r
      return ((bisect.bisect_right(own, x) - start_own)
              + k * (bisect.bisect_right(every, x) - start_every) / n_every) / (n_own + k)

    # the smallest r in [1, room] with share(r) >= q (share grows with r), else the room
    return float(min(bisect.bisect_left(range(1, room + 1), q, key=share) + 1, room))

  def remaining_work(self, live: Mapping[Hashable, tuple[Hashable, int, int]]) -> dict:
    """{request_id: expected remaining tokens} for live requests given as
    {request_id: (prompt_key, generated, max_new_tokens)}."""
    return {rid: self.remaining_tokens(k, n, m) for rid, (k, n, m) in live.items()}
