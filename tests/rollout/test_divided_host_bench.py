"""bench/divided_host.py's flags: a bad value is one line naming the flag, before any model is
built."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import divided_host  # noqa: E402


@pytest.mark.parametrize("flag", ["--rounds=0", "--divide_every=-3"])
def test_bad_flag_is_one_line_naming_it(flag, capsys):
  with pytest.raises(SystemExit):
    divided_host.parse_args([flag])
  assert f"{flag}: must be >= 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_negative_yield_cost_is_one_line_naming_it(capsys):
  with pytest.raises(SystemExit):
    divided_host.parse_args(["--yield_steps=-0.5"])
  assert "--yield_steps=-0.5: must be >= 0" in capsys.readouterr().err.strip().splitlines()[-1]


def test_defaults_parse():
  args = divided_host.parse_args([])
  assert args.rounds == 5 and args.divide_every == 16 and not args.no_append
  assert args.yield_steps == 0.08 and not args.old
  assert args.multi_step == [1]


@pytest.mark.parametrize("argv, message", [
    (["--multi_step=1,x"], "--multi_step=1,x: expected a comma list of integers"),
    (["--multi_step=1,65"], "--multi_step=1,65: each must be in [1, 64]"),
    (["--multi_step=1,4", "--old=/tmp"], "--multi_step: only 1 with --old"),
])
def test_a_bad_multi_step_list_is_one_line_naming_it(argv, message, capsys):
  with pytest.raises(SystemExit):
    divided_host.parse_args(argv)
  assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_multi_step_lists_parse():
  assert divided_host.parse_args(["--multi_step=1,4,8"]).multi_step == [1, 4, 8]
