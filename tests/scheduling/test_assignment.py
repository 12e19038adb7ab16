"""LPT shard assignment: Graham's bound against an exact optimum on random instances, its
tightness, and identical plans on simulated hosts (separate processes, shuffled inputs)."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rhyme_jax.scheduling.admission import RequestMeta
from rhyme_jax.scheduling.assignment import (assign_groups, lpt_assign, lpt_bound,
                                             optimal_makespan, plan_hosts, plan_shards,
                                             shard_loads)
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _makespan(work, m):
  return int(shard_loads(work, lpt_assign(work, m), m).max())


def test_exact_optimum_matches_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(60):
    m, n = int(rng.integers(2, 4)), int(rng.integers(1, 8))
    work = rng.integers(1, 30, size=n)
    brute = min(max(np.bincount(a, weights=work, minlength=m))
                for a in itertools.product(range(m), repeat=n))
    assert optimal_makespan(work, m) == int(brute)


def test_lpt_within_graham_bound_of_the_optimum_on_random_instances():
  rng = np.random.default_rng(1)
  worst = 0.0
  for trial in range(400):
    m = int(rng.integers(2, 5))
    n = int(rng.integers(m + 1, 11))
    # Mixed shapes: uniform, heavy-tailed, and near-equal jobs (where LPT is worst).
    kind = trial % 3
    if kind == 0:
      work = rng.integers(1, 100, size=n)
    elif kind == 1:
      work = np.ceil(rng.pareto(1.5, size=n) * 20 + 1).astype(np.int64)
    else:
      work = rng.integers(2 * m - 2, 2 * m + 3, size=n)
    opt = optimal_makespan(work, m)
    lpt = _makespan(work, m)
    assert opt <= lpt <= lpt_bound(m) * opt + 1e-9, (work, m, lpt, opt)
    worst = max(worst, lpt / opt)
  assert worst > 1.0  # the instances are hard enough that LPT is not always optimal


@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_graham_tight_instance_reaches_the_bound(m):
  work = np.array([2 * m - 1 - k // 2 for k in range(2 * m - 2)] + [m] * 3, np.int64)
  # Jobs 2m-1, 2m-1, 2m-2, 2m-2, ..., m+1, m+1, m, m, m: LPT = 4m - 1, OPT = 3m.
  assert optimal_makespan(work, m) == 3 * m
  assert _makespan(work, m) == 4 * m - 1
  assert _makespan(work, m) / optimal_makespan(work, m) == pytest.approx(lpt_bound(m))


def test_assignment_depends_on_work_and_data_order_only():
  rng = np.random.default_rng(2)
  work = rng.integers(1, 5, size=40)  # many ties
  ids = [f"group-{i}" for i in range(40)]
  plan = assign_groups(ids, work, 4)
  perm = rng.permutation(40)  # the same groups listed in another order, data order carried
  shard = lpt_assign(work[perm], 4, index=perm)
  assert {ids[p]: int(s) for p, s in zip(perm, shard)} == plan
  with pytest.raises(TypeError, match="integers"):
    lpt_assign(np.array([1.5, 2.0]), 2)
  with pytest.raises(ValueError, match="num_shards"):
    lpt_assign(np.array([1]), 0)
  with pytest.raises(ValueError, match="distinct"):
    assign_groups(["a", "a"], [1, 2], 2)


_HOST = """
import json, sys
import numpy as np
from rhyme_jax.scheduling.admission import RequestMeta
from rhyme_jax.scheduling.assignment import plan_shards
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable
rng = np.random.default_rng(7)
table = LengthTable(epochs_kept=2)
keys = [f"prompt-{i}" for i in range(64)]
for e in range(2):
  for k in keys[: 48 + 8 * e]:
    table.add(k, e, rng.integers(5, 400, size=8))
metas = [RequestMeta(i * 8 + j, ("step3", i), keys[i], i * 8 + j, 512)
         for i in range(64) for j in range(8)]
plan = plan_shards(metas, LengthPredictor(table, "mean"), int(sys.argv[1]))
print(json.dumps(sorted((g[1], s) for g, s in plan.items())))
"""


def test_separate_host_processes_derive_the_same_plan():
  plans = []
  for hash_seed in ("1", "2", "3"):  # distinct dict/set hashing per simulated host
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _HOST, "4"], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    plans.append(json.loads(out))
  assert plans[0] == plans[1] == plans[2]
  assert sorted({s for _, s in plans[0]}) == [0, 1, 2, 3]


def test_plan_shards_balances_predicted_work():
  table = LengthTable()
  rng = np.random.default_rng(3)
  lengths = rng.lognormal(5, 0.8, size=32)
  for i, n in enumerate(lengths):
    table.add(i, 0, [int(n)] * 8)
  metas = [RequestMeta(i * 8 + j, i, i, i * 8 + j) for i in range(32) for j in range(8)]
  plan = plan_shards(metas, LengthPredictor(table), 4)
  work = np.array([int(n) * 8 for n in lengths])
  loads = shard_loads(work, [plan[i] for i in range(32)], 4)
  # List scheduling: the last job on the fullest shard started at the least load.
  assert loads.max() <= work.sum() / 4 + work.max() * (1 - 1 / 4)
  assert loads.max() - loads.min() <= work.max()


def test_plan_hosts_balances_a_round_and_deals_round_robin_without_history():
  table = LengthTable()
  rng = np.random.default_rng(5)
  lengths = rng.integers(1, 300, size=16)
  for i, n in enumerate(lengths):
    table.add(f"k{i}", 0, [int(n)] * 4)
  keys = [f"k{i}" for i in range(16)]
  hosts, work = plan_hosts(keys, 4, LengthPredictor(table), 4)
  assert work.tolist() == [int(n) * 4 for n in lengths]
  assert sorted(q for h in hosts for q in h) == list(range(16))  # each prompt once
  assert all(h == sorted(h) for h in hosts)  # data order within a host
  loads = [int(work[h].sum()) for h in hosts]
  assert max(loads) <= work.sum() / 4 + work.max() * (1 - 1 / 4)  # list scheduling's bound
  slices = [int(work[4 * h:4 * h + 4].sum()) for h in range(4)]
  assert max(loads) < max(slices)  # on this instance, better than the data-order slices
  # No history yet: every prediction is the same, so one prompt per host in turn.
  hosts, work = plan_hosts(keys[:6], 4, LengthPredictor(LengthTable()), 2)
  assert hosts == [[0, 2, 4], [1, 3, 5]]
  assert (work > 0).all()


def test_no_jobs_assign_nothing():
  """An empty step (a Python list, which numpy reads as float64) is no jobs, not a type error."""
  assert lpt_assign([], 2).tolist() == [] and lpt_assign([], 2).dtype == np.int64
  assert assign_groups([], [], 2) == {}
  with pytest.raises(TypeError, match="work must be integers"):
    lpt_assign([1.5], 2)
