"""One call for the trainer: this shard's requests of a step, in admission order.

  plan = plan_step(requests, predictor, step=k, num_shards=D, policy="history")
  mine = plan.requests_for(shard)          # what this host/shard generates, in admission order
  engine.generate(mine)                    # or hand plan.policies[shard] to the engine

Every host calls it with the same requests in the same order and the same history, and gets
the same plan (see `assignment`); the order changes when a request runs, never what it samples.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

from rhyme_jax.scheduling.admission import AdmissionPolicy, make_policy, metas_from_requests
from rhyme_jax.scheduling.assignment import plan_shards
from rhyme_jax.scheduling.predictor import LengthPredictor


@dataclasses.dataclass
class StepPlan:
  """Shard per group and each shard's requests in their opening admission order."""

  shard_of_group: dict[Hashable, int]
  ordered: list[list]  # per shard: the requests, in the policy's opening order
  policies: list[AdmissionPolicy]  # per shard; online ones re-rank as siblings finish

  def requests_for(self, shard: int) -> list:
    if not 0 <= shard < len(self.ordered):
      raise ValueError(f"StepPlan.requests_for: shard {shard} of {len(self.ordered)}")
    return list(self.ordered[shard])


def plan_step(requests: Sequence, predictor: LengthPredictor | None, *, step: int = 0,
              num_shards: int = 1, policy: str = "history", seed: int = 0) -> StepPlan:
  """Groups to shards by LPT over predicted work (round-robin in data order without a
  predictor), then each shard's requests in `policy`'s order (see `admission.POLICIES`;
  "history_alt" alternates long-first / short-first by step parity)."""
  metas = metas_from_requests(requests)
  if predictor is not None:
    shard_of = plan_shards(metas, predictor, num_shards)
  else:
    groups = list(dict.fromkeys(m.group_id for m in metas))
    shard_of = {g: i % num_shards for i, g in enumerate(groups)}
  by_id = {m.request_id: r for m, r in zip(metas, requests)}
  ordered, policies = [], []
  for shard in range(num_shards):
    pol = make_policy(policy, predictor=predictor, step=step, seed=seed)
    mine = [m for m in metas if shard_of[m.group_id] == shard]
    ordered.append([by_id[m.request_id] for m in pol.order(mine)])
    policies.append(pol)
  return StepPlan(shard_of, ordered, policies)
