"""Reference orders no real policy can run: what any order could reach on a recorded trace.

They split a policy's distance from the oracle into what it could and could not have known:
- `blind_draws`: any per-prompt order without preemption. A prompt's samples are
  indistinguishable before they run, so it sees the trace with each group's lengths shuffled.
- `divided_bounds`: divided rollout (preemption every chunk tokens) with four references
  against history_residual:
  - pooled history: the same residual rule over the step's prompts' kept lengths pooled into
    one distribution, the same for every prompt. It knows the length distribution and each
    request's tokens so far, not which prompt runs long: what the per-prompt history adds.
  - rescaled history: the history times one factor per step, the step's true mean length over
    its prompts' kept mean. It knows how far the whole length distribution drifted since the
    history was recorded, not how each prompt moved.
  - own lengths: the same residual rule over the step's own lengths per prompt, not the
    previous epoch's. It knows each prompt's true length distribution (no drift between
    epochs) but not which sample is which.
  - clairvoyant: each request's true remaining length, LRPT (longest remaining first).

Each reference is run by `scheduling.simulate` on the trace's cases, as the policies are.
"""

from __future__ import annotations

import collections

import numpy as np

from bench.schedsim_grpo import StepCase
from rhyme_jax.scheduling.admission import (RESIDUAL_QUANTILE, ResidualPolicy, StaticPolicy,
                                            make_policy)
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable
from rhyme_jax.scheduling.simulate import simulate


def shuffled_within_groups(jobs: list, rng: np.random.Generator) -> list:
  """`jobs` ([(RequestMeta, true length)]) with each group's lengths permuted among its
  samples: another draw of the same rollout, since a prompt's samples are exchangeable before
  they run."""
  by_group = collections.defaultdict(list)
  for i, (m, _) in enumerate(jobs):
    by_group[m.group_id].append(i)
  lengths = [n for _, n in jobs]
  for idx in by_group.values():
    for i, n in zip(idx, rng.permutation([lengths[i] for i in idx])):
      lengths[i] = int(n)
  return [(m, n) for (m, _), n in zip(jobs, lengths)]


def blind_draws(cases: list[StepCase], table, cfg, draws: int, seed: int) -> np.ndarray:
  """What an order that cannot tell one prompt's samples apart can reach on this trace.

  A prompt's G samples are exchangeable before they run, so any per-prompt order (history,
  probe-free) sees the same trace with each group's true lengths shuffled among its samples.
  Per draw, summed over the cases (steps): (makespan / oracle, tail cut vs FIFO, decode steps
  of the per-prompt order), for the order by the step's true group means (the best per-prompt
  knowledge), longest first. float64[draws, 3].
  """
  rng = np.random.default_rng(seed)
  out = np.zeros((draws, 3))
  for d in range(draws):
    sums = np.zeros(5)  # group makespan, oracle makespan, group tail, fifo tail, group steps
    for case in cases:
      shuffled = shuffled_within_groups(case.jobs, rng)
      truth = {m.request_id: n for m, n in shuffled}
      score = case.group_mean
      oracle = simulate(shuffled, lambda: make_policy("oracle", true_lengths=truth), table, cfg)
      fifo = simulate(shuffled, lambda: make_policy("fifo"), table, cfg)
      grp = simulate(shuffled, lambda: StaticPolicy("group", lambda m: score[m.group_id]),
                     table, cfg)
      sums += (grp.makespan_ms, oracle.makespan_ms, grp.tail_ms, fifo.tail_ms, grp.steps)
    out[d] = (sums[0] / sums[1], 1 - sums[2] / sums[3] if sums[3] > 0 else 0.0, sums[4])
  return out


class ClairvoyantResidual(ResidualPolicy):
  """`ResidualPolicy` told each request's true remaining length: LRPT with a chunk-long
  quantum, under the same yield margin as history_residual."""

  name = "clairvoyant_residual"

  def __init__(self, true_lengths, yield_cost: float = 0.0):
    super().__init__(predictor=None, yield_cost=yield_cost, quantile=None)
    self.true_lengths = true_lengths

  def estimate(self, meta, generated: int) -> tuple[float, float]:
    left = float(max(self.true_lengths[meta.request_id] - generated, 0))
    return left, left


