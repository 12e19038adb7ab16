"""One call for the trainer: this shard's requests of a step, and the order to admit them.

  plan = plan_step(requests, predictor, step=k, num_shards=D, policy="history")
  mine = plan.requests_for(shard)          # what this host/shard generates
  engine.generate(mine, admission=plan.admission(shard))

Every host calls it with the same requests in the same order and the same history, and gets
the same plan (see `assignment`); the order changes when a request runs, never what it samples.

`SCHEDULES` is the trainer's `--schedule` choice list (rhyme_jax/config.py mirrors its keys):
each name maps to the admission policy it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

from rhyme_jax.scheduling.admission import (AdmissionPolicy, RequestMeta, make_policy,
                                            metas_from_requests)
from rhyme_jax.scheduling.assignment import plan_shards
from rhyme_jax.scheduling.engine_order import EngineOrder
from rhyme_jax.scheduling.predictor import LengthPredictor

SCHEDULES = {
    "fifo": "fifo",  # arrival (data) order
    "history": "history",  # longest predicted first (HistoPipe's in-step order)
    "alternate": "history_alt",  # long->short on even steps, short->long on odd (HistoPipe)
    "probe": "history_probe",  # Seer probe-first, probes ordered by history where it exists
    "residual": "history_residual",  # longest expected remaining work first (divided rollout)
}


@dataclasses.dataclass
class StepPlan:
  """Shard per group and each shard's requests in their opening admission order."""

  shard_of_group: dict[Hashable, int]
  ordered: list[list]  # per shard: the requests, in the policy's opening order
  policies: list[AdmissionPolicy]  # per shard; online ones re-rank as siblings finish
  metas: dict[int, RequestMeta] = dataclasses.field(default_factory=dict)  # by request id

  def _check(self, shard: int, where: str) -> None:
    if not 0 <= shard < len(self.ordered):
      raise ValueError(f"StepPlan.{where}: shard {shard} of {len(self.ordered)}")

  def requests_for(self, shard: int) -> list:
    self._check(shard, "requests_for")
    return list(self.ordered[shard])

  def admission(self, shard: int) -> EngineOrder:
    """The engine's `AdmissionOrder` for this shard (data-order ties as in the plan)."""
    self._check(shard, "admission")
    return EngineOrder(self.policies[shard], self.metas)


def plan_step(requests: Sequence, predictor: LengthPredictor | None, *, step: int = 0,
              num_shards: int = 1, policy: str = "history", seed: int = 0,
              kv_budget: int | None = None) -> StepPlan:
  """Groups to shards by LPT over predicted work (round-robin in data order without a
  predictor), then each shard's requests in `policy`'s order (see `admission.POLICIES`;
  "history_alt" alternates long-first / short-first by step parity; `kv_budget` caps
  "history_residual"'s started-and-unfinished requests per shard)."""
  metas = metas_from_requests(requests)
  if predictor is not None:
    shard_of = plan_shards(metas, predictor, num_shards)
  else:
    groups = list(dict.fromkeys(m.group_id for m in metas))
    shard_of = {g: i % num_shards for i, g in enumerate(groups)}
  by_id = {m.request_id: r for m, r in zip(metas, requests)}
  ordered, policies = [], []
  for shard in range(num_shards):
    pol = make_policy(policy, predictor=predictor, step=step, seed=seed, kv_budget=kv_budget)
    mine = [m for m in metas if shard_of[m.group_id] == shard]
    ordered.append([by_id[m.request_id] for m in pol.order(mine)])
    policies.append(pol)
  return StepPlan(shard_of, ordered, policies, {m.request_id: m for m in metas})
