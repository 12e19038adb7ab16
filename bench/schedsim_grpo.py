"""A GRPO run's recorded rollouts as simulator cases: one case per training step, history as the
trainer had it.

`bench/schedsim.py --trace grpo:RUN_DIR/rollouts` (or a directory path) reads the files a run's
`--record_rollouts` writes (`e{data_epoch}_s{step:06d}_r{round}_p{proc}.npz`, the
`history.recording.Recording` format). Each (step, round) is one `engine.generate` call in the
trainer (`rl/rollouts.py: sample_round`), so each becomes one simulated rollout (`StepCase`);
the recordings of several processes of one round are merged into that rollout.

The predictor of a case sees exactly what the trainer's history store held when it planned the
round: every earlier (step, round)'s lengths, added in step order to a `LengthTable` that keeps
the newest `epochs_kept` epochs per prompt (the store's default is 1). A prompt appears once per
data epoch, so the step's own prompts are predicted from their earlier data epochs only, and
nothing recorded at or after the step enters (tests/scheduling/test_schedsim_grpo.py checks it).

Aggregation over steps (`aggregate`): a run's rollout time is the sum of its steps' makespans,
so per policy the makespans and tail times are summed and slot utilisation is weighted by
makespan; ratios to the oracle and the tail cut vs FIFO are taken on those sums.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
from typing import Sequence

import numpy as np

from rhyme_jax.history.recording import Recording
from rhyme_jax.scheduling.admission import RequestMeta
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable


@dataclasses.dataclass
class StepCase:
  """One simulated rollout: its requests (true lengths) and the history-backed predictor."""

  name: str
  step: int
  epoch: int
  jobs: list  # [(RequestMeta, true length)]
  predictor: LengthPredictor
  table: LengthTable  # what the predictor reads (kept for tests and notes)

  @property
  def truth(self) -> dict[int, int]:
    return {m.request_id: n for m, n in self.jobs}

  @property
  def group_mean(self) -> dict:
    per = collections.defaultdict(list)
    for m, n in self.jobs:
      per[m.group_id].append(n)
    return {g: float(np.mean(v)) for g, v in per.items()}

  @property
  def lengths(self) -> np.ndarray:
    return np.array([n for _, n in self.jobs], np.int64)


def is_grpo_dir(spec: str) -> bool:
  return spec.startswith("grpo:") or os.path.isdir(spec)


def load_rounds(directory: str) -> list[tuple[int, int, int, list[Recording]]]:
  """[(step, round, data epoch, recordings of its processes)] in step order."""
  paths = glob.glob(os.path.join(directory, "e*_s*_r*_p*.npz"))
  if not paths:
    raise ValueError(f"--trace grpo:{directory}: no e*_s*_r*_p*.npz recordings")
  by_round: dict = collections.defaultdict(list)
  for path in paths:
    rec = Recording.load(path)
    by_round[(int(rec.meta["step"]), int(rec.meta.get("round", 0)))].append(
        (int(rec.meta.get("process", 0)), rec))
  out = []
  for (step, rnd), recs in sorted(by_round.items()):
    recs = [r for _, r in sorted(recs, key=lambda pr: pr[0])]
    epochs = {r.epoch for r in recs}
    if len(epochs) != 1:
      raise ValueError(f"{directory}: step {step} round {rnd} spans data epochs {epochs}")
    out.append((step, rnd, epochs.pop(), recs))
  return out


def _groups(recs: Sequence[Recording]) -> list[tuple[str, int, np.ndarray]]:
  """[(prompt key, prompt length, int64[G] lengths)] of a round, processes in order."""
  out = []
  for rec in recs:
    lengths = np.array([len(r) for r in rec.responses], np.int64)
    for p, key in enumerate(rec.prompt_keys):
      out.append((key, len(rec.prompts[p]), lengths[rec.prompt_index == p]))
  return out


def grpo_cases(directory: str, epochs_kept: int = 1, stat: str = "mean",
               max_new_tokens: int | None = None, min_epoch: int = 1) -> list[StepCase]:
  """One `StepCase` per (step, round) of data epoch >= `min_epoch` (earlier steps only feed
  the history: in the first data epoch no prompt has any). `max_new_tokens` defaults to the
  run's (recording meta)."""
  rounds = load_rounds(directory)
  table = LengthTable(epochs_kept)
  cases = []
  for step, rnd, epoch, recs in rounds:
    groups = _groups(recs)
    if epoch >= min_epoch:
      snapshot = LengthTable(epochs_kept)  # frozen copy: later adds must not reach this case
      for key in table.keys():
        for e, lens in table.epoch_lengths(key):
          snapshot.add(key, e, lens)
      cap = int(max_new_tokens or recs[0].meta.get("max_new_tokens", 0))
      jobs = []
      for g, (key, plen, lens) in enumerate(groups):
        for n in lens:
          rid = len(jobs)
          jobs.append((RequestMeta(rid, g, key, rid, cap, plen), max(int(n), 1)))
      cases.append(StepCase(f"s{step}r{rnd}", step, epoch, jobs,
                            LengthPredictor(snapshot, stat), snapshot))
    for key, _, lens in groups:  # the store records the round after it ran
      table.add(key, epoch, lens)
  return cases


def rank_correlation(cases: Sequence[StepCase]) -> float:
  """Spearman, over every (case, prompt), of the predicted length and the true group mean."""
  pred, true = [], []
  for c in cases:
    for g, mean in c.group_mean.items():
      key = next(m.prompt_key for m, _ in c.jobs if m.group_id == g)
      pred.append(c.predictor.predict(key).length)
      true.append(mean)
  rx, ry = np.argsort(np.argsort(pred)), np.argsort(np.argsort(true))
  return float(np.corrcoef(rx, ry)[0, 1])


@dataclasses.dataclass
class Aggregate:
  """Per policy over a run's steps: what `simulate.SimResult` reports of one step, summed."""

  makespan_ms: float
  tail_ms: float
  utilisation: float  # makespan-weighted
  steps: int
  peak_started: int  # the largest step's (requests started and unfinished at once)
  yields: int = 0  # divided rollout: slots given up, all steps
  yield_passes: int = 0  # steps that gave up at least one slot (one copy call each way)


def aggregate(results: Sequence) -> Aggregate:
  """Sums `SimResult`s (one per step) as a run's rollout time sums its steps'."""
  span = sum(r.makespan_ms for r in results)
  return Aggregate(span, sum(r.tail_ms for r in results),
                   sum(r.utilisation * r.makespan_ms for r in results) / max(span, 1e-12),
                   sum(r.steps for r in results), max(r.peak_started for r in results),
                   sum(r.yields for r in results),
                   sum(r.yield_passes for r in results))