def rescaled_predictor(case: StepCase) -> LengthPredictor:
  """A predictor over `case.table`'s history with every kept length times one factor: the
  step's true mean length over the mean of its prompts' kept lengths (rounded, at least 1)."""
  keys = {m.prompt_key for m, _ in case.jobs}
  kept = [l for k in keys for _, l in case.table.epoch_lengths(k)]
  scale = case.lengths.mean() / np.concatenate(kept).mean() if kept else 1.0
  table = LengthTable(epochs_kept=case.table.epochs_kept)
  for key in case.table.keys():
    for epoch, lengths in case.table.epoch_lengths(key):
      table.add(key, epoch, np.maximum(np.round(lengths * scale), 1).astype(np.int64))
  return LengthPredictor(table, stat=case.predictor.stat)


def pooled_predictor(case: StepCase) -> LengthPredictor:
  """A predictor whose history gives every prompt of the step the same lengths: all the
  step's prompts' kept lengths together (a prompt without history adds none)."""
  keys = sorted({m.prompt_key for m, _ in case.jobs})
  kept = [l for k in keys for _, l in case.table.epoch_lengths(k)]
  table = LengthTable(epochs_kept=1)
  if kept:
    pooled = np.concatenate(kept)
    for key in keys:
      table.add(key, case.epoch - 1, pooled)
  return LengthPredictor(table, stat=case.predictor.stat)


def own_lengths_predictor(case: StepCase) -> LengthPredictor:
  """A predictor whose history is the step's own lengths per prompt (one epoch)."""
  table = LengthTable(epochs_kept=1)
  per_prompt = collections.defaultdict(list)
  for m, n in case.jobs:
    per_prompt[m.prompt_key].append(n)
  for key, lengths in per_prompt.items():
    table.add(key, case.epoch, lengths)
  return LengthPredictor(table)


BOUNDS = ("history_residual", "pooled_history", "rescaled_history", "own_lengths",
          "clairvoyant")


def divided_bounds(cases: list[StepCase], table, cfg, yield_cost: float,
                   residual_quantile: float | None = RESIDUAL_QUANTILE,
                   known: dict | None = None) -> dict:
  """{name: (makespan / oracle, tail cut vs FIFO)} summed over the cases, for history_residual
  and the three references (`BOUNDS`) under `cfg`'s divided rollout; the oracle and FIFO are
  the same non-preemptive orders as in the policy tables; every residual rule ranks by
  `residual_quantile` (None: the mean). `known`: {name: (makespan ms, tail ms)} summed over
  the cases for any of history_residual / oracle / fifo the caller already simulated under
  `cfg` (not run again)."""
  known = known or {}
  sums = collections.Counter()
  for name, (makespan, tail) in known.items():
    sums[name, "makespan"], sums[name, "tail"] = makespan, tail
  residual = lambda predictor: make_policy("history_residual", predictor=predictor,
                                           yield_cost=yield_cost,
                                           residual_quantile=residual_quantile)
  for case in cases:
    truth = case.truth
    own, rescaled = own_lengths_predictor(case), rescaled_predictor(case)
    pooled = pooled_predictor(case)
    factories = {
        "history_residual": lambda: residual(case.predictor),
        "pooled_history": lambda: residual(pooled),
        "rescaled_history": lambda: residual(rescaled),
        "own_lengths": lambda: residual(own),
        "clairvoyant": lambda: ClairvoyantResidual(truth, yield_cost),
        "oracle": lambda: make_policy("oracle", true_lengths=truth),
        "fifo": lambda: make_policy("fifo"),
    }
    for name, factory in factories.items():
      if name in known:
        continue
      res = simulate(case.jobs, factory, table, cfg)
      sums[name, "makespan"] += res.makespan_ms
      sums[name, "tail"] += res.tail_ms
  cut = lambda n: 1 - sums[n, "tail"] / sums["fifo", "tail"] if sums["fifo", "tail"] else 0.0
  return {n: (sums[n, "makespan"] / sums["oracle", "makespan"], cut(n)) for n in BOUNDS}
