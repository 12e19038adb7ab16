"""Speculation and learning per data epoch: how acceptance moves as the policy sharpens.

HistoSpec drafts from the previous visit of each prompt, so its acceptance is a property of a
data epoch (every prompt visited once), not of a step: a step sees a few prompts, an epoch sees
them all against the same kind of history. `EpochStats` sums each step's rollout counters into
the current data epoch and reports the epoch so far under `epoch/*` at every step; the last
step of an epoch carries the whole epoch's figures (`bench/acceptance_epochs.py` reads them).
Its sums live in the checkpoint's host state, so a resumed run reports the same figures as one
that never stopped.

  epoch/index            data epoch of the step (the highest among its groups)
  epoch/accepted_length  tokens per slot-verify over the epoch (bonus included; 1.0 = no gain)
  epoch/hit_rate         accepted draft nodes / verified draft nodes
  epoch/drafted_per_step verified draft nodes per slot-verify
  epoch/spec_step_frac   share of decode steps that were speculative (the cost model's choice)
  epoch/asked_step_frac  share of decode steps that asked for drafts (speculative, or plain
                         after drafting: the pipeline drained for nothing)
  epoch/reward           mean reward of the epoch's samples
  epoch/response_length  mean response length of the epoch's samples
"""

from __future__ import annotations

from typing import Any, Sequence

_SUMS = ("tokens", "useful_slot_steps", "drafted", "accepted", "steps", "spec_steps",
         "asked_steps", "samples", "reward", "length")


class EpochStats:
  """Running sums of the current data epoch; `update` once per step."""

  def __init__(self):
    self.epoch = -1
    self.sums = dict.fromkeys(_SUMS, 0.0)

  def update(self, epoch: int, stats: dict[str, Any], rewards: Sequence[float],
             lengths: Sequence[int]) -> dict[str, float]:
    """Adds one step (its summed engine counters, every sample's reward and length) to data
    epoch `epoch` (a new epoch restarts the sums); returns that epoch's `epoch/*` so far."""
    if epoch != self.epoch:
      self.epoch, self.sums = epoch, dict.fromkeys(_SUMS, 0.0)
    s = self.sums
    for k in ("tokens", "useful_slot_steps", "drafted", "accepted", "steps", "spec_steps",
              "asked_steps"):
      s[k] += float(stats.get(k, 0))
    s["samples"] += len(rewards)
    s["reward"] += float(sum(rewards))
    s["length"] += float(sum(lengths))
    return self.metrics()

  def metrics(self) -> dict[str, float]:
    s = self.sums
    return {"epoch/index": self.epoch,
            "epoch/accepted_length": s["tokens"] / max(s["useful_slot_steps"], 1.0),
            "epoch/hit_rate": s["accepted"] / max(s["drafted"], 1.0),
            "epoch/drafted_per_step": s["drafted"] / max(s["useful_slot_steps"], 1.0),
            "epoch/spec_step_frac": s["spec_steps"] / max(s["steps"], 1.0),
            "epoch/asked_step_frac": s["asked_steps"] / max(s["steps"], 1.0),
            "epoch/reward": s["reward"] / max(s["samples"], 1.0),
            "epoch/response_length": s["length"] / max(s["samples"], 1.0)}

  def state_dict(self) -> dict[str, Any]:
    return {"epoch": self.epoch, "sums": dict(self.sums)}

  def load_state_dict(self, state: dict[str, Any] | None) -> None:
    """Restores the sums (a checkpoint from before they were kept restarts them)."""
    if not state:
      return
    self.epoch = int(state["epoch"])
    self.sums = {k: float(state["sums"].get(k, 0.0)) for k in _SUMS}
