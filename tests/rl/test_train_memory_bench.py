"""bench/train_memory.py: a real compile of SmolLM2-135M's update (slow) and its one-line
errors for bad flags."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import train_memory  # noqa: E402


@pytest.mark.slow  # compiles SmolLM2-135M's update four times (~1 min on 2 cores)
def test_remat_cuts_what_the_compiled_update_holds(capsys):
  train_memory.main(["--rows", "4", "--seqs", "256", "--no_append"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 ")]
  temp = {}
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    temp[cells[1]] = float(cells[3])
    assert 0.8 < float(cells[5]) < 1.6  # the estimate near XLA's count, on the safe side
  assert set(temp) == {"no", "yes"} and temp["yes"] < temp["no"]


@pytest.mark.parametrize("argv, flag", [(["--rows", "3"], "--rows"), (["--seqs", "64"], "--seqs"),
                                        (["--seqs", "1k"], "--seqs")])
def test_bad_flags_fail_naming_the_flag(argv, flag, capsys):
  with pytest.raises(SystemExit):
    train_memory.main(argv + ["--no_append"])
  assert flag in capsys.readouterr().err
