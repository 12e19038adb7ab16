"""Hosts balanced by predicted work (--balance_hosts) vs each host's slice, on recorded GRPO runs.

  python bench/host_balance.py --run bench/data/grpo_gsm8k_h200 --hosts 2,4,8

Each recorded round (a GRPO step's prompts, data order) is split over H hosts three ways:
- slices: host h samples prompts [h B, (h + 1) B) (the trainer without --balance_hosts);
- lpt_history: `scheduling.assignment.plan_hosts` over the lengths the trainer's history store
  held before the round (the epochs before it, as `bench/schedsim_grpo.grpo_cases` rebuilds
  them): exactly the plan --balance_hosts computes (`rl.hosts.HostPlan`);
- lpt_true: LPT over the round's true group tokens (a clairvoyant reference).
A prompt samples the same tokens on any host (request ids follow the prompt), so every plan is
scored on the same true lengths. Figures, over the rounds with history (data epoch >= 1):
- busiest host's true tokens over the hosts' mean (1 = even; hardware-independent);
- the round's rollout makespan: each host's engine simulated (`scheduling.simulate`, FIFO,
  B x G slots as the trainer's engine has, a host given more groups queues them) on a
  step-time table, the round ending with its slowest host; summed over rounds, and over the
  slices' sum.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.schedsim_grpo import grpo_cases  # noqa: E402
from bench.schedsim_scenarios import shard_plan  # noqa: E402
from rhyme_jax.scheduling.admission import make_policy  # noqa: E402
from rhyme_jax.scheduling.assignment import plan_hosts  # noqa: E402
from rhyme_jax.scheduling.simulate import SimConfig, simulate  # noqa: E402
from rhyme_jax.scheduling.step_time import PREFILL_MS_PER_TOKEN, StepTimeTable  # noqa: E402

PLANS = ("slices", "lpt_history", "lpt_true")


def round_groups(case) -> list[list]:
  """The round's jobs grouped by prompt, groups in data order."""
  by_group = collections.defaultdict(list)
  for meta, n in sorted(case.jobs, key=lambda j: j[0].index):
    by_group[meta.group_id].append((meta, n))
  return [by_group[g] for g in sorted(by_group)]


def host_plans(case, groups, hosts: int) -> dict[str, list[list[int]]]:
  b = len(groups) // hosts
  keys = [g[0][0].prompt_key for g in groups]
  true = shard_plan("lpt_oracle", case.jobs, case.predictor, hosts)  # {group id: host}
  return {"slices": [list(range(h * b, (h + 1) * b)) for h in range(hosts)],
          "lpt_history": plan_hosts(keys, len(groups[0]), case.predictor, hosts)[0],
          "lpt_true": [[q for q, g in enumerate(groups) if true[g[0][0].group_id] == h]
                       for h in range(hosts)]}


def measure(cases, hosts: int, table: StepTimeTable, prefill_ms: float) -> dict[str, list]:
  """Per plan: [sum of round makespans ms, mean busiest/mean tokens, rounds, groups moved]."""
  out = {p: [0.0, [], 0, 0] for p in PLANS}
  for case in cases:
    groups = round_groups(case)
    if len(groups) % hosts:
      continue
    b, g = len(groups) // hosts, len(groups[0])
    slots = 1 << (b * g).bit_length() - 1  # the trainer's largest bucket: B x G, a power of 2
    cfg = SimConfig(slots=slots, buckets=tuple(1 << k for k in range(slots.bit_length()))[::-1],
                    prefill_ms_per_token=prefill_ms)
    tokens = np.array([sum(n for _, n in grp) for grp in groups], np.int64)
    for name, plan in host_plans(case, groups, hosts).items():
      ends = [simulate([j for q in mine for j in groups[q]], lambda: make_policy("fifo"), table,
                       cfg).makespan_ms if mine else 0.0 for mine in plan]
      out[name][0] += max(ends)
      out[name][1].append(max(int(tokens[m].sum()) for m in plan) / (tokens.sum() / hosts))
      out[name][2] += 1
      out[name][3] += sum(q // b != h for h, mine in enumerate(plan) for q in mine)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--run", action="append", default=None,
                  help="a GRPO run's recorded rollouts (RUN_DIR/rollouts, --record_rollouts); "
                       "repeatable")
  ap.add_argument("--hosts", default="2,4", help="host counts (each must divide a round)")
  ap.add_argument("--tables", default="h100,cpu", help="step-time tables (built-in or JSON)")
  ap.add_argument("--epochs_kept", type=int, default=1, help="the trainer's --history_epochs")
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  runs = args.run or ["bench/data/grpo_quickstart", "bench/data/grpo_gsm8k_h200"]
  rows = []
  for run in runs:
    try:
      cases = grpo_cases(run, args.epochs_kept)
    except (ValueError, OSError) as e:  # the loader names the directory, not this flag
      raise SystemExit(f"--run {run}: {str(e).split(': ', 1)[-1]}") from e
    if not cases:
      raise SystemExit(f"--run {run}: no rounds with history (needs two data epochs)")
    for hosts in (int(h) for h in args.hosts.split(",")):
      for tname in args.tables.split(","):
        table = StepTimeTable.load(tname)
        res = measure(cases, hosts, table, PREFILL_MS_PER_TOKEN.get(tname, 0.0))
        if not res["slices"][2]:
          print(f"{run}: {hosts} hosts do not divide a round; skipped", file=sys.stderr)
          break
        base = res["slices"][0]
        for name in PLANS:
          total, ratios, rounds, moved = res[name]
          rows.append([os.path.basename(run.rstrip("/")), hosts, tname, name, rounds, moved,
                       f"{np.mean(ratios):.3f}", f"{max(ratios):.3f}", f"{total / 1e3:.2f}",
                       f"{total / base:.3f}"])
  table = common.markdown_table(
      ["run", "hosts", "table", "plan", "rounds", "groups moved", "busiest host tokens / mean",
       "worst round", "rollout makespan s (simulated, summed)", "makespan / slices"], rows)
  print(table)
  notes = [
      "simulated, not run: the rounds' true lengths (recorded GRPO rollouts) through "
      "rhyme_jax/scheduling/simulate.py, one engine per host (FIFO, B x G slots, queueing "
      "beyond), the round's makespan its slowest host's; tokens per host are exact (a prompt "
      "samples the same tokens on any host)",
      "lpt_history is the plan --balance_hosts computes (rl.hosts.HostPlan -> "
      "scheduling.assignment.plan_hosts) from the history the trainer held before the round "
      f"(--history_epochs={args.epochs_kept}); rounds of the first data epoch (no history) are "
      "left out",
      *args.note]
  if not args.no_append:
    common.append_results("Hosts balanced by predicted work vs slices (bench/host_balance.py)",
                          table, notes)


if __name__ == "__main__":
  main()
