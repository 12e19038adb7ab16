"""EpochStats: per-data-epoch sums of a GRPO run's rollout counters, restartable."""

import json

import pytest

from rhyme_jax.rl.epoch_stats import EpochStats


def step(tokens, slot_steps, drafted, accepted, steps, spec_steps, asked_steps=None):
  return dict(tokens=tokens, useful_slot_steps=slot_steps, drafted=drafted, accepted=accepted,
              steps=steps, spec_steps=spec_steps,
              asked_steps=spec_steps if asked_steps is None else asked_steps)


def test_sums_within_an_epoch_and_restarts_at_the_next():
  e = EpochStats()
  m = e.update(0, step(10, 10, 0, 0, 5, 0), [1.0, 0.0], [4, 6])
  assert m["epoch/index"] == 0 and m["epoch/accepted_length"] == 1.0
  assert m["epoch/hit_rate"] == 0.0 and m["epoch/reward"] == 0.5
  m = e.update(0, step(30, 10, 40, 20, 5, 5, asked_steps=7), [1.0, 1.0], [10, 20])
  assert m["epoch/accepted_length"] == pytest.approx(40 / 20)  # over the epoch, not the step
  assert m["epoch/hit_rate"] == pytest.approx(20 / 40)
  assert m["epoch/drafted_per_step"] == pytest.approx(40 / 20)
  assert m["epoch/spec_step_frac"] == pytest.approx(5 / 10)
  assert m["epoch/asked_step_frac"] == pytest.approx(7 / 10)
  assert m["epoch/reward"] == pytest.approx(3 / 4)
  assert m["epoch/response_length"] == pytest.approx(40 / 4)
  m = e.update(1, step(8, 4, 4, 4, 4, 4), [0.0], [8])
  assert m["epoch/index"] == 1 and m["epoch/accepted_length"] == 2.0
  assert m["epoch/reward"] == 0.0 and m["epoch/response_length"] == 8.0


def test_state_round_trips_through_json_and_resumes_the_same_figures():
  a = EpochStats()
  a.update(2, step(30, 10, 40, 20, 5, 5), [1.0, 0.5], [10, 20])
  b = EpochStats()
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as the checkpoint stores it
  nxt = (2, step(5, 5, 0, 0, 5, 0), [0.0], [5])
  assert b.update(*nxt) == a.update(*nxt)


def test_a_checkpoint_without_sums_starts_fresh():
  e = EpochStats()
  e.load_state_dict(None)
  assert e.update(0, {}, [], [])["epoch/accepted_length"] == 0.0
