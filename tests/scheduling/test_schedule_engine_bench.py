"""bench/schedule_engine.py's flags: a bad value is one line naming the flag, before any model
is loaded."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import schedule_engine  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--compile_threads=-1"], "--compile_threads=-1: must be >= 0"),
    (["--park_rows=-2"], "--park_rows=-2: must be >= 0"),
    (["--slots=0"], "--slots=0: must be >= 1"),
    (["--policies=fifo,lifo"], "--policies: 'lifo' is not one of"),
])
def test_bad_flag_is_one_line_naming_it(argv, message, capsys):
  with pytest.raises(SystemExit):
    schedule_engine.parse_args(argv)
  assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_good_flags_parse():
  args = schedule_engine.parse_args(["--compile_threads=8", "--policies=fifo,oracle"])
  assert args.compile_threads == 8 and args.policies == ["fifo", "oracle"]


def test_excess_by_event_splits_wall_time_beyond_warm_up_by_what_came_before():
  """Each step's interval (previous outputs to its own) minus its shape's warm-up time lands
  in one bin: after prefill (the first step, or new requests admitted, yields or not), after
  yields only (parks or resumes, no prefill), or plain."""
  warm = {"a": 1.0, "b": 2.0}
  timeline = [(1.5, "a", 0, 0, 0, 0.5),    # first step: prefill, +0.5
              (2.5, "a", 0, 0, 0, 0.1),    # plain, 0
              (4.75, "b", 2, 0, 1, 0.4),   # yields only, +0.25
              (6.0, "a", 1, 3, 0, 0.3),    # prefill with a yield: prefill, +0.25
              (6.9, "a", 0, 0, 0, 0.2)]    # plain, -0.1
  got = schedule_engine.excess_by_event(timeline, warm)
  assert got == pytest.approx(dict(plain=-0.1, prefill=0.75, yields=0.25))
  host = schedule_engine.host_by_event(timeline)
  assert host == pytest.approx(dict(plain=0.15, prefill=0.4, yields=0.4))
  assert np.isnan(schedule_engine.host_by_event(timeline[:2])["yields"])
