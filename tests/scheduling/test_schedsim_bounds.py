"""bench/schedsim_bounds.py: the references divided rollout is measured against."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import schedsim_bounds  # noqa: E402
from rhyme_jax.scheduling.admission import RequestMeta, make_policy  # noqa: E402
from rhyme_jax.scheduling.simulate import DividedRollout, SimConfig, simulate  # noqa: E402
from rhyme_jax.scheduling.step_time import StepTimeTable  # noqa: E402

FLAT = StepTimeTable({(b, 0): 1.0 for b in (1, 2, 4, 8)}, "flat")


def _jobs(rng, prompts=6, group=4):
  return [(RequestMeta(p * group + j, p, f"k{p}", p * group + j, 512), int(n))
          for p in range(prompts) for j, n in enumerate(rng.integers(1, 60, group))]


@pytest.mark.parametrize("seed", range(4))
def test_clairvoyant_lrpt_reaches_the_preemptive_optimum(seed):
  # With a one-token quantum and free yields, LRPT on true lengths is optimal for identical
  # machines with preemption: max(longest, ceil(total / slots)) decode steps (McNaughton).
  jobs = _jobs(np.random.default_rng(seed))
  truth = {m.request_id: n for m, n in jobs}
  lengths = np.array(list(truth.values()))
  cfg = SimConfig(slots=8, buckets=(8,), shrink=False, divided=DividedRollout(1))
  res = simulate(jobs, lambda: schedsim_bounds.ClairvoyantResidual(truth), FLAT, cfg)
  assert res.steps == max(lengths.max(), -(-lengths.sum() // 8))
  assert res.yields > 0
  oracle = simulate(jobs, lambda: make_policy("oracle", true_lengths=truth), FLAT, cfg)
  assert res.steps <= oracle.steps


def test_clairvoyant_without_preemption_is_the_oracle():
  # A chunk longer than every response never offers a yield: longest first on true lengths.
  jobs = _jobs(np.random.default_rng(7))
  truth = {m.request_id: n for m, n in jobs}
  cfg = SimConfig(slots=8, buckets=(8, 4, 2, 1), divided=DividedRollout(100))
  res = simulate(jobs, lambda: schedsim_bounds.ClairvoyantResidual(truth), FLAT, cfg)
  oracle = simulate(jobs, lambda: make_policy("oracle", true_lengths=truth), FLAT, cfg)
  assert (res.makespan_ms, res.yields) == (oracle.makespan_ms, 0)


def test_own_lengths_predictor_reads_the_step_itself():
  jobs = _jobs(np.random.default_rng(3))
  case = schedsim_bounds.StepCase("t", 1, 2, jobs, predictor=None, table=None)
  pred = schedsim_bounds.own_lengths_predictor(case)
  for p in range(6):
    own = [n for m, n in jobs if m.group_id == p]
    assert pred.predict(f"k{p}").length == pytest.approx(np.mean(own))
    # a fresh request's expected length: its prompt's own mean shrunk toward every prompt's
    every = np.mean([n for _, n in jobs])
    k = pred.residual_prior
    assert pred.remaining_tokens(f"k{p}", 0, 512) == pytest.approx(
        (np.sum(own) + k * every) / (len(own) + k))
  bounds = schedsim_bounds.divided_bounds(
      [schedsim_bounds.StepCase("t", 1, 2, jobs, predictor=pred, table=pred.source)], FLAT,
      SimConfig(slots=8, buckets=(8, 4, 2, 1), divided=DividedRollout(1)), yield_cost=0.0)
  # history_residual given the step's own lengths as history is the own-lengths reference (and
  # the rescaled one: a factor of 1);
  # at a one-token quantum with free yields the clairvoyant one is optimal, so no worse
  assert bounds["history_residual"] == bounds["own_lengths"] == bounds["rescaled_history"]
  assert bounds["clairvoyant"][0] <= bounds["own_lengths"][0]


def test_rescaled_history_is_the_step_when_every_prompt_drifted_alike():
  # Every length of the step is twice its prompt's history: the one factor (the step's mean
  # over its prompts' kept mean) is 2 and recovers the step; prompts outside it scale too.
  jobs = [(m, 2 * n) for m, n in _jobs(np.random.default_rng(5))]
  table = schedsim_bounds.LengthTable(epochs_kept=1)
  for p in range(6):
    table.add(f"k{p}", 1, [n // 2 for m, n in jobs if m.group_id == p])
  table.add("other", 1, [10, 20])
  case = schedsim_bounds.StepCase("t", 1, 2, jobs,
                                  predictor=schedsim_bounds.LengthPredictor(table), table=table)
  rescaled = schedsim_bounds.rescaled_predictor(case)
  assert dict(rescaled.source.epoch_lengths("other"))[1].tolist() == [20, 40]
  for p in range(6):
    assert (dict(rescaled.source.epoch_lengths(f"k{p}"))[1].tolist()
            == [n for m, n in jobs if m.group_id == p])
  # the reference is history_residual over that predictor
  cfg = SimConfig(slots=8, buckets=(8, 4, 2, 1), divided=DividedRollout(4))
  bounds = schedsim_bounds.divided_bounds([case], FLAT, cfg, yield_cost=0.0)
  direct = schedsim_bounds.divided_bounds(
      [schedsim_bounds.StepCase("t", 1, 2, jobs, predictor=rescaled, table=table)], FLAT, cfg,
      yield_cost=0.0)
  assert bounds["rescaled_history"] == direct["history_residual"]


def test_pooled_history_gives_every_prompt_the_step_prompts_lengths():
  # Prompts k0..k5 of the step with their own histories, and one outside the step: the pooled
  # predictor gives each step prompt all six histories together, and nothing of the outsider.
  rng = np.random.default_rng(11)
  jobs = _jobs(rng)
  table = schedsim_bounds.LengthTable(epochs_kept=1)
  for p in range(6):
    table.add(f"k{p}", 1, rng.integers(1, 60, 4))
  table.add("other", 1, [500, 500])
  case = schedsim_bounds.StepCase("t", 1, 2, jobs,
                                  predictor=schedsim_bounds.LengthPredictor(table), table=table)
  pooled = schedsim_bounds.pooled_predictor(case)
  every = np.concatenate([dict(table.epoch_lengths(f"k{p}"))[1] for p in range(6)])
  assert set(pooled.source.keys()) == {f"k{p}" for p in range(6)}
  for p in range(6):
    [(_, lengths)] = pooled.source.epoch_lengths(f"k{p}")
    assert sorted(lengths.tolist()) == sorted(every.tolist())
  for n in (0, 10, 40):  # the same expected remaining work for every prompt at every progress
    left = {pooled.remaining_tokens(f"k{p}", n, 512) for p in range(6)}
    assert len(left) == 1
    beyond = every[every > n]
    assert left.pop() == pytest.approx(beyond.mean() - n)
  # where every prompt's history already is the same, pooling changes nothing
  same = schedsim_bounds.LengthTable(epochs_kept=1)
  for p in range(6):
    same.add(f"k{p}", 1, [5, 20, 40, 7])
  case = schedsim_bounds.StepCase("t", 1, 2, jobs,
                                  predictor=schedsim_bounds.LengthPredictor(same), table=same)
  cfg = SimConfig(slots=8, buckets=(8, 4, 2, 1), divided=DividedRollout(4))
  bounds = schedsim_bounds.divided_bounds([case], FLAT, cfg, yield_cost=0.0)
  assert bounds["pooled_history"] == bounds["history_residual"]


def test_shuffled_within_groups_redraws_which_sample_ran_long():
  # Each group keeps its lengths and every request its meta; only which sample of a group got
  # which length changes, and over draws each sample gets more than one of them.
  rng = np.random.default_rng(5)
  jobs = _jobs(rng, prompts=5, group=4)
  seen = {m.request_id: set() for m, _ in jobs}
  for _ in range(20):
    shuffled = schedsim_bounds.shuffled_within_groups(jobs, rng)
    assert [m for m, _ in shuffled] == [m for m, _ in jobs]
    for g in range(5):
      assert (sorted(n for m, n in shuffled if m.group_id == g)
              == sorted(n for m, n in jobs if m.group_id == g))
    for m, n in shuffled:
      seen[m.request_id].add(n)
  assert all(len(lengths) > 1 for lengths in seen.values())
  # a group of one has nothing to shuffle
  single = _jobs(rng, prompts=5, group=1)
  assert schedsim_bounds.shuffled_within_groups(single, rng) == single
