"""bench/bucket_moves.py's flags: a bad value is one line naming the flag, before any model is
loaded."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import bucket_moves  # noqa: E402


@pytest.mark.parametrize("flag", ["num_prompts", "group_size", "slots", "max_new_tokens",
                                  "multi_step", "repeats"])
def test_bad_flag_is_one_line_naming_it(flag, capsys):
  with pytest.raises(SystemExit):
    bucket_moves.parse_args([f"--{flag}=0"])
  assert f"--{flag}=0: must be >= 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_negative_compile_threads_is_one_line(capsys):
  with pytest.raises(SystemExit):
    bucket_moves.parse_args(["--compile_threads=-1"])
  assert "--compile_threads=-1: must be >= 0" in capsys.readouterr().err.strip().splitlines()[-1]


def test_good_flags_parse():
  args = bucket_moves.parse_args(["--slots=32", "--multi_step=4", "--repeats=1"])
  assert (args.slots, args.multi_step, args.repeats) == (32, 4, 1)
