"""The simulator's divided-rollout rows, for the benches that study history_residual in them.

bench/quantile_rehearsal.py and bench/tail_anatomy.py replay recorded traces through the
scenarios bench/schedsim.py compares its divided-rollout references in (`Scenario.
divided_reference`: one shard, divided rollout with the KV kept, on the h100 and cpu tables,
at one step per launch and in the engine's launch shapes), with the same flags for the traces,
slots and step-time tables. This module holds those flags and the loop over (trace, scenario).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Iterator

from bench import common
from bench.schedsim import YIELD_MS, YIELD_PASS_MS, slot_pair_arg, table_arg
from bench.schedsim_scenarios import Scenario, divided_chunk, scenarios
from bench.schedsim_traces import trace_cases
from rhyme_jax.scheduling.simulate import SimConfig
from rhyme_jax.scheduling.step_time import StepTimeTable


def add_args(ap: argparse.ArgumentParser) -> None:
  """The flags every divided-rollout bench reads: traces, cap, chunk, slots, tables, notes."""
  ap.add_argument("--trace", action="append", required=True,
                  help="as bench/schedsim.py's --trace (repeatable)")
  ap.add_argument("--max_new_tokens", type=int, default=512)
  ap.add_argument("--chunk", type=int, default=0,
                  help="divided-rollout chunk (tokens); 0 = min(64, max_new_tokens / 4)")
  ap.add_argument("--slots", type=slot_pair_arg, default=None,
                  help="H,C: rows per shard on the h100 / cpu tables (default: scaled)")
  ap.add_argument("--table", type=table_arg, action="append", default=[],
                  help="NAME=PATH: a step-time table in place of a built-in one (repeatable)")
  common.add_results_args(ap)


def complete(args: argparse.Namespace) -> argparse.Namespace:
  """Sets the fields of bench/schedsim.py's parser that `trace_cases` and `scenarios` read
  (rather than growing that whole parser here): one epoch kept, mean statistic, the step-time
  tables with --table's replacements. The speculation and plan fields only name rows that
  `runs` skips."""
  args.epochs_kept, args.stat, args.split_groups = 1, "mean", False
  args.accepted, args.budget, args.plans = 1.7, 16, "data_order"
  args.tables = {name: StepTimeTable.builtin(name) for name in ("h100", "cpu")}
  args.tables.update(args.table)
  return args


@dataclasses.dataclass
class DividedRun:
  """One (trace, scenario) to replay: the trace's step cases and the scenario's simulator
  configuration, step-time table and the yield cost history_residual is told."""

  trace: str
  cases: list
  scenario: Scenario
  table: StepTimeTable
  config: SimConfig
  yield_cost: float

  def label(self) -> list:
    """The row's first cells: trace, table, shards x slots, chunk, launch, steps."""
    sc = self.scenario
    return [self.trace, sc.table, f"1x{sc.slots}", sc.chunk_label(), sc.launch_label(),
            len(self.cases)]


LABEL_HEADER = ["trace", "table", "shards x slots", "chunk", "launch", "steps"]


def runs(args: argparse.Namespace, notes: list) -> Iterator[DividedRun]:
  """Every --trace in every divided-reference scenario, in order; the traces' notes are
  appended to `notes`."""
  for spec in args.trace:
    name, cases = trace_cases(spec, args, notes)
    chunk = divided_chunk(args.chunk, cases[0].jobs[0][0].max_new_tokens)
    for sc in scenarios(args, len(cases[0].jobs), chunk):
      if not sc.divided_reference:
        continue
      table = args.tables[sc.table]
      yield DividedRun(name, cases, sc, table, sc.sim_config(YIELD_MS, YIELD_PASS_MS),
                       sc.told_yield_cost(table, YIELD_MS, YIELD_PASS_MS))


def report(args: argparse.Namespace, title: str, table: str, notes: list,
           about: list) -> None:
  """Prints the table and the traces' notes; appends them to bench/RESULTS.md under `title`
  (unless --no_append) with `about` (what the figures are) and the --note lines."""
  print(table)
  for n in notes:
    print("-", n)
  if not args.no_append:
    common.append_results(title, table, [*about, *notes, *args.note])
