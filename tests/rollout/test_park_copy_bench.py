"""bench/park_copy.py: a tiny real run (SmolLM2-135M's KV shape, a short cache) and its
one-line errors for bad flags."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import park_copy  # noqa: E402


def test_times_both_ways_per_pool_size(capsys):
  assert park_copy.main(["--pool_rows", "2,4", "--batch", "2", "--cache_len", "8", "--reps", "1",
                         "--no_append"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 2 ") or
          line.startswith("| 4 ")]
  assert len(rows) == 2
  for row in rows:  # queued and waited ms per yield: positive numbers
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3]) > 0 and float(cells[4]) > 0


@pytest.mark.parametrize("argv, flag", [(["--pool_rows", "8,x"], "--pool_rows"),
                                        (["--pool_rows", "0"], "--pool_rows"),
                                        (["--batch", "0"], "--batch"),
                                        (["--reps", "-1"], "--reps")])
def test_bad_flags_fail_naming_the_flag(argv, flag, capsys):
  with pytest.raises(SystemExit):
    park_copy.main(argv + ["--no_append"])
  assert flag in capsys.readouterr().err
