"""bench/yield_cost.py: a real run of this tree (tiny random model) prints one row of positive
host times, the admission choice among them."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import yield_cost  # noqa: E402


def test_one_row_of_positive_host_times(capsys):
  yield_cost.main(["--no_append"])
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("| code"))
  assert "admission choice" in header
  rows = [line for line in out.splitlines() if line.startswith("| this tree")]
  assert len(rows) == 1
  cells = [c.strip() for c in rows[0].strip("|").split("|")]
  assert len(cells) == 13
  for time_us, ratio in zip(cells[1::2], cells[2::2]):  # each time and its ratio to itself
    assert float(time_us) > 0 and float(ratio) == 1.0
