"""The tail (rollout/tail.py): bucket moves happen where the cost model says they pay, and a
move or its absence never changes what is sampled."""

import collections
import types

import numpy as np
import pytest

from rhyme_jax.rollout.cost_model import CostModel
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams
from rhyme_jax.rollout.tail import FinishedLengths, bucket_target, drain_single

S = 64


def costs(times):
  """A cost model whose plain steps of bucket b took times[b] seconds at warm-up."""
  m = CostModel()
  for b, t in times.items():
    m.observe_time((b, b, 1, S), t, warmup=True)
  return m


def test_expected_left_averages_the_longer_finished_and_the_cap():
  finished = {1: 10, 2: 20, 3: 40}
  lengths = FinishedLengths(finished)
  assert lengths.expected_left(15, 100) == pytest.approx((5 + 25 + 85) / 3)
  assert lengths.expected_left(50, 100) == 50  # longer than every finished one: to the cap
  assert lengths.expected_left(0, 40) == pytest.approx((10 + 20 + 40 + 40) / 4)
  finished[4] = 60  # the rollout's map, read as it grows
  assert lengths.expected_left(50, 100) == pytest.approx((10 + 50) / 2)
  assert FinishedLengths({}).expected_left(3, 8) == 5


def test_a_move_is_made_only_where_its_saving_repays_it():
  steep = costs({8: 8.0, 4: 4.0, 2: 2.0, 1: 1.0})  # a step costs by the row (a CPU)
  flat = costs({8: 2.0, 4: 2.0, 2: 2.0, 1: 2.0})  # a step costs the same (a GPU, few rows)
  moves = {8: 0.5, 4: 0.5, 2: 0.5}
  assert steep.bucket_to_run(8, [4, 2], S, moves, 0.1, 10) == 2
  assert flat.bucket_to_run(8, [4, 2, 1], S, moves, 0.0, 1000) == 8
  # Bucket 2 saves 0.2 s a step more than bucket 4 and costs one more move (0.5 s): for one or
  # two steps bucket 4 nets more (4 - 1.5 > 4.2 - 2.0), for ten bucket 2 (42 - 2 > 40 - 1.5).
  nearly = costs({8: 8.0, 4: 4.0, 2: 3.8})
  assert nearly.bucket_to_run(8, [4, 2], S, moves, 1.0, 1) == 4
  assert nearly.bucket_to_run(8, [4, 2], S, moves, 1.0, 2) == 4
  assert nearly.bucket_to_run(8, [4, 2], S, moves, 1.0, 10) == 2
  # Nothing expected to run, or a drained pipeline costing more than all it saves: stay.
  assert steep.bucket_to_run(8, [4, 2], S, moves, 0.1, 0) == 8
  assert steep.bucket_to_run(8, [4], S, moves, 100.0, 10) == 8
  # Unmeasured move times count as free.
  assert steep.bucket_to_run(8, [4], S, {}, 0.0, 0.01) == 4


def test_bucket_moves_is_checked():
  with pytest.raises(ValueError, match=r"bucket_moves='sometimes': expected one of"):
    EngineConfig(bucket_moves="sometimes")


def _requests():
  lengths = np.random.default_rng(0).integers(1, 30, size=12)
  return [Request(i, [1 + i, 2, 5], SamplingParams(temperature=1.0, max_new_tokens=int(n)))
          for i, n in enumerate(lengths)]


def _warm_engine(model, moves):
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), speculate="never", kv_buckets=2,
                     eos_ids=(3,), seed=5, bucket_moves=moves)
  eng = RolloutEngine(model, cfg)
  eng.warmup(filters=False)
  return eng


def test_the_loop_moves_as_the_cost_model_decides_and_samples_the_same(tiny_model):
  """A warmed-up engine times each move and asks the cost model before making one: told to
  stay, the tail runs in the first bucket; told to move, in smaller ones; "always" moves
  without asking. Tokens are the same in all three, and no rollout compiles."""
  asked = []

  def decide(stay):
    def bucket_to_run(bucket, smaller, s, move_s, bubble_s, steps_left):
      asked.append((bucket, list(smaller), s, dict(move_s), bubble_s, steps_left))
      return bucket if stay else min(smaller)
    return bucket_to_run

  runs = {}
  for name, moves, stay in (("always", "always", None), ("stay", "cost", True),
                            ("move", "cost", False)):
    eng = _warm_engine(tiny_model, moves)
    assert sorted(eng.move_seconds) == [2, 4] and min(eng.move_seconds.values()) > 0
    if stay is not None:
      eng.costs.bucket_to_run = decide(stay)
    before = collections.Counter(TRACE_COUNTS)
    runs[name] = (eng.generate(_requests()), eng.stats)
    assert collections.Counter(TRACE_COUNTS) == before, f"{name}: a rollout compiled"
    if stay is None:
      assert not asked, "'always' asked the cost model"
  tokens = {k: [r.tokens.tolist() for r in results] for k, (results, _) in runs.items()}
  assert tokens["stay"] == tokens["move"] == tokens["always"]
  st = {k: s for k, (_, s) in runs.items()}
  assert st["stay"].bucket_moves == 0 and st["stay"].moves_held > 0
  assert {b for b, *_ in st["stay"].trace} == {4}
  assert st["move"].bucket_moves >= 1 and st["move"].moves_held == 0
  assert {b for b, *_ in st["move"].trace} > {4}
  assert st["always"].bucket_moves >= 1 and st["always"].moves_held == 0
  # What the loop asked: a smaller bucket that holds the live rows, a cache length it compiled,
  # the warm-up's move times, a host pass measured, and at least one step still to run.
  for bucket, smaller, s, move_s, bubble_s, steps_left in asked:
    assert smaller and max(smaller) < bucket and s in eng.kv_lengths
    assert sorted(move_s) == [2, 4] and bubble_s >= 0 and steps_left >= 1


