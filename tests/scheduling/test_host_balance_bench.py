"""bench/host_balance.py on the recorded quickstart GRPO run: the three plans split every round
completely, the slices are the trainer's unbalanced hosts, lpt_history is the plan
--balance_hosts computes, and the table's figures follow from the plans."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import host_balance  # noqa: E402
from bench.schedsim_grpo import grpo_cases  # noqa: E402
from rhyme_jax.scheduling.assignment import plan_hosts  # noqa: E402
from rhyme_jax.scheduling.step_time import StepTimeTable  # noqa: E402

RUN = os.path.join(ROOT, "bench", "data", "grpo_quickstart")


def test_plans_cover_each_round_and_lpt_history_is_the_trainers_plan():
  cases = grpo_cases(RUN)
  assert len(cases) == 20  # data epochs 1-5, four rounds each
  for case in cases[:4]:
    groups = host_balance.round_groups(case)
    assert [m.index for g in groups for m, _ in g] == sorted(m.index for m, _ in case.jobs)
    plans = host_balance.host_plans(case, groups, 2)
    for plan in plans.values():
      assert sorted(q for mine in plan for q in mine) == list(range(len(groups)))
    assert plans["slices"] == [[0, 1], [2, 3]]
    keys = [g[0][0].prompt_key for g in groups]
    assert plans["lpt_history"] == plan_hosts(keys, len(groups[0]), case.predictor, 2)[0]
    tokens = [sum(n for _, n in g) for g in groups]
    true_loads = sorted(sum(tokens[q] for q in mine) for mine in plans["lpt_true"])
    assert true_loads[-1] <= max(sum(tokens[q] for q in mine) for mine in plans["slices"])


def test_measure_sums_rounds_and_one_host_per_prompt_leaves_nothing_to_balance():
  cases = grpo_cases(RUN)[:4]
  table = StepTimeTable.builtin("cpu")
  two = host_balance.measure(cases, 2, table, 0.0)
  assert [two[p][2] for p in host_balance.PLANS] == [4, 4, 4]
  assert two["slices"][3] == 0 and all(r >= 1.0 for p in two for r in two[p][1])
  four = host_balance.measure(cases, 4, table, 0.0)  # a round has 4 prompts: one per host
  assert len({round(four[p][0], 6) for p in host_balance.PLANS}) == 1
  assert np.allclose(four["slices"][1], four["lpt_true"][1])
  assert host_balance.measure(cases, 3, table, 0.0)["slices"][2] == 0  # 3 does not divide 4


def test_a_run_without_recordings_is_a_one_line_error_naming_the_flag(tmp_path):
  with pytest.raises(SystemExit, match=r"^--run .*: no e\*_s\*_r\*_p\*\.npz recordings$"):
    host_balance.main(["--run", str(tmp_path), "--no_append"])
