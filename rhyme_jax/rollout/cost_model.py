"""The engine's cost model: what a step of each compiled shape costs, what drafts are worth.

Step times per shape (bucket B, packed size P, tokens per row T, cache bucket S) are measured
at warm-up and refined online with an exponential moving average of whole loop iterations
(device, host sync, drafting and bookkeeping: what a step really costs the rollout). Each
request's acceptance rate is estimated from its own history with a prior from all requests.
A drafter's path probabilities are calibrated the same way: counts of past epochs and of
siblings are confident (a path all siblings took gets probability 1) but sampling often leaves
them, so each request's accepted nodes over the probabilities it was offered (own history over a
prior from all requests) scales them. A step then verifies the nodes, and picks the shape, with
the most expected tokens per second; when no shape beats the plain step, the step is plain.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable, Sequence

import numpy as np

Shape = tuple  # (bucket, packed P, tokens per row T, cache bucket S)


@dataclasses.dataclass
class _Ratio:
  """accepted / tried per request, shrunk toward a decayed ratio over all requests."""

  prior_strength: float
  own: dict = dataclasses.field(default_factory=dict)  # request id -> [accepted, tried]
  accepted: float = 1.0  # all requests (decayed): prior 0.5 until something is observed
  tried: float = 2.0

  def of(self, request_id: Hashable, high: float) -> float:
    a, t = self.own.get(request_id, (0.0, 0.0))
    k, g = self.prior_strength, self.accepted / max(self.tried, 1e-9)
    return float(np.clip((a + k * g) / (t + k), 0.0, high))

  def add(self, request_id: Hashable, accepted: float, tried: float) -> None:
    own = self.own.setdefault(request_id, [0.0, 0.0])
    own[0] += accepted
    own[1] += tried
    self.accepted = 0.99 * self.accepted + accepted
    self.tried = 0.99 * self.tried + tried


class CostModel:
  """Step times per shape and per-request acceptance, and the choice they imply."""

  def __init__(self, ema: float = 0.25, prior_strength: float = 4.0):
    self.ema = ema
    self.prior_strength = prior_strength
    self.seconds: dict[Shape, float] = {}
    # Accepted draft nodes over depth levels tested (accepted + the one that failed, if any).
    self._alpha = _Ratio(prior_strength)
    # Accepted draft nodes over the sum of the (uncalibrated) drafter probabilities verified.
    self._cal = _Ratio(prior_strength)

  # ---- step times --------------------------------------------------------------------------

  def observe_time(self, shape: Shape, seconds: float, warmup: bool = False) -> None:
    old = self.seconds.get(shape)
    self.seconds[shape] = seconds if old is None or warmup else (
        (1 - self.ema) * old + self.ema * seconds)

  def time(self, shape: Shape) -> float:
    """Seconds per step of `shape`, never below a measured shape of the same bucket and cache
    length that computes no more (fewer positions): noise must not make a bigger step look
    cheaper. Only shapes of one cache length compete in a step, so no other length's
    measurement (a short cache's steps follow prefills, say) may lift them. Unmeasured shapes
    scale the nearest measured one by P."""
    own = self._time(shape)
    smaller = [self._time(s) for s in self.seconds
               if s[0] == shape[0] and s[3] == shape[3] and s[1] <= shape[1] and s[2] <= shape[2]]
    return max([own] + smaller)

  def _time(self, shape: Shape) -> float:
    if shape in self.seconds:
      return self.seconds[shape]
    same = [(s, t) for s, t in self.seconds.items() if s[0] == shape[0]]
    if not same:
      return float(shape[1])  # nothing known: proportional to positions
    s, t = min(same, key=lambda st: abs(st[0][1] - shape[1]) + abs(st[0][3] - shape[3]))
    return t * max(shape[1] / s[1], 1.0)

  # ---- acceptance --------------------------------------------------------------------------

  def alpha(self, request_id: Hashable) -> float:
    """Per-level acceptance estimate: the request's own counts over a prior of all requests."""
    return self._alpha.of(request_id, 0.99)

  def calibration(self, request_id: Hashable) -> float:
    """Accepted nodes per unit of drafter probability offered: the request's own over a prior
    of all requests (1.0 = the drafter's probabilities are right)."""
    return self._cal.of(request_id, 1.0)

  def observe_acceptance(self, request_id: Hashable, depth: int, accepted: int,
                         offered: float | None = None) -> None:
    """After a step that asked for a draft: `depth` of the verified tree (0 when the drafter
    had nothing, which counts as one failed level), `accepted` draft nodes, and `offered`, the
    sum of the drafter's probabilities of the verified nodes (None: it gave none). Not called
    for a row whose drafts the step did not verify: an unverified node has not failed."""
    self._alpha.add(request_id, accepted, accepted + (1 if accepted < depth or depth <= 0 else 0))
    if offered is not None and offered > 0:
      self._cal.add(request_id, accepted, offered)

  def forget(self, request_id: Hashable) -> None:
    self._alpha.own.pop(request_id, None)
    self._cal.own.pop(request_id, None)

  def node_values(self, request_id: Hashable, depth: np.ndarray,
                  probs: np.ndarray | None) -> np.ndarray:
    """Expected accepted tokens each node adds: the drafter's path probability scaled by the
    request's calibration when given, else alpha ** depth."""
    if probs is not None and len(probs) == len(depth):
      return np.clip(probs.astype(np.float64) * self.calibration(request_id), 0.0, 1.0)
    return self.alpha(request_id) ** depth.astype(np.float64)

  # ---- the choice --------------------------------------------------------------------------

  def choose(self, plain: Shape | None, shapes: Sequence[Shape], values: Sequence[np.ndarray],
             live: int) -> tuple[Shape, list[int], float]:
    """The shape and per-row node counts with the most expected tokens per second.

    `values[r]` are row r's nodes' expected gains in best-first order (a prefix is a tree);
    returns (shape, nodes per row, expected tokens / s). Plain when nothing pays; with
    `plain` None the best of `shapes` (forced speculation).
    """
    best = None if plain is None else (plain, [0] * len(values), live / self.time(plain))
    for shape in shapes:
      room, cap = shape[1] - live, shape[2] - 1
      if room <= 0 or cap <= 0:
        continue
      take = [0] * len(values)
      heap = [(-v[0], r) for r, v in enumerate(values) if len(v)]
      heapq.heapify(heap)
      gain = 0.0
      while heap and room > 0:
        neg, r = heapq.heappop(heap)
        gain -= neg
        take[r] += 1
        room -= 1
        if take[r] < min(cap, len(values[r])):
          heapq.heappush(heap, (-values[r][take[r]], r))
      if gain <= 0 and plain is not None:
        continue
      rate = (live + gain) / self.time(shape)
      if best is None or rate > best[2]:
        best = (shape, take, rate)
    return best
