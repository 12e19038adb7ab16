"""The engine's cost model: what a step of each compiled shape costs, what drafts are worth.

Step times per shape (bucket B, packed size P, tokens per row T, cache bucket S) are measured
at warm-up and refined online with an exponential moving average of what each step really costs
the rollout (the engine times completion to completion: device time, host sync, drafting and
bookkeeping, and the idle device while the host drafts). The machine's speed drifts (other jobs,
clocks): plain steps, observed every few steps, measure it against their warm-up times, and a
shape last observed at another speed (a speculative shape seldom chosen, say) is rescaled by the
drift since, so a stale estimate neither hides nor flatters speculation. Each request's
acceptance rate is estimated from its own history with a prior from all requests.

A drafter's path probabilities are calibrated per tree depth. Counts of past epochs and of
siblings are confident (a path all siblings took gets probability 1 at every depth) while
sampling leaves them more often the deeper the path goes: on SmolLM2 GSM8K history drafts,
rows offered under 2 units of probability accepted ~60% of it, rows offered 8 accepted ~20%.
One scale factor for all depths therefore over-values deep chains. So, over all requests
(decayed), accepted nodes at depth d over the probability offered at depth d scale a node of
depth d; each request's own accepted tokens over what that predicted for it (shrunk toward 1)
scale its nodes once more. A step then verifies the nodes, and picks the shape, with the most
expected tokens per second; when no shape beats the plain step, the step is plain.

Choosing by estimates favours the rows and steps whose estimates are high by chance (the
winner's curse): on SmolLM2 GSM8K history drafts the chosen steps accepted ~20% fewer tokens
than the estimates they were chosen for. So the gains of a choice are scaled by what chosen
steps accepted over what they were expected to (all requests, decayed; prior 1).

Whether to ask for drafts at all is decided before they exist (asking costs the pipelined
step: the host must read the previous step first), from chains at each request's acceptance.
Drafts the choice then finds not worth verifying teach the acceptance estimate nothing, so
without a check the engine could ask, drain the pipeline and step plain, step after step (on
the 2-core CPU, history drafts at T=1.0 lost up to 26% that way). So the asking decision is
calibrated end to end: the tokens asked steps accepted over the gain the decision expected
(decayed, prior 1) scale its estimates; steps not asked decay that evidence slowly, so a
drafter that improves is asked again now and then.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable, Sequence

import numpy as np

Shape = tuple  # (bucket, packed P, tokens per row T, cache bucket S)
_DECAY = 0.99  # per observation, of the counts shared by all requests
_IDLE_DECAY = 0.995  # per step not asked for drafts, of the asking decision's evidence


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
    self.accepted = _DECAY * self.accepted + accepted
    self.tried = _DECAY * self.tried + tried


@dataclasses.dataclass
class _DepthCalibration:
  """Accepted draft nodes per unit of drafter probability offered, per tree depth.

  Depth d's ratio over all requests (decayed) is shrunk toward depth d - 1's (depth 1's toward
  0.5), so a depth seldom verified borrows from the one above it. A request's own factor is its
  accepted nodes over the nodes those ratios predicted for it, shrunk toward 1.
  """

  prior_strength: float
  accepted_D: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
  offered_D: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
  own: dict = dataclasses.field(default_factory=dict)  # request id -> [accepted, predicted]
  _ratios: np.ndarray | None = None  # ratios() as of the last add (read per row and step)

  def ratios(self, depth: int) -> np.ndarray:
    """Shared ratio of depths 1..depth."""
    if self._ratios is None or len(self._ratios) < depth:
      out, prev = np.empty(max(depth, len(self.offered_D))), 0.5
      for d in range(len(out)):
        a, o = (self.accepted_D[d], self.offered_D[d]) if d < len(self.offered_D) else (0, 0)
        prev = out[d] = (a + prev) / (o + 1.0)  # prior: one unit of probability at the ratio above
      self._ratios = out
    return self._ratios[:depth]

  def factor(self, request_id: Hashable) -> float:
    a, e = self.own.get(request_id, (0.0, 0.0))
    return (a + self.prior_strength) / (e + self.prior_strength)

  def add(self, request_id: Hashable, accepted: int, offered_D: np.ndarray) -> None:
    depth = len(offered_D)
    predicted = float(offered_D @ self.ratios(depth))
    own = self.own.setdefault(request_id, [0.0, 0.0])
    own[0] += accepted
    own[1] += predicted
    if depth > len(self.offered_D):
      self.accepted_D = np.pad(self.accepted_D, (0, depth - len(self.accepted_D)))
      self.offered_D = np.pad(self.offered_D, (0, depth - len(self.offered_D)))
    self.accepted_D *= _DECAY
    self.offered_D *= _DECAY
    self.accepted_D[:min(accepted, depth)] += 1.0  # one node accepted at each depth reached
    self.offered_D[:depth] += offered_D
    self._ratios = None


class CostModel:
  """Step times per shape and per-request acceptance, and the choice they imply."""

  def __init__(self, ema: float = 0.25, prior_strength: float = 4.0):
    self.ema = ema
    self.prior_strength = prior_strength
    self.seconds: dict[Shape, float] = {}  # per shape: EMA of its observed step times
    self.warm: dict[Shape, float] = {}  # per shape: its warm-up time
    # The machine's speed now against warm-up (observed / warm-up time of plain steps, EMA),
    # and what it was when each shape was last observed.
    self.speed = 1.0
    self._speed_at: dict[Shape, float] = {}
    # Accepted draft nodes over depth levels tested (accepted + the one that failed, if any).
    self._alpha = _Ratio(prior_strength)
    # Accepted draft nodes per unit of (uncalibrated) drafter probability verified, per depth.
    self._cal = _DepthCalibration(prior_strength)
    # Accepted draft nodes of chosen steps over the gains expected of them (decayed).
    self._realised = [prior_strength, prior_strength]
    # Accepted draft nodes of steps that asked for drafts over the gains the asking decision
    # expected (decayed evidence; the prior is added in `ask_scale`).
    self._asked = [0.0, 0.0]

  # ---- step times --------------------------------------------------------------------------

  def observe_time(self, shape: Shape, seconds: float, warmup: bool = False) -> None:
    old = self._time(shape) if shape in self.seconds else None  # at today's speed
    if warmup:
      self.warm[shape] = seconds
    elif shape[2] == 1 and shape in self.warm:  # a plain step: how fast the machine is now
      self.speed = (1 - self.ema) * self.speed + self.ema * seconds / self.warm[shape]
    self.seconds[shape] = seconds if old is None or warmup else (
        (1 - self.ema) * old + self.ema * seconds)
    self._speed_at[shape] = 1.0 if warmup else self.speed

  def time(self, shape: Shape) -> float:
    """Seconds per step of `shape`, never below a measured shape of the same bucket and cache
    length that computes no more (fewer positions): noise must not make a bigger step look
    cheaper. Only measurements at the shape's own cache length count here: another length's
    (a short cache's steps follow prefills, say) may not lift it. Unmeasured shapes scale the
    nearest measured one by P."""
    own = self._time(shape)
    smaller = [self._time(s) for s in self.seconds
               if s[0] == shape[0] and s[3] == shape[3] and s[1] <= shape[1] and s[2] <= shape[2]]
    return max([own] + smaller)

  def _time(self, shape: Shape) -> float:
    if shape in self.seconds:
      return self.seconds[shape] * self.speed / self._speed_at.get(shape, self.speed)
    same = [s for s in self.seconds if s[0] == shape[0]]
    if not same:
      return float(shape[1])  # nothing known: proportional to positions
    s = min(same, key=lambda s: abs(s[1] - shape[1]) + abs(s[3] - shape[3]))
    return self._time(s) * max(shape[1] / s[1], 1.0)

  def bucket_to_run(self, bucket: int, smaller: Sequence[int], s: int, move_s: dict,
                    bubble_s: float, steps_left: float) -> int:
    """Which bucket the live rows should run in: `bucket`, or one of `smaller` (the buckets
    below it that hold them), whichever saves the most time over `steps_left` plain steps at
    cache length `s`, net of the moves. Moving goes one level at a time, each costing
    `move_s[b]` (the regroup out of bucket b; 0 when unmeasured), and drains the pipeline once
    (`bubble_s`: the device idles while the host reads the step in flight and plans the next).
    On a device whose step time hardly depends on the rows (a GPU below a few dozen rows) no
    move pays; where it scales with them (a CPU) the first steps repay it."""
    here = self.time((bucket, bucket, 1, s))
    best, best_net, cost, level = bucket, 0.0, bubble_s, bucket
    for b in sorted(smaller, reverse=True):
      cost += move_s.get(level, 0.0)
      level = b
      net = steps_left * (here - self.time((b, b, 1, s))) - cost
      if net > best_net:
        best, best_net = b, net
    return best

  # ---- acceptance --------------------------------------------------------------------------

  def alpha(self, request_id: Hashable) -> float:
    """Per-level acceptance estimate: the request's own counts over a prior of all requests."""
    return self._alpha.of(request_id, 0.99)

  def calibration(self, request_id: Hashable, depth: int = 1) -> np.ndarray:
    """Accepted nodes per unit of drafter probability offered at depths 1..depth for this
    request (1.0 = the drafter's probabilities are right)."""
    return self._cal.ratios(depth) * self._cal.factor(request_id)

  @property
  def gain_scale(self) -> float:
    """What chosen drafts accepted per token of gain the choice expected of them."""
    return self._realised[0] / self._realised[1]

  @property
  def ask_scale(self) -> float:
    """What steps that asked for drafts accepted per token of gain asking expected of them."""
    k = self.prior_strength
    return (self._asked[0] + k) / (self._asked[1] + k)

  def observe_asked(self, expected: float, accepted: int) -> None:
    """After a step that asked for drafts: the gain the asking decision expected (unscaled) and
    the draft tokens the step accepted over all its rows (0 when it ended plain)."""
    self._asked = [_DECAY * self._asked[0] + accepted, _DECAY * self._asked[1] + expected]

  def not_asked(self) -> None:
    """A step that could have asked for drafts and did not: the evidence ages."""
    self._asked = [_IDLE_DECAY * self._asked[0], _IDLE_DECAY * self._asked[1]]

  def observe_acceptance(self, request_id: Hashable, depth: int, accepted: int,
                         offered_D: np.ndarray | None = None,
                         expected: float | None = None) -> None:
    """After a step that asked for a draft: `depth` of the verified tree (0 when the drafter
    had nothing, which counts as one failed level), `accepted` draft nodes, and `offered_D`,
    the sum of the drafter's probabilities of the verified nodes at each depth 1..depth (None:
    it gave none), and `expected`, the summed `node_values` the choice took the verified nodes
    for. Not called for a row whose drafts the step did not verify: an unverified node has not
    failed."""
    if expected is not None and expected > 0 and depth > 0:
      self._realised = [_DECAY * self._realised[0] + accepted,
                        _DECAY * self._realised[1] + expected]
    self._alpha.add(request_id, accepted, accepted + (1 if accepted < depth or depth <= 0 else 0))
    if offered_D is not None and depth > 0 and float(np.sum(offered_D)) > 0:
      self._cal.add(request_id, accepted, np.asarray(offered_D, np.float64))

  def forget(self, request_id: Hashable) -> None:
    self._alpha.own.pop(request_id, None)
    self._cal.own.pop(request_id, None)

  def node_values(self, request_id: Hashable, depth: np.ndarray,
                  probs: np.ndarray | None) -> np.ndarray:
    """Expected accepted tokens each node adds: the drafter's path probability scaled by the
    request's calibration at the node's depth when given, else alpha ** depth."""
    if probs is not None and len(probs) == len(depth):
      if not len(depth):
        return np.zeros(0)
      scale = self.calibration(request_id, int(depth.max()))[depth - 1]
      return np.clip(probs.astype(np.float64) * scale, 0.0, 1.0)
    return self.alpha(request_id) ** depth.astype(np.float64)

  # ---- the choice --------------------------------------------------------------------------

  def choose(self, plain: Shape | None, shapes: Sequence[Shape], values: Sequence[np.ndarray],
             live: int, scale: float | None = None) -> tuple[Shape, list[int], float]:
    """The shape and per-row node counts with the most expected tokens per second.

    `values[r]` are row r's nodes' expected gains in best-first order (a prefix is a tree),
    scaled here by `scale` (default `gain_scale`); returns (shape, nodes per row, expected
    tokens / s). Plain when nothing pays; with `plain` None the best of `shapes` (forced
    speculation).
    """
    scale = self.gain_scale if scale is None else scale
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
      rate = (live + scale * gain) / self.time(shape)
      if best is None or rate > best[2]:
        best = (shape, take, rate)
    return best
