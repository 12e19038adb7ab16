"""bench/pack_host.py: a tiny real run against a checkout (this one), same layouts reported,
and its one-line errors for bad flags."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import pack_host  # noqa: E402
from rhyme_jax.rollout import accept  # noqa: E402


def test_trees_are_valid_drafts_of_the_asked_shape():
  trees = pack_host.history_like_trees(4, 16)
  assert len(trees) == 4
  for toks, pars in trees:
    assert len(toks) == len(pars) == 16
    assert all(-1 <= p < j for j, p in enumerate(pars))  # a tree: parents come first
  packed = accept.pack(trees, [True] * 4, 4 * 17)
  assert int(packed.depth_P.max()) >= 10  # the chain


def test_compares_a_checkout_with_this_tree(capsys):
  pack_host.main(["--old", ROOT, "--reps", "1", "--rounds", "1", "--no_append"])
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("| ") and line[2].isdigit()]
  assert len(rows) == len(pack_host.SHAPES)
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[4]) > 0
    assert cells[7] == "yes" and np.isfinite(float(cells[6]))


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--rounds", "0"]])
def test_bad_flags_fail_naming_the_flag(argv, capsys):
  with pytest.raises(SystemExit):
    pack_host.main(argv + ["--no_append"])
  assert argv[0] in capsys.readouterr().err
