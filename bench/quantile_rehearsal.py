"""Can a run choose history_residual's quantile per step by rehearsing its own history?

history_residual (divided rollout's order) ranks a request's remaining work by a quantile of
its prompt's history residual life (`ResidualPolicy`, default 0.75). Which quantile is best
depends on the trace: on the CPU engine's 32-slot run 0.9 cut the tail by 91% wall-clock where
0.75 cut 69%, while on the quickstart GRPO trace 0.9 was worse (bench/RESULTS.md,
2026-11-28). A run could choose it itself, the same on every host, from what it already
holds: before a step, replay the step's requests with the lengths its prompts' newest kept
epoch recorded (the rehearsal, predicted from that same history) under each candidate
quantile, and run the step with the quantile whose rehearsal did best (`--select`: least
makespan, then tail; or least tail, then makespan).

This bench measures that rule against each fixed quantile on recorded traces, in the
simulator's divided-rollout scenarios on one shard with the KV kept (bench/schedsim.py's
rows: the h100 and cpu tables, one step per launch and the engine's launch shapes), and
prints makespan / oracle and the tail cut vs FIFO per quantile and for the rule, with the
quantiles it picked. A step whose prompts have no history rehearses nothing and runs the
default quantile.

  python bench/quantile_rehearsal.py --trace grpo:bench/data/grpo_quickstart \
      --max_new_tokens 80 --chunk 4
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, schedsim_divided  # noqa: E402
from bench.schedsim_grpo import StepCase  # noqa: E402
from rhyme_jax.scheduling.admission import RESIDUAL_QUANTILE, make_policy  # noqa: E402
from rhyme_jax.scheduling.simulate import simulate  # noqa: E402

SELECTORS = {"makespan": lambda r: (r.makespan_ms, r.tail_ms),
             "tail": lambda r: (r.tail_ms, r.makespan_ms)}


def rehearsal_jobs(case: StepCase) -> list | None:
  """The step's requests with the lengths their prompt's newest kept epoch recorded (a
  prompt's i-th sample gets that epoch's i-th length, cycling if the group grew); None when a
  prompt has no history (nothing to rehearse)."""
  by_prompt = collections.defaultdict(list)
  for m, _ in case.jobs:
    by_prompt[m.prompt_key].append(m)
  jobs = []
  for key, metas in by_prompt.items():
    kept = case.table.epoch_lengths(key)
    if not kept:
      return None
    lengths = kept[-1][1]
    jobs += [(m, max(int(lengths[i % len(lengths)]), 1)) for i, m in enumerate(metas)]
  return sorted(jobs, key=lambda job: job[0].index)


def pick_quantile(case: StepCase, candidates, simulate_with, select: str) -> float:
  """The candidate whose rehearsal of `case` scores best by `select` (ties: the one nearest
  the default); the default when there is nothing to rehearse. `simulate_with(jobs, q)`
  runs history_residual at quantile q over `jobs` with `case`'s predictor."""
  jobs = rehearsal_jobs(case)
  if jobs is None:
    return RESIDUAL_QUANTILE
  score = {q: SELECTORS[select](simulate_with(jobs, q)) for q in candidates}
  return min(candidates, key=lambda q: (score[q], abs(q - RESIDUAL_QUANTILE)))


def run(args) -> tuple[list[list], list[str]]:
  rows, notes = [], []
  for replay in schedsim_divided.runs(args, notes):
    table, cfg, yield_cost = replay.table, replay.config, replay.yield_cost
    sums, picks = collections.Counter(), {s: collections.Counter() for s in args.select}
    for case in replay.cases:
      def residual(jobs, q, case=case):
        return simulate(jobs, lambda: make_policy(
            "history_residual", predictor=case.predictor, yield_cost=yield_cost,
            residual_quantile=q), table, cfg)
      truth = case.truth
      for ref, factory in (("fifo", lambda: make_policy("fifo")),
                           ("oracle", lambda: make_policy("oracle", true_lengths=truth))):
        res = simulate(case.jobs, factory, table, cfg)
        sums[ref, "makespan"] += res.makespan_ms
        sums[ref, "tail"] += res.tail_ms
      step = {q: residual(case.jobs, q) for q in args.quantiles}
      for q, res in step.items():
        sums[q, "makespan"] += res.makespan_ms
        sums[q, "tail"] += res.tail_ms
      for s in args.select:
        q = pick_quantile(case, args.quantiles, residual, s)
        picks[s][q] += 1
        res = step[q] if q in step else residual(case.jobs, q)
        sums[s, "makespan"] += res.makespan_ms
        sums[s, "tail"] += res.tail_ms
    ratio = lambda k: f"{sums[k, 'makespan'] / sums['oracle', 'makespan']:.3f}"
    cut = lambda k: (f"{100 * (1 - sums[k, 'tail'] / sums['fifo', 'tail']):.0f}%"
                     if sums["fifo", "tail"] else "-")
    keys = [*args.quantiles, *args.select]
    rows.append(replay.label() + [f"{ratio(k)}, {cut(k)}" for k in keys]
                + ["; ".join(f"{s}: " + " ".join(f"{q:g}x{n}" for q, n in sorted(c.items()))
                             for s, c in picks.items())])
  return rows, notes


def _quantiles(text: str) -> tuple[float, ...]:
  try:
    qs = tuple(float(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected numbers in (0, 1), comma-separated"
                                     ) from None
  if not qs or not all(0 < q < 1 for q in qs):
    raise argparse.ArgumentTypeError(f"{text!r}: every quantile must be in (0, 1)")
  return qs


def _selectors(text: str) -> tuple[str, ...]:
  names = tuple(text.split(","))
  bad = [n for n in names if n not in SELECTORS]
  if bad:
    raise argparse.ArgumentTypeError(f"{text!r}: unknown {bad}; choose from {sorted(SELECTORS)}")
  return names


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  schedsim_divided.add_args(ap)
  ap.add_argument("--quantiles", type=_quantiles, default=(0.5, 0.75, 0.9),
                  help="the candidate quantiles, comma-separated")
  ap.add_argument("--select", type=_selectors, default=tuple(SELECTORS),
                  help="how a rehearsal is scored: makespan, tail (comma-separated)")
  args = schedsim_divided.complete(ap.parse_args(argv))
  rows, notes = run(args)
  table = common.markdown_table(
      schedsim_divided.LABEL_HEADER
      + [f"q {q:g}: makespan / oracle, tail cut" for q in args.quantiles]
      + [f"rehearsed ({s})" for s in args.select] + ["quantiles picked (x steps)"], rows)
  schedsim_divided.report(
      args, "Residual quantile chosen per step by rehearsal (bench/quantile_rehearsal.py)",
      table, notes,
      ["simulated, not run (rhyme_jax/scheduling/simulate.py, bench/schedsim.py's step-time "
       "tables and yield costs): history_residual with divided rollout, KV kept, one shard; "
       "makespan / oracle and tail cut vs FIFO summed over the trace's steps",
       "rehearsed (makespan / tail): each step runs the candidate quantile whose replay of "
       "the step's requests at their prompts' newest kept lengths, predicted from that same "
       "history, had the least makespan (then tail) / tail (then makespan)"])


if __name__ == "__main__":
  main()
