"""bench/schedule_engine.py's flags: a bad value is one line naming the flag, before any model
is loaded."""

import os
import sys

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
