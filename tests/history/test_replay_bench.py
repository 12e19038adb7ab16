"""bench/replay.py's flags: a count below 1 (--epochs_kept, the trainer's --history_epochs,
among them) is one line naming the flags, before any recording is read."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import replay  # noqa: E402


@pytest.mark.parametrize("flag", ["--epochs_kept=0", "--budget=0", "--live_rows=-1"])
def test_a_count_below_one_is_one_line_naming_the_flags(flag, capsys):
  with pytest.raises(SystemExit):
    replay.parse_args(["--settings=", "--grpo_dir=unused", flag])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--budget, --live_rows, --repeats and --epochs_kept must be >= 1" in err


def test_epochs_kept_parses():
  assert replay.parse_args(["--settings=", "--grpo_dir=d", "--epochs_kept=2"]).epochs_kept == 2
  assert replay.parse_args(["--settings=", "--grpo_dir=d"]).epochs_kept == 1
