"""A scheduling policy as the rollout engine's admission order.

The engine speaks `Request`s (rollout/interface.py's `AdmissionOrder`); policies speak
`RequestMeta` (admission.py). `EngineOrder` translates between them, so the engine never
imports scheduling and a policy never sees tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from rhyme_jax.rollout.interface import yield_rule
from rhyme_jax.scheduling.admission import AdmissionPolicy, RequestMeta


class EngineOrder:
  """An `AdmissionPolicy` as the rollout engine's `AdmissionOrder` (which speaks `Request`s):

    engine.generate(requests, admission=EngineOrder(make_policy("history", predictor=p)))

  `metas` ({request_id: RequestMeta}) keeps the data-order indices of a plan made over more
  requests than this engine gets; by default a request's index is its position in `order`'s
  input. Static policies sort the queue once and then admit from its front.
  """

  def __init__(self, policy: AdmissionPolicy, metas: Mapping[int, RequestMeta] | None = None):
    self.policy = policy
    self._metas = dict(metas) if metas is not None else None
    self._current: dict[int, RequestMeta] = {}

  @property
  def online(self) -> bool:
    """Whether the engine may ask about running requests (divided rollout)."""
    return self.policy.online

  @property
  def stable_rule(self) -> bool:
    """Whether the engine may keep the yield rule across passes (`interface.AdmissionOrder`)."""
    return bool(getattr(self.policy, "stable_rule", False))

  def set_yield_cost(self, steps: float) -> None:
    """Hands the engine's measured cost of a yield (decode steps) to a policy that weighs it."""
    if hasattr(self.policy, "set_yield_cost"):
      self.policy.set_yield_cost(steps)

  def yield_rule(self, queue: Sequence, finished: Mapping[int, int], live: Mapping[int, int],
                 chunk: int, free: int = 0) -> Callable[[Any], bool]:
    """Whether a running request should give its slot to a queued one (divided rollout), for
    the running requests of one pass (`queue` unchanged): the policy's rule
    (`rollout.interface.yield_rule`) over the requests' metadata, the queue's looked up once."""
    rule = yield_rule(self.policy, [self._current[r.request_id] for r in queue], finished, live,
                      chunk, free)
    return lambda running: rule(self._current[running.request_id])

  def should_yield(self, queue: Sequence, running, finished: Mapping[int, int],
                   live: Mapping[int, int], chunk: int) -> bool:
    """`yield_rule` for one running request."""
    return self.yield_rule(queue, finished, live, chunk)(running)

  def order(self, requests: Sequence) -> list:
    metas = [self._metas[r.request_id] if self._metas is not None
             else RequestMeta.from_request(r, i) for i, r in enumerate(requests)]
    self._current = {m.request_id: m for m in metas}
    by_id = {r.request_id: r for r in requests}
    return [by_id[m.request_id] for m in self.policy.order(metas)]

  def next_to_admit(self, queue: Sequence, finished: Mapping[int, int],
                    live: Mapping[int, int]) -> int:
    if not self.policy.online:
      return 0
    return self.policy.next_to_admit([self._current[r.request_id] for r in queue], finished,
                                     live)
