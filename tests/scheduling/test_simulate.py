"""The rollout simulator: hand-computed schedules, invariants (everything finishes, tokens are
conserved, utilisation <= 1) over policies and configurations, the step-time table, and the
divided rollout moving work off a loaded shard."""

import dataclasses
import json

import os
import sys

import numpy as np
import pytest

from rhyme_jax.scheduling.admission import POLICIES, RequestMeta, make_policy
from rhyme_jax.scheduling.assignment import plan_shards
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable
from rhyme_jax.scheduling.simulate import DividedRollout, SimConfig, simulate, tail_time
from rhyme_jax.scheduling.step_time import StepTimeTable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))
from schedsim_bounds import ClairvoyantResidual  # noqa: E402  (LRPT on the true lengths)

FLAT = StepTimeTable({(1, 0): 1.0, (64, 0): 1.0})


def _jobs(lengths, group_size=1, prompt_len=0):
  return [(RequestMeta(i, i // group_size, f"p{i // group_size}", i, 4096, prompt_len), n)
          for i, n in enumerate(lengths)]


def _truth(jobs):
  return {m.request_id: n for m, n in jobs}


def test_hand_computed_schedules():
  cfg = SimConfig(slots=2, buckets=(2, 1))
  jobs = _jobs([1, 1, 1, 3])
  fifo = simulate(jobs, lambda: make_policy("fifo"), FLAT, cfg)
  # Steps: {0,1} -> both done; {2,3}; 2 done, 3 alone for two more steps: ends at 4.
  assert list(fifo.finish_ms) == [1.0, 1.0, 2.0, 4.0] and fifo.steps == 4
  oracle = simulate(jobs, lambda: make_policy("oracle", true_lengths=_truth(jobs)), FLAT, cfg)
  assert oracle.makespan_ms == 3.0  # 3 first, the three 1s beside it
  assert tail_time(np.array([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 20])) == 11.0


def test_pipelining_refills_a_slot_one_launch_late():
  jobs = _jobs([3, 2])
  fifo = lambda: make_policy("fifo")
  at_once = simulate(jobs, fifo, FLAT, SimConfig(slots=1, buckets=(1,)))
  assert list(at_once.finish_ms) == [3.0, 5.0]
  # The engine reads step 3 (where 0 ended) after dispatching step 4, which runs the finished
  # row for nothing; 1 is admitted into step 5 and, nothing left waiting, read at once.
  piped = simulate(jobs, fifo, FLAT, SimConfig(slots=1, buckets=(1,), pipeline=True))
  assert list(piped.finish_ms) == [3.0, 6.0] and piped.steps == piped.launches == 6
  assert piped.utilisation == pytest.approx(5 / 6)


def test_launches_of_several_steps_hold_rows_to_their_end_and_respect_caps():
  fifo = lambda: make_policy("fifo")
  cfg = SimConfig(slots=1, buckets=(1,), multi_step=4)
  # 0 ends 2 steps into the second launch and holds its row to the launch's end (step 8);
  # 1 runs a whole launch with nothing waiting (a cap of 4096 leaves room).
  res = simulate(_jobs([6, 2]), fifo, FLAT, cfg)
  assert list(res.finish_ms) == [8.0, 12.0] and (res.steps, res.launches) == (12, 3)
  # On the step clock each ends with the step that computed its last token: 6, then 8 + 2.
  assert list(res.step_finish_ms) == [6.0, 10.0]
  # With drain_single_step, 1 runs one-step launches once nothing waits: read at step 10.
  drain = simulate(_jobs([6, 2]), fifo, FLAT, dataclasses.replace(cfg, drain_single_step=True))
  assert list(drain.finish_ms) == [8.0, 10.0] and (drain.steps, drain.launches) == (10, 4)
  # With a request waiting, a row 1 token from its cap runs a one-step launch (loop's rule).
  capped = [(RequestMeta(i, i, f"p{i}", i, 5), n) for i, n in enumerate([5, 1])]
  res = simulate(capped, fifo, FLAT, cfg)
  assert list(res.finish_ms) == [5.0, 9.0] and (res.steps, res.launches) == (9, 3)
  with pytest.raises(ValueError, match="multi_step=0"):
    SimConfig(multi_step=0)


def test_bucket_shrinking_and_speculation_follow_the_table():
  table = StepTimeTable({(1, 0): 1.0, (2, 0): 2.0, (1, 4): 1.5, (2, 4): 5.0})
  jobs = _jobs([4, 1])
  fifo = lambda: make_policy("fifo")
  shrink = simulate(jobs, fifo, table, SimConfig(slots=2, buckets=(2, 1)))
  assert shrink.makespan_ms == 2.0 + 3 * 1.0  # one step of 2 rows, then 1 row
  fixed = simulate(jobs, fifo, table, SimConfig(slots=2, buckets=(2, 1), shrink=False))
  assert fixed.makespan_ms == 4 * 2.0
  # Accepted length 2 at budget 4: worth it at 1 row (1.5 / 2 < 1), not at 2 (5 / 2 > 2).
  spec = simulate(jobs, fifo, table, SimConfig(slots=2, buckets=(2, 1), accepted=((4, 2.0),)))
  assert spec.makespan_ms == 2.0 + 1.5 + 1.5 and spec.spec_steps == 2
  assert spec.tokens == 5


@pytest.mark.parametrize("launch", [(1, False), (4, True)])  # (multi_step, pipeline)
@pytest.mark.parametrize("divided", [0, 7])
@pytest.mark.parametrize("shards", [1, 3])
def test_every_request_finishes_and_tokens_are_conserved(shards, divided, launch):
  rng = np.random.default_rng(shards * 10 + divided)
  lengths = rng.integers(1, 120, size=96)
  jobs = _jobs(lengths, group_size=8, prompt_len=20)
  table = StepTimeTable({(1, 0): 2.0, (16, 0): 9.0, (1, 8): 2.5, (16, 8): 20.0})
  history = LengthTable()
  for g in range(12):
    history.add(f"p{g}", 0, lengths[8 * g:8 * g + 8] + rng.integers(-20, 20, 8).clip(0))
  pred = LengthPredictor(history)
  plan = plan_shards([m for m, _ in jobs], pred, shards)
  cfg = SimConfig(slots=16, buckets=(16, 8, 4, 2, 1), shards=shards, prefill_ms_per_token=0.5,
                  accepted=((8, 1.8),), divided=DividedRollout(divided),
                  multi_step=launch[0], pipeline=launch[1])
  for name in POLICIES:
    res = simulate(jobs, lambda: make_policy(name, predictor=pred, step=1, seed=1,
                                             true_lengths=_truth(jobs)), table, cfg, plan)
    assert res.tokens == pytest.approx(lengths.sum())
    assert np.all(res.finish_ms > 0) and res.makespan_ms == res.finish_ms.max()
    assert 0 < res.utilisation <= 1 and res.launches <= res.steps
    assert res.prefill_tokens >= 20 * len(jobs)
    # No request finishes before its own tokens could have been generated.
    fastest = min(table.ms(1, 0), table.ms(1, 8) / 1.8)
    assert np.all(res.finish_ms >= np.ceil(lengths / 1.8) * fastest - 1e-9)
    # The step clock is never later than the launch clock, and the same at one step a launch.
    assert np.all(res.step_finish_ms <= res.finish_ms + 1e-9)
    assert np.all(res.step_finish_ms >= np.ceil(lengths / 1.8) * fastest - 1e-9)
    if launch[0] == 1:
      np.testing.assert_array_equal(res.step_finish_ms, res.finish_ms)


def test_divided_rollout_moves_work_off_a_loaded_shard():
  # Step time grows with the bucket: a tail spread over two shards runs in smaller buckets.
  linear = StepTimeTable({(1, 0): 1.0, (4, 0): 4.0})
  jobs = _jobs([200] * 4 + [100] * 4, group_size=4)
  plan = {0: 0, 1: 1}  # shard 0 gets the long group, shard 1 the short one
  fifo = lambda: make_policy("fifo")
  whole = simulate(jobs, fifo, linear, SimConfig(slots=4, buckets=(4, 2, 1), shards=2), plan)
  divided = simulate(jobs, fifo, linear,
                     SimConfig(slots=4, buckets=(4, 2, 1), shards=2,
                               divided=DividedRollout(20)), plan)
  assert whole.makespan_ms == 800.0 and whole.migrations == 0
  assert divided.migrations > 0 and divided.makespan_ms < 0.85 * whole.makespan_ms
  assert divided.tokens == whole.tokens


class _AlwaysYield:
  """An online order whose rule gives every asked request's slot away; counts the rules made."""

  online = True

  def __init__(self):
    self.rules = 0

  def order(self, queue):
    return list(queue)

  def next_to_admit(self, queue, finished, live):
    return 0

  def yield_rule(self, queue, finished, live, chunk, free=0):
    self.rules += 1
    return lambda running: True


def test_divided_rollout_asks_once_per_step_while_more_wait_than_slots_free():
  """As rollout/divided.py asks: one rule per step for every request asked in it, and only
  while the queue holds more requests than slots are free, so with one request waiting each
  step that yields gives up one slot, not all four that reached their chunk."""
  policy = _AlwaysYield()
  res = simulate(_jobs([6] * 5), lambda: policy, FLAT,
                 SimConfig(slots=4, buckets=(4, 2, 1), divided=DividedRollout(2, yield_ms=0.5)))
  assert res.yields == res.yield_passes == policy.rules > 0
  assert res.tokens == 30 and res.makespan_ms == res.steps * 1.0 + 0.5 * res.yields


def test_each_yield_in_the_simulator_gives_way_to_a_queued_request_of_its_own():
  """A and B (10 tokens) run, C (9) and D (1) wait; chunk 2. At 2 tokens both have 8 left and
  only C is longer: A yields to it and B stays (before, both yielded for C and A came straight
  back). Hand-computed: every pass after yields one request to the one longer queued request,
  six yields in all, and the rollout ends at the 15 steps its 30 tokens need on 2 slots."""
  jobs = _jobs([10, 10, 9, 1])
  res = simulate(jobs, lambda: ClairvoyantResidual(_truth(jobs)), FLAT,
                 SimConfig(slots=2, buckets=(2, 1), divided=DividedRollout(2)))
  assert (res.yields, res.yield_passes) == (6, 6)
  assert res.makespan_ms == 15.0 and list(res.finish_ms) == [14.0, 14.0, 15.0, 15.0]


def test_step_time_table_interpolates_and_rejects_bad_input(tmp_path):
  t = StepTimeTable({(1, 0): 2.0, (9, 0): 10.0, (1, 8): 4.0, (9, 8): 20.0})
  assert t.ms(5, 0) == pytest.approx(6.0) and t.ms(5, 4) == pytest.approx(9.0)
  assert t.ms(17, 0) == pytest.approx(18.0)  # extrapolated past the largest bucket
  noisy = StepTimeTable({(1, 0): 3.0, (8, 0): 2.0})
  assert noisy.ms(8, 0) == 3.0  # a larger bucket never runs faster
  with pytest.raises(ValueError, match=r"missing \(bucket=9, budget=8\)"):
    StepTimeTable({(1, 0): 1.0, (9, 0): 2.0, (1, 8): 3.0})
  with pytest.raises(ValueError, match="beyond the measured"):
    t.ms(1, 16)
  path = tmp_path / "steps.json"
  path.write_text(json.dumps([{"bucket": 1, "budget": 0, "ms": 1.5}]))
  assert StepTimeTable.load(str(path)).ms(4, 0) == 1.5
  path.write_text(json.dumps([{"bucket": 1, "ms": 1.5}]))
  with pytest.raises(ValueError, match="steps.json"):
    StepTimeTable.load(str(path))
  with pytest.raises(ValueError, match="slots=3"):
    SimConfig(slots=3, buckets=(4, 1))
