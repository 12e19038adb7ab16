"""Rollout scheduling simulator: admission orders and shard plans on recorded length traces.

Replays one GRPO step's requests (the last epoch of a trace, or every step of a GRPO run)
through `scheduling.simulate` (the engine's slots, shrinking buckets, measured step times,
optional speculation and divided rollout) under each admission policy; history-based policies
predict from the trace's earlier epochs only. Reports makespan, tail time (last 10% of
requests), slot utilisation, ratios to the oracle order (true lengths, longest first) and the
tail cut vs FIFO; prints the table and appends it to bench/RESULTS.md. Reference orders no
policy can run (bench/schedsim_bounds.py) bound what any order could reach: per-prompt orders
without preemption, and divided rollout knowing the step's drift, each prompt's true
lengths or each request's; beside them, divided rollout knowing only the length distribution
(the step's prompts' history pooled), which shows what the per-prompt history adds.
`--told_cost` scales the yield cost history_residual weighs (a sensitivity check of its margin
rule).

Traces (`--trace`, repeatable; read by bench/schedsim_traces.py):
  synthetic[:SEED]   a generated trace (log-normal prompt difficulty, per-sample noise, epoch
                     drift; 32 prompts x 8 samples x 2 epochs by default), clearly labelled;
  PATH.jsonl         one JSON object per line: {"prompt_key", "epoch", "lengths": [...],
                     optional "prompt_len"} (the format `--write_trace` emits), or per-sample
                     lines (see `load_trace`);
  GLOB.npz           recorded rollouts (the drafts helper's `history.recording` format: one
                     file per epoch and prompt range; `lengths`, `prompt_index`,
                     `prompt_keys`, `prompt_lengths`, `meta_json` with the epoch), all files
                     the glob matches forming one trace;
  grpo:DIR (or DIR)  a GRPO run's `--record_rollouts` directory: every training step after
                     the first data epoch is one simulated rollout, predicted from what the
                     trainer's history store held before it (bench/schedsim_grpo.py); the
                     tables sum makespans and tail times over the steps.

Scenarios (bench/schedsim_scenarios.py): slots scale with the step (--slots overrides), 64 h100
/ 32 cpu rows for a 128-request step, 8 / 4 for a 16-request one, so each slot serves 2 / 4
requests; the divided-rollout chunk is min(64, max_new_tokens / 4) (--chunk overrides).

  python bench/schedsim.py --trace synthetic:0 --trace '/work/recordings/gsm8k_T0.6_e*.npz'
  python bench/schedsim.py --trace grpo:bench/data/grpo_quickstart
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.schedsim_bounds import BOUNDS, blind_draws, divided_bounds  # noqa: E402
from bench.schedsim_grpo import aggregate  # noqa: E402
from bench.schedsim_scenarios import (divided_chunk, scenarios, shard_plan,  # noqa: E402
                                      slot_counts)
from bench.schedsim_traces import (Trace, history_predictor, load_npz_trace,  # noqa: E402,F401
                                   load_trace, split_groups, step_jobs, synthetic_trace,
                                   trace_cases, write_trace)
from rhyme_jax.scheduling.admission import (RESIDUAL_QUANTILE, StaticPolicy,  # noqa: E402
                                            make_policy)
from rhyme_jax.scheduling.simulate import SimConfig, simulate  # noqa: E402
from rhyme_jax.scheduling.step_time import PREFILL_MS_PER_TOKEN, StepTimeTable  # noqa: E402

# Device time of divided rollout's yields (two KV row copies each), per yield and per pass
# (a step that yields at all: the engine copies a pass's rows in one call each way). A pass of
# one yield costs 0.35 ms on 1 x H200, the engine's warm-up in bench/schedule_engine.py queued
# as a rollout dispatches it (2026-11-26 at 864108f; the "h100" step table is an H100's).
# bench/park_copy.py on 1 x H100 (2026-11-26 at 48de091) split it: a pass of 4 yields cost
# what a pass of one did (pools of 8 / 64 / 128 rows: 0.37 / 0.24 / 0.21 ms against
# 0.37 / 0.24 / 0.20), a fitted 0.000-0.004 ms per row; so 0.004 per yield, the rest per pass.
# The 2-core CPU: 1.65 ms per copy, all per row (bandwidth-bound there, 2026-11-25).
YIELD_MS = {"h100": 0.004, "cpu": 2 * 1.65}
YIELD_PASS_MS = {"h100": 2 * 0.175 - 0.004, "cpu": 0.0}

POLICIES = ("fifo", "random", "history", "history_alt", "probe", "history_probe",
            "history_residual", "oracle_group", "oracle")


class _TwoSteps:
  """Step A's requests in policy_a's order, then step B's in policy_b's: B's requests take the
  slots A's tail frees (rollout of the next step overlapping this one's tail)."""

  online = False

  def __init__(self, policy_a, policy_b, step_b_groups):
    self.a, self.b, self.step_b = policy_a, policy_b, step_b_groups

  def order(self, queue):
    return (self.a.order([m for m in queue if m.group_id not in self.step_b])
            + self.b.order([m for m in queue if m.group_id in self.step_b]))

  def next_to_admit(self, queue, finished, live):
    return 0


def overlap_rows(name, jobs, predictor, truth, slots, tables) -> list[list]:
  """Cross-step alternation: the step's prompts split into two consecutive steps A (even) and
  B (odd); total time with a barrier between them vs with B admitted into A's tail."""
  groups = sorted({m.group_id for m, _ in jobs})
  step_b = set(groups[len(groups) // 2:])
  rows = []
  for table_name, slots in zip(("h100", "cpu"), slots):
    table = tables[table_name]
    cfg = SimConfig(slots=slots, buckets=tuple(b for b in (64, 32, 16, 8, 4, 2, 1) if b <= slots),
                    prefill_ms_per_token=PREFILL_MS_PER_TOKEN[table_name])
    pick = lambda name, step: make_policy(name, predictor=predictor, step=step,
                                          true_lengths=truth)
    for label, (pa, pb) in {"fifo": ("fifo", "fifo"), "history": ("history", "history"),
                            "history_alt": ("history_alt", "history_alt"),
                            "oracle": ("oracle", "oracle")}.items():
      a_jobs = [(m, n) for m, n in jobs if m.group_id not in step_b]
      b_jobs = [(m, n) for m, n in jobs if m.group_id in step_b]
      barrier = (simulate(a_jobs, lambda: pick(pa, 0), table, cfg).makespan_ms
                 + simulate(b_jobs, lambda: pick(pb, 1), table, cfg).makespan_ms)
      both = simulate(jobs, lambda: _TwoSteps(pick(pa, 0), pick(pb, 1), step_b), table, cfg)
      rows.append([name, f"{table_name} 1x{slots}", label, f"{barrier / 1e3:.2f}",
                   f"{both.makespan_ms / 1e3:.2f}", f"{both.makespan_ms / barrier:.3f}"])
  return rows


def run(args) -> tuple[list[list], list[list], list[list], list[str]]:
  """(detail rows, summary rows, cross-step rows, notes) for every trace."""
  detail, summary, overlap, notes = [], [], [], []
  args.blind_rows, args.bound_rows = [], []
  for spec in args.trace:
    name, cases = trace_cases(spec, args, notes)
    num_requests = len(cases[0].jobs)
    chunk = divided_chunk(args.chunk, cases[0].jobs[0][0].max_new_tokens)
    if len(cases) == 1:  # cross-step alternation: the step split in two
      c = cases[0]
      overlap += overlap_rows(name, c.jobs, c.predictor, c.truth,
                              slot_counts(args, num_requests), args.tables)
    for sc in scenarios(args, num_requests, chunk):
      table = args.tables[sc.table]
      cfg = sc.sim_config(args.yield_ms, args.yield_pass_ms)
      # The order is told a pass of one yield, in steps of the batch (as the engine tells it),
      # times --told_cost (a sensitivity check of the margin rule; 1 = the engine's).
      yield_cost = sc.told_yield_cost(table, args.yield_ms, args.yield_pass_ms, args.told_cost)
      per_step = {p: [] for p in POLICIES}
      for case in cases:
        plan = (shard_plan(sc.plan, case.jobs, case.predictor, sc.shards) if sc.shards > 1
                else None)
        group_mean, truth = case.group_mean, case.truth
        for pol in POLICIES:
          def factory(pol=pol):
            if pol == "oracle_group":  # the best any per-prompt predictor could do
              return StaticPolicy(pol, lambda m: group_mean[m.group_id])
            # history_alt is shown on an odd step: short-to-long, HistoPipe's other half.
            return make_policy(pol, predictor=case.predictor, step=1, seed=args.seed,
                               true_lengths=truth,
                               kv_budget=int(sc.kv_rows * sc.slots) if sc.kv_rows else None,
                               yield_cost=yield_cost,
                               residual_quantile=args.residual_quantile)
          res = simulate(case.jobs, factory, table, cfg, plan)
          assert abs(res.tokens - case.lengths.sum()) < 1e-6, "simulator lost or invented tokens"
          per_step[pol].append(res)
      results = {p: aggregate(v) for p, v in per_step.items()}
      oracle, fifo = results["oracle"], results["fifo"]
      cut = lambda r: (f"{100 * (1 - r.tail_ms / fifo.tail_ms):.0f}%" if fifo.tail_ms > 0
                       else "-")
      label = sc.label().split(" | ")
      summary.append([name, *label]
                     + [f"{results['history'].makespan_ms / 1e3:.2f}"]
                     + [f"{results[p].makespan_ms / oracle.makespan_ms:.3f}" for p in POLICIES[:-1]]
                     + [cut(results[p]) for p in ("history", "probe", "history_residual",
                                                  "oracle")])
      if sc.shards > 1 or not sc.shrink or sc.accepted > 1:
        continue
      for pol, res in results.items():  # the main and divided scenarios in full
        detail.append([name, label[0], label[1], label[5], label[6], pol,
                       f"{res.makespan_ms / 1e3:.2f}",
                       f"{res.tail_ms / 1e3:.2f}", f"{res.utilisation:.3f}", res.peak_started,
                       res.yields, res.yield_passes,
                       f"{res.makespan_ms / oracle.makespan_ms:.3f}",
                       (f"{res.tail_ms / oracle.tail_ms:.2f}" if oracle.tail_ms > 0 else "-"),
                       cut(res)])
      engine_like = sc.multi_step > 1 or sc.pipeline
      if args.blind_draws and not sc.chunk and not engine_like:
        b = blind_draws(cases, table, cfg, args.blind_draws, args.seed)
        lengths = np.concatenate([c.lengths for c in cases])
        args.blind_rows.append([
            name, sc.table, f"1x{sc.slots}", lengths.max(),
            int(sum(np.ceil(c.lengths.sum() / sc.slots) for c in cases)), oracle.steps,
            results["history"].steps,
            f"{b[:, 2].mean():.0f} ({b[:, 2].min():.0f}-{b[:, 2].max():.0f})",
            f"{b[:, 0].mean():.3f}", f"{b[:, 0].min():.3f}", f"{100 * b[:, 1].mean():.0f}%",
            f"{100 * b[:, 1].max():.0f}%"])
      if sc.divided_reference:  # divided rollout's references
        b = divided_bounds(cases, table, cfg, yield_cost, args.residual_quantile, known={
            p: (results[p].makespan_ms, results[p].tail_ms)
            for p in ("history_residual", "oracle", "fifo")})
        args.bound_rows.append([name, sc.table, f"1x{sc.slots}", label[5], label[6]]
                               + [f"{b[n][0]:.3f}" for n in BOUNDS]
                               + [f"{100 * b[n][1]:.0f}%" for n in BOUNDS])
      for pol in ("history", "history_residual") if sc.chunk else ("history",):
        h = results[pol]
        notes.append(f"targets, {name} [{sc.table} 1x{sc.slots}"
                     f"{f', chunk {label[5]}' if sc.chunk else ''}"
                     f"{f', launch {label[6]}' if engine_like else ''}]: {pol} makespan / oracle "
                     f"{h.makespan_ms / oracle.makespan_ms:.3f} (target <= 1.02; / oracle_group "
                     f"{h.makespan_ms / results['oracle_group'].makespan_ms:.3f}), tail cut vs "
                     f"FIFO {cut(h)} (target >= 75%)")
  return detail, summary, overlap, notes


def _yield_pair(text: str) -> dict[str, float]:
  try:
    h, c = (float(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected H,C, two numbers (ms)") from None
  if not (h >= 0 and c >= 0):
    raise argparse.ArgumentTypeError(f"{text!r}: yield times must be >= 0")
  return {"h100": h, "cpu": c}


def _positive(text: str) -> float:
  try:
    x = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
  if not (x > 0 and x < float("inf")):
    raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
  return x


def table_arg(text: str) -> tuple[str, StepTimeTable]:
  """NAME=PATH: a step-time table file (StepTimeTable.from_file) in place of a built-in one."""
  name, sep, path = text.partition("=")
  if not sep or name not in ("h100", "cpu"):
    raise argparse.ArgumentTypeError(f"{text!r}: expected h100=PATH or cpu=PATH")
  try:
    return name, StepTimeTable.from_file(path)
  except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
    raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def slot_pair_arg(text: str) -> tuple[int, int]:
  try:
    h, c = (int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected H,C, two integers") from None
  if h < 1 or c < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: rows per shard must be >= 1")
  return h, c


def quantile_arg(text: str) -> float | None:
  """--residual_quantile: a number in (0, 1), or "mean" (None: rank by the mean)."""
  if text == "mean":
    return None
  try:
    q = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a number in (0, 1) or 'mean'") from None
  if not 0 < q < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1), or 'mean'")
  return q


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--trace", action="append", default=None,
                  help="synthetic[:SEED], a JSONL trace, a GLOB.npz of recordings or "
                       "grpo:RUN_DIR (a GRPO run's recorded rollouts) (repeatable)")
  ap.add_argument("--max_new_tokens", type=int, default=512)
  ap.add_argument("--stat", default="mean", help="group statistic the predictor ranks")
  ap.add_argument("--epochs_kept", type=int, default=1)
  ap.add_argument("--accepted", type=float, default=1.7,
                  help="mean accepted length at --budget for the speculation scenario")
  ap.add_argument("--budget", type=int, default=16)
  ap.add_argument("--plans", default="data_order,lpt_history,lpt_oracle")
  ap.add_argument("--chunk", type=int, default=0,
                  help="divided-rollout chunk (tokens); 0 = min(64, max_new_tokens / 4)")
  ap.add_argument("--slots", type=slot_pair_arg, default=None,
                  help="H,C: rows per shard on the h100 / cpu tables (default: scaled to the "
                       "step, 64 / 32 for 128 requests)")
  ap.add_argument("--yield_ms", type=_yield_pair,
                  default=dict(YIELD_MS),
                  help="H,C: ms each divided-rollout yield stalls a shard on the h100 / cpu "
                       f"tables (default: measured, {YIELD_MS['h100']:g},{YIELD_MS['cpu']:g}); "
                       "0,0 with --yield_pass_ms 0,0 = free yields")
  ap.add_argument("--yield_pass_ms", type=_yield_pair, default=dict(YIELD_PASS_MS),
                  help="H,C: ms more per step that yields at all (the engine copies a pass's "
                       "rows in one call each way; default: measured, "
                       f"{YIELD_PASS_MS['h100']:g},{YIELD_PASS_MS['cpu']:g})")
  ap.add_argument("--table", type=table_arg, action="append", default=[],
                  help="NAME=PATH (NAME: h100 or cpu): step times from a JSON file "
                       "([{bucket, budget, ms}, ...], e.g. bench/schedule_engine.py "
                       "--write_step_times: a real engine's warm-up) in place of that built-in "
                       "table; its prefill and yield costs stay the built-in's (repeatable)")
  ap.add_argument("--told_cost", type=_positive, default=1.0,
                  help="the yield cost history_residual is told, as a multiple of a pass of one "
                       "yield (1: what the engine tells it; below 1, a pass's yields sharing its "
                       "copy calls; a sensitivity check of the margin rule)")
  ap.add_argument("--residual_quantile", type=quantile_arg, default=RESIDUAL_QUANTILE,
                  help="the quantile of remaining work history_residual ranks by, or 'mean' "
                       "(ResidualPolicy; default: its default)")
  ap.add_argument("--seed", type=int, default=0, help="seed of the random order")
  ap.add_argument("--blind_draws", type=int, default=200,
                  help="draws of the per-prompt bound (lengths shuffled within groups); 0 = off")
  ap.add_argument("--split_groups", action="store_true",
                  help="a one-epoch trace: first half of each group = history, second = step")
  ap.add_argument("--write_trace", default=None, help="write the first trace as JSONL and exit")
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  args.trace = args.trace or ["synthetic"]
  args.tables = {name: StepTimeTable.builtin(name) for name in ("h100", "cpu")}
  args.tables.update(args.table)
  if args.write_trace:
    write_trace(synthetic_trace(max_new_tokens=args.max_new_tokens), args.write_trace)
    return
  detail, summary, overlap, notes = run(args)
  table = common.markdown_table(
      ["trace", "table", "shards x slots", "chunk", "launch", "policy", "makespan s", "tail s",
       "slot util", "peak started", "yields", "yield passes", "makespan / oracle",
       "tail / oracle", "tail cut vs fifo"],
      detail)
  table += ("\n\nEvery scenario: the history order's makespan (compare plans by it), makespan / "
            "oracle per policy (same trace, plan and step times in a row), tail cut vs FIFO\n\n")
  table += common.markdown_table(
      ["trace", "table", "shards x slots", "shrink", "spec", "plan", "chunk", "launch",
       "history s"]
      + [p for p in POLICIES[:-1]] + ["tail cut: history", "probe", "history_residual", "oracle"],
      summary)
  if args.blind_rows:
    table += (f"\n\nWhat any per-prompt order can reach: the step's true per-prompt mean "
              f"lengths, longest first, over {args.blind_draws} draws of each prompt's lengths "
              "shuffled among its samples (samples of one prompt are indistinguishable before "
              "they run); decode steps of the makespan\n\n")
    table += common.markdown_table(
        ["trace", "table", "shards x slots", "longest response", "tokens / slots",
         "oracle steps", "history steps", "per-prompt steps: mean (range)",
         "per-prompt makespan / oracle: mean", "best draw", "tail cut vs fifo: mean",
         "best draw"],
        args.blind_rows)
  if args.bound_rows:
    table += ("\n\nWhat divided rollout could reach (one shard, chunk scenarios): "
              "history_residual against the same rule over the step's prompts' history pooled "
              "(one length distribution for all: what the per-prompt history adds), over the "
              "history rescaled to the step's "
              "true mean length (the drift as one factor per step), over the step's own "
              "lengths per prompt (each prompt's true length distribution, not which sample is "
              "which) and over each request's true length (clairvoyant LRPT); makespan / "
              "oracle, tail cut vs FIFO (bench/schedsim_bounds.py)\n\n")
    table += common.markdown_table(
        ["trace", "table", "shards x slots", "chunk", "launch"]
        + [f"{n} / oracle" for n in BOUNDS] + [f"tail cut: {n}" for n in BOUNDS],
        args.bound_rows)
  table += ("\n\nCross-step alternation: the step's prompts as two consecutive steps A, B "
            "(first and second half); history_alt = A long-first, B short-first\n\n")
  table += common.markdown_table(
      ["trace", "table", "policy", "A then B, barrier s", "B into A's tail s", "ratio"], overlap)
  print(table)
  for n in notes:
    print("-", n)
  if not args.no_append:
    notes = [
        "simulated, not run: bench/schedsim.py replays recorded/synthetic response lengths "
        "through rhyme_jax/scheduling/simulate.py; step times from the built-in tables of "
        "rhyme_jax/scheduling/step_time.py (h100: bench/engine_overhead.py H100 engine ms/step; "
        "cpu: bench/forward.py 2-core CPU decode ms/step), made non-decreasing in bucket and "
        "budget; prefill per prompt token from the same sources' forward.py runs",
        *[f"the {name} table replaced by {t.name} (--table): "
          + ", ".join(f"{b} rows {t.ms(b, 0):.2f} ms" for b in t.buckets)
          + " at budget 0; its prefill and yield costs are the built-in table's"
          for name, t in args.table],
        "tail = time to finish the last 10% of requests; slot util = live row-time / "
        "(shards x slots x makespan); oracle = true lengths, longest first; history = the "
        f"previous epoch's group {args.stat} (rank-mapped), longest first; history_alt = the "
        "odd-step half of the cross-step alternation (short first); probe = Seer probe-first "
        "(no history); history_probe = probes ordered by history, then max sibling so far; "
        "history_residual = longest remaining work first, the "
        + ("mean" if args.residual_quantile is None else f"{args.residual_quantile:g} quantile")
        + " of L - n given L > n over the prompt's history (shrunk toward every prompt's) for "
        "a request that has n tokens; oracle_group = the step's true per-prompt mean length, "
        "longest first (the best any per-prompt predictor can do: samples of one prompt are "
        "indistinguishable before they run)",
        "the device line names the machine that ran the simulation, not the one the step "
        "times were measured on; simulated times are deterministic (no wall clock), so the "
        "shared CPU does not affect them",
        "the h100 table is flat at budget 0 once made non-decreasing (3.63 ms at 1..64 rows: the "
        "135M model's step is launch-bound), so bucket shrinking changes nothing there (shrink "
        "yes/no rows equal); the cpu table grows with rows, where shrinking matters",
        "chunk = divided rollout (a request yields its slot every chunk tokens and is "
        "requeued); static orders resume it at once on one shard (no preemption), online ones "
        "(probe, history_residual) may start another request instead. A displaced request's "
        "KV stays resident (peak started = most requests started and unfinished at once, the "
        "sequences whose KV is held, vs the slots); 'kv 2x' caps history_residual's started "
        "requests at 2 x slots; 're-prefill' drops the KV on yield and recomputes prompt + "
        "generated tokens on a displaced resumption at the table's batch-1 prefill rate, "
        "serially (an upper bound on that cost). The oracle is the non-preemptive longest-first "
        "order, which a preemptive policy can beat (ratios < 1)",
        f"each yield stalls its shard {args.yield_ms['h100']:g} ms (h100 table) / "
        f"{args.yield_ms['cpu']:g} ms (cpu table): the engine's two KV row copies"
        + (f", and a step that yields at all {args.yield_pass_ms['h100']:g} / "
           f"{args.yield_pass_ms['cpu']:g} ms more (a pass's copies share one call each way)"
           if any(args.yield_pass_ms.values()) else "") + "; the order is told a pass of one "
        "yield" + (f" x {args.told_cost:g} (--told_cost)" if args.told_cost != 1 else "") + "; "
        "history_residual yields only to a margin of sqrt(yield cost in steps x expected tokens "
        "left) - chunk more expected remaining tokens (ResidualPolicy.yield_margin; tokens left = "
        "requests x mean expected length less the tokens generated so far)",
        "launch = plain steps per launch ('piped': outputs read one launch late, as the engine "
        "reads them; scheduling/simulate.py; 'drain 1': one-step launches once nothing waits, "
        "EngineConfig.drain_steps 'single'); the other scenarios read every step at once",
    ] + notes + args.note
    common.append_results("Rollout scheduling simulator (bench/schedsim.py)", table, notes)


if __name__ == "__main__":
  main()
