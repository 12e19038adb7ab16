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
      m.observe_acceptance(r, depth=2, accepted=0, offered=2.0)
  assert m.calibration(0) < 0.2
  shape, take, _ = choose(m, rids, [1.0, 1.0])
  assert shape == PLAIN and take == [0, 0, 0, 0]
  # A new request starts from the prior of all requests: distrusted too.
  assert choose(m, [9, 10, 11, 12], [1.0, 1.0])[0] == PLAIN


def test_right_drafts_keep_their_value_and_the_speculative_shape():
  m, rids = model(), [0, 1, 2, 3]
  for _ in range(5):
    for r in rids:
      m.observe_acceptance(r, depth=2, accepted=2, offered=2.0)
  assert m.calibration(0) == pytest.approx(1.0, abs=0.1)
  assert choose(m, rids, [1.0, 1.0])[0] == SPEC
  # Only its own history moves a request away from the prior.
  m.observe_acceptance(7, depth=2, accepted=0, offered=2.0)
  assert m.calibration(7) < m.calibration(0)
  m.forget(7)
  assert m.calibration(7) == m.calibration(99)


def test_alpha_values_without_drafter_probabilities():
  m = model()
  for _ in range(20):
    m.observe_acceptance(0, depth=3, accepted=3)
  v = m.node_values(0, np.array([1, 2, 3]), None)
  assert np.all(np.diff(v) < 0) and v[0] > 0.8  # alpha ** depth, alpha near 1
