"""bench/engine_overhead.py's flags: a bad value is one line naming the flag, before any model
is built."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import engine_overhead  # noqa: E402


@pytest.mark.parametrize("flag, message", [
    ("--top_p=0", "--top_p=0.0: must be in (0, 1]"),
    ("--top_p=1.5", "--top_p=1.5: must be in (0, 1]"),
    ("--multi_step=0", "--multi_step=0: must be in [1, 64]"),
])
def test_bad_flag_is_one_line_naming_it(flag, message, capsys):
  with pytest.raises(SystemExit):
    engine_overhead.parse_args([flag])
  assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_flags_parse():
  args = engine_overhead.parse_args(["--buckets=32", "--budgets=0", "--top_p=0.95"])
  assert args.buckets == (32,) and args.budgets == (0,) and args.top_p == 0.95
  assert engine_overhead.parse_args([]).top_p == 1.0
