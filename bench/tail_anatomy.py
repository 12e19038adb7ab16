"""What the last 10% of a rollout's requests are, per order, on recorded traces.

The scheduling target "tail time (the last 10% of requests to finish) cut by >= 75% vs FIFO"
is met on the GSM8K traces and missed on two (bench/RESULTS.md, 2026-11-28): the H200 GRPO
trace at 64 slots, 4 steps per launch, and the quickstart GRPO trace. Where every order's tail
is a launch or two, or the gap between a step's two longest responses, the tail cut says
little about the order. This bench shows what each order's tail is made of, in the
simulator's divided-rollout scenarios on one shard with the KV kept (the rows of
bench/quantile_rehearsal.py), summed over the trace's steps:

  makespan ms         the rollout time (summed over steps), and / oracle (non-preemptive LPT)
  tail ms, cut        the tail on the launch clock (a request ends when its launch ends: what
                      the host sees, and what every other table reports), its cut vs FIFO
  step-clock cut      the same on the step clock (a request ends with the step that computed
                      its last token, `SimResult.step_finish_ms`): the cut without the
                      launch's granularity (equal at one step per launch)
  tail requests       per step, the requests that finished after the first 90% had (fewer
                      than 10% where some ended together with the 90th percentile)
  tail launches       per step, the launches in which those ended (0: all ended together)
  tail at cap         the share of the tail's requests that stopped at the token cap
  over shuffles       with --shuffle_draws K: the tail cut and makespan / oracle (min /
                      median / max) over K redraws of the same rollouts, each group's lengths
                      shuffled among its samples. The samples of a prompt are exchangeable
                      before they run, so which of them the trace made long is one draw of
                      many, and no order could have known it: the spread says how much of a
                      figure is that draw (schedsim_bounds.shuffled_within_groups)

Orders: FIFO, history_residual (the trainer's `--schedule=residual` with divided rollout), the
oracle, and clairvoyant LRPT (each request's true remaining length: bench/schedsim_bounds.py).

  python bench/tail_anatomy.py --trace grpo:bench/data/grpo_gsm8k_h200 --max_new_tokens 256 \
      --chunk 16
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, schedsim_divided  # noqa: E402
from bench.schedsim_bounds import ClairvoyantResidual, shuffled_within_groups  # noqa: E402
from rhyme_jax.scheduling.admission import make_policy  # noqa: E402
from rhyme_jax.scheduling.simulate import SimResult, simulate, tail_start  # noqa: E402

ORDERS = ("fifo", "history_residual", "oracle", "clairvoyant")


def tail_members(finish_ms: np.ndarray) -> np.ndarray:
  """Indices of the requests that finished after the first 90% had: the tail (ties at that
  time excluded, as `tail_time` measures from it: `simulate.tail_start`)."""
  return np.flatnonzero(np.asarray(finish_ms) > tail_start(finish_ms))


def anatomy(res: SimResult, lengths: np.ndarray, caps: np.ndarray) -> tuple[int, int, int]:
  """(launches the tail spans, tail requests, of them at their token cap) of one rollout:
  the distinct launch ends after the one that finished the first 90%."""
  tail = tail_members(res.finish_ms)
  launches = len(np.unique(res.finish_ms[tail]))
  return launches, len(tail), int(np.sum(lengths[tail] >= caps[tail]))


def order_sums(replay, jobs_per_case: list) -> collections.Counter:
  """Per order, makespan, tails and the tail's anatomy of one replay's cases with these jobs
  ([(RequestMeta, true length)] per case), summed over the cases."""
  sums = collections.Counter()
  for case, jobs in zip(replay.cases, jobs_per_case):
    truth = {m.request_id: n for m, n in jobs}
    factories = {
        "fifo": lambda: make_policy("fifo"),
        "history_residual": lambda: make_policy("history_residual", predictor=case.predictor,
                                                yield_cost=replay.yield_cost),
        "oracle": lambda: make_policy("oracle", true_lengths=truth),
        "clairvoyant": lambda: ClairvoyantResidual(truth, replay.yield_cost),
    }
    lengths = np.array([n for _, n in jobs], np.int64)
    caps = np.array([m.max_new_tokens for m, _ in jobs])
    for order, factory in factories.items():
      res = simulate(jobs, factory, replay.table, replay.config)
      launches, members, capped = anatomy(res, lengths, caps)
      sums[order, "makespan"] += res.makespan_ms
      sums[order, "tail"] += res.tail_ms
      sums[order, "step_tail"] += res.step_tail_ms
      sums[order, "launches"] += launches
      sums[order, "members"] += members
      sums[order, "capped"] += capped
  return sums


def tail_cut(sums: collections.Counter, order: str, key: str = "tail") -> float:
  """1 - the order's tail / FIFO's (nan where FIFO has none)."""
  return 1 - sums[order, key] / sums["fifo", key] if sums["fifo", key] else float("nan")


def percent(value: float) -> str:
  """A share as a whole percent; "-" where undefined (nan)."""
  return "-" if np.isnan(value) else f"{100 * value:.0f}%"


def run(args) -> tuple[list[list], list[str]]:
  rows, notes = [], []
  rng = np.random.default_rng(args.seed)
  for replay in schedsim_divided.runs(args, notes):
    sums = order_sums(replay, [case.jobs for case in replay.cases])
    # the same rollouts redrawn: each group's lengths shuffled among its samples
    draws = [order_sums(replay, [shuffled_within_groups(case.jobs, rng)
                                 for case in replay.cases])
             for _ in range(args.shuffle_draws)]
    for order in ORDERS:
      cut = lambda key: percent(tail_cut(sums, order, key))
      cuts = [tail_cut(d, order) for d in draws]
      ratios = [d[order, "makespan"] / d["oracle", "makespan"] for d in draws]
      rows.append(replay.label() + [
          order, f"{sums[order, 'makespan']:.1f}",
          f"{sums[order, 'makespan'] / sums['oracle', 'makespan']:.3f}",
          f"{sums[order, 'tail']:.1f}", cut("tail"), f"{sums[order, 'step_tail']:.1f}",
          cut("step_tail"), f"{sums[order, 'members'] / len(replay.cases):.1f}",
          f"{sums[order, 'launches'] / len(replay.cases):.1f}",
          f"{100 * sums[order, 'capped'] / max(sums[order, 'members'], 1):.0f}%"]
          + ([" / ".join(map(percent, np.quantile(cuts, [0, .5, 1]))),
              " / ".join(f"{v:.3f}" for v in np.quantile(ratios, [0, .5, 1]))]
             if draws else []))
  return rows, notes


HEADER = schedsim_divided.LABEL_HEADER + [
    "order", "makespan ms", "makespan / oracle", "tail ms", "tail cut vs fifo",
    "step-clock tail ms", "step-clock tail cut", "tail requests / step", "tail launches / step",
    "tail at cap"]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  schedsim_divided.add_args(ap)
  ap.add_argument("--shuffle_draws", type=int, default=0,
                  help="redraws of the rollouts with each group's lengths shuffled among its "
                       "samples: the spread of tail cut and makespan / oracle (0 = off)")
  ap.add_argument("--seed", type=int, default=0, help="seed of the shuffles")
  args = schedsim_divided.complete(ap.parse_args(argv))
  if args.shuffle_draws < 0:
    ap.error(f"--shuffle_draws={args.shuffle_draws}: must be >= 0")
  rows, notes = run(args)
  extra = ["tail cut over shuffles (min / median / max)",
           "makespan / oracle over shuffles"] if args.shuffle_draws else []
  table = common.markdown_table(HEADER + extra, rows)
  schedsim_divided.report(
      args, "The last 10% of requests per order (bench/tail_anatomy.py)", table, notes,
      ["simulated, not run (rhyme_jax/scheduling/simulate.py, bench/schedsim.py's step-time "
       "tables and yield costs): divided rollout, KV kept, one shard; figures summed over "
       "the trace's steps",
       "tail = makespan minus the time the first 90% of requests had finished; launch clock: "
       "a request ends when its launch ends; step clock: with the step that computed its "
       "last token; tail requests = those that finished after the first 90% had, and tail "
       "launches = the launch ends they finished at, both per step; tail at cap = the share "
       "of tail requests that stopped at the token cap"])


if __name__ == "__main__":
  main()