def test_moves_that_cannot_pay_are_not_made(tiny_model):
  """The engine's own rule, no stand-in: with each move timed at 10 s, nothing a tiny model's
  steps could save in this rollout repays one, so the tail stays in the first bucket; tokens
  as with "always"."""
  held, always = _warm_engine(tiny_model, "cost"), _warm_engine(tiny_model, "always")
  held.move_seconds = {b: 10.0 for b in held.move_seconds}
  got, want = held.generate(_requests()), always.generate(_requests())
  assert [r.tokens.tolist() for r in got] == [r.tokens.tolist() for r in want]
  assert held.stats.bucket_moves == 0 and held.stats.moves_held > 0
  assert always.stats.bucket_moves >= 1


def test_speculation_shortens_the_steps_a_move_is_weighed_over():
  """Rows that got 3 tokens per step so far are expected to need a third of the steps: the
  cost model is asked over 20 / 3 steps for a row expecting 20 more tokens (no finished
  requests: to its cap), at the cache length that holds the longest row and the step in flight."""
  asked = []
  costs = types.SimpleNamespace(bucket_to_run=lambda *a: asked.append(a) or a[1][-1])
  engine = RolloutEngine.__new__(RolloutEngine)  # only its bucket and cache-length helpers
  engine.config = EngineConfig(max_len=64, buckets=(4, 2, 1), kv_buckets=2)
  engine.kv_lengths, engine.costs, engine.move_seconds = engine.config.kv_lengths(), costs, {4: 0.1}
  row = types.SimpleNamespace(req=Request(0, [1] * 10, SamplingParams(max_new_tokens=25)),
                              tokens=[5] * 5)
  stats = types.SimpleNamespace(tokens=30, useful_slot_steps=10, moves_held=0)
  pending = types.SimpleNamespace(shape=(4, 4, 1, 32), steps=4)
  rollout = types.SimpleNamespace(engine=engine, bucket=4, pending=pending, queue=[],
                                  slots=[None, row, None, None], stats=stats, pass_s=0.01,
                                  lengths=FinishedLengths({}))
  assert bucket_target(rollout, [1]) == 1 and stats.moves_held == 0
  (bucket, smaller, s, move_s, bubble_s, steps_left), = asked
  assert (bucket, smaller, move_s, bubble_s) == (4, [2, 1], {4: 0.1}, 0.01)
  assert steps_left == pytest.approx(20 / 3)
  assert s == engine._kv_len_for(10 + 5 + 4 + 1)


def test_drain_steps_cost_runs_one_step_where_the_host_pass_hides_behind_it():
  """drain_steps "cost": a one-step launch once nothing waits where a host pass (pass_s) is
  shorter than the plain step at the rows' bucket and cache length (the cache length that
  holds the longest row, the launch in flight and the step); "single" / "multi" always / never;
  and before any pass was timed, the multi-step launch."""
  engine = RolloutEngine.__new__(RolloutEngine)  # only its cache-length helper and costs

  def rollout(mode, pass_s, step_s):
    engine.config = EngineConfig(max_len=64, buckets=(4, 2, 1), kv_buckets=2, multi_step=4,
                                 drain_steps=mode)
    engine.kv_lengths = engine.config.kv_lengths()
    s = engine._kv_len_for(10 + 5 + 4 + 1)  # a 10-token prompt, 5 tokens, 4 in flight
    engine.costs = CostModel()
    engine.costs.observe_time((2, 2, 1, s), step_s, warmup=True)
    engine.costs.observe_time((4, 4, 1, s), 10 * step_s, warmup=True)  # another bucket's
    return types.SimpleNamespace(engine=engine, cfg=engine.config, bucket=2, pass_s=pass_s)

  assert drain_single(rollout("cost", 0.004, 0.005), 10 + 5 + 4)
  assert not drain_single(rollout("cost", 0.006, 0.005), 10 + 5 + 4)
  assert not drain_single(rollout("cost", None, 0.005), 10 + 5 + 4)
  assert drain_single(rollout("single", 1.0, 0.005), 10 + 5 + 4)
  assert not drain_single(rollout("multi", 0.0, 0.005), 10 + 5 + 4)
  with pytest.raises(ValueError, match="drain_steps='some'"):
    EngineConfig(drain_steps="some")
