"""CostModel: the shape choice follows measured step times and calibrated draft values."""

import numpy as np
import pytest

from rhyme_jax.rollout.cost_model import CostModel

S = 64
PLAIN, SPEC = (4, 4, 1, S), (4, 12, 3, S)  # room for two nodes per row


def model():
  m = CostModel()
  m.observe_time(PLAIN, 1.0, warmup=True)
  m.observe_time(SPEC, 1.5, warmup=True)
  return m


def choose(m, rids, probs):
  values = [m.node_values(r, np.array([1, 2]), np.array(probs)) for r in rids]
  return m.choose(PLAIN, [SPEC], values, len(rids))


def test_overconfident_drafts_are_calibrated_down_to_plain_steps():
  """A drafter that claims certainty for drafts that always fail: speculation is tried while
  the prior trusts it, then the calibration falls and steps are plain."""
  m, rids = model(), [0, 1, 2, 3]
  shape, take, _ = choose(m, rids, [1.0, 1.0])
  assert shape == SPEC and take == [2, 2, 2, 2]  # prior 0.5: +4 tokens for 1.5x the time
  for _ in range(3):
    for r in rids:
      m.observe_acceptance(r, depth=2, accepted=0, offered_D=np.array([1.0, 1.0]))
  assert m.calibration(0)[0] < 0.2
  shape, take, _ = choose(m, rids, [1.0, 1.0])
  assert shape == PLAIN and take == [0, 0, 0, 0]
  # A new request starts from the prior of all requests: distrusted too.
  assert choose(m, [9, 10, 11, 12], [1.0, 1.0])[0] == PLAIN


def test_right_drafts_keep_their_value_and_the_speculative_shape():
  m, rids = model(), [0, 1, 2, 3]
  for _ in range(5):
    for r in rids:
      m.observe_acceptance(r, depth=2, accepted=2, offered_D=np.array([1.0, 1.0]))
  assert m.calibration(0, 2) == pytest.approx([1.0, 1.0], abs=0.1)
  assert choose(m, rids, [1.0, 1.0])[0] == SPEC
  # Only its own history moves a request away from the prior.
  m.observe_acceptance(7, depth=2, accepted=0, offered_D=np.array([1.0, 1.0]))
  assert m.calibration(7)[0] < m.calibration(0)[0]
  m.forget(7)
  assert m.calibration(7)[0] == m.calibration(99)[0]


def test_alpha_values_without_drafter_probabilities():
  m = model()
  for _ in range(20):
    m.observe_acceptance(0, depth=3, accepted=3)
  v = m.node_values(0, np.array([1, 2, 3]), None)
  assert np.all(np.diff(v) < 0) and v[0] > 0.8  # alpha ** depth, alpha near 1


def test_deep_nodes_are_calibrated_by_their_own_depth():
  """Chains the drafter is sure of (probability 1 at every depth) whose first node is accepted
  half the time and whose deeper nodes never are: depth 1 keeps about half its value, depth 3
  loses nearly all of it (one factor for all depths would value both at a third)."""
  m = model()
  for i in range(200):
    m.observe_acceptance(i, depth=3, accepted=i % 2, offered_D=np.ones(3))
  v = m.node_values(1000, np.array([1, 2, 3]), np.ones(3))
  assert v[0] == pytest.approx(0.5, abs=0.1)
  assert v[2] < 0.1 and v[1] < 0.1


def test_a_request_that_beats_the_shared_ratio_is_valued_higher():
  m = model()
  for i in range(100):
    m.observe_acceptance(i, depth=1, accepted=0, offered_D=np.ones(1))
    m.observe_acceptance(i + 1000, depth=1, accepted=1, offered_D=np.ones(1))
  for _ in range(20):
    m.observe_acceptance(7, depth=1, accepted=1, offered_D=np.ones(1))
  assert m.node_values(7, np.array([1]), np.ones(1))[0] > 0.8
  assert m.node_values(8, np.array([1]), np.ones(1))[0] == pytest.approx(0.5, abs=0.1)


def test_a_shape_not_observed_lately_follows_the_machine_speed():
  """The machine slows down 2x (another job starts) while only plain steps run: the
  speculative shape's warm-up time, never observed since, slows with them, so the choice
  between the two stays what it was."""
  m = model()
  for _ in range(30):
    m.observe_time(PLAIN, 2.0)
  assert m.time(PLAIN) == pytest.approx(2.0, rel=0.01)
  assert m.time(SPEC) == pytest.approx(3.0, rel=0.01)
  m.observe_time(SPEC, 2.4)  # observed: its own time (at the speed it was observed at)
  assert m.time(SPEC) == pytest.approx(0.75 * 3.0 + 0.25 * 2.4, rel=0.01)
  for _ in range(30):
    m.observe_time(PLAIN, 1.0)  # the other job ends
  assert m.time(SPEC) == pytest.approx((0.75 * 3.0 + 0.25 * 2.4) / 2, rel=0.02)


def test_chosen_steps_that_accept_less_than_expected_scale_gains_down():
  """The winner's curse: steps chosen for their estimates accept half what was expected of
  them; the same estimates then no longer buy a speculative step."""
  m, values = model(), [np.array([0.4, 0.3])] * 4
  assert m.choose(PLAIN, [SPEC], values, 4)[0] == SPEC  # (4 + 2.8) / 1.5 > 4 / 1
  for i in range(200):
    m.observe_acceptance(i, depth=2, accepted=i % 2, expected=1.0)
  assert m.gain_scale == pytest.approx(0.5, abs=0.05)
  assert m.choose(PLAIN, [SPEC], values, 4)[0] == PLAIN  # (4 + 1.4) / 1.5 < 4 / 1
  # Rows the step did not verify (depth <= 0) say nothing about it.
  m.observe_acceptance(999, depth=0, accepted=0, expected=5.0)
  assert m.gain_scale == pytest.approx(0.5, abs=0.05)


def test_asking_that_delivers_nothing_stops_and_is_retried_later():
  """The asking decision's scale falls with asked steps that accepted nothing, until chains at
  the prior no longer pay, and recovers toward 1 as steps go by unasked (a drafter may improve)."""
  m = model()
  values = [np.array([0.5, 0.25])] * 4
  assert m.choose(PLAIN, [SPEC], values, 4, scale=m.ask_scale)[0] == SPEC  # (4 + 3) / 1.5 > 4
  asks = 0
  while m.choose(PLAIN, [SPEC], values, 4, scale=m.ask_scale)[0] == SPEC:
    m.observe_asked(3.0, 0)
    asks += 1
  assert 1 <= asks <= 3 and m.ask_scale < 0.67
  idle = 0
  while m.choose(PLAIN, [SPEC], values, 4, scale=m.ask_scale)[0] == PLAIN:
    m.not_asked()
    idle += 1
  assert 20 <= idle <= 1000  # asked again, after a while
  m.observe_asked(3.0, 3)  # asking that delivers what it expected keeps its scale near 1
  assert m.ask_scale > 0.67
