"""The rollout loop (loop.py): a plain step is read only after the next one is dispatched, which
changes nothing sampled; every step's timeline entry says what was dispatched before it."""

import collections
import dataclasses

import numpy as np
import pytest

from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

EOS = 3


def _requests():
  lengths = np.random.default_rng(0).integers(1, 30, size=20)
  return [Request(i, [1 + i, 2, 5], SamplingParams(temperature=1.0, max_new_tokens=int(n)))
          for i, n in enumerate(lengths)]


def _engine(model, pipeline: bool) -> RolloutEngine:
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), speculate="never", kv_buckets=1,
                     eos_ids=(EOS,), seed=5, pipeline=pipeline)
  return RolloutEngine(model, cfg)


def test_plain_steps_are_read_behind_the_next_dispatch(tiny_model):
  piped, unpiped = _engine(tiny_model, True), _engine(tiny_model, False)
  got, want = piped.generate(_requests()), unpiped.generate(_requests())
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason
  sp, su = piped.stats, unpiped.stats
  assert su.host_waits == su.steps  # without the pipeline the device idles at every read
  # With it, a read blocks only before a bucket move (the rows move in a quiet state) and at
  # the end; every other step was read while the next one ran.
  buckets = [b for b, _, _, _ in sp.trace]
  moves = sum(x != y for x, y in zip(buckets, buckets[1:]))
  assert 1 <= moves <= 2 and sp.host_waits <= moves + 1 < sp.steps
  # A pipelined step may carry rows that ended in the step before: discarded, never kept.
  assert sp.tokens == su.tokens == sum(len(r.tokens) for r in got)
  assert sp.steps >= su.steps and sp.useful_slot_steps == su.useful_slot_steps


def test_the_timeline_has_a_step_each_with_what_came_before_it(tiny_model):
  eng = _engine(tiny_model, True)
  reqs = _requests()
  eng.generate(reqs)
  st = eng.stats
  assert len(st.timeline) == st.steps
  seconds = [t[0] for t in st.timeline]
  assert seconds == sorted(seconds) and 0 < seconds[-1] <= st.total_time_s
  yields, prefilled, resumed = (sum(t[k] for t in st.timeline) for k in (2, 3, 4))
  assert (yields, prefilled, resumed) == (0, len(reqs), 0)  # undivided: each request once
  assert st.timeline[0][3] == 4  # the first step follows the first bucket's admissions
  host = [t[5] for t in st.timeline]
  assert all(h >= 0 for h in host) and sum(host) <= st.total_time_s - st.device_time_s
  assert collections.Counter(t[1] for t in st.timeline) == st.steps_by_shape


# ---- multi-step launches (EngineConfig.multi_step) ---------------------------------------------

def _multi(model, k: int, drafter=None, eos_ids=(EOS,)) -> RolloutEngine:
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), kv_buckets=2, eos_ids=eos_ids, seed=5,
                     multi_step=k, max_draft=4 if drafter is not None else 0,
                     speculate="auto" if drafter is not None else "never")
  return RolloutEngine(model, cfg, drafter)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.9, top_k=20)])
def test_multi_step_launches_sample_what_single_steps_do(tiny_model, params):
  """Several plain steps per compiled call (a scan of the one step) draw every token with its
  own position's key: same tokens, log-probs and ends as one step per call, through requests
  queued, EOS and token caps inside a launch, bucket moves and both cache lengths."""
  lengths = np.random.default_rng(1).integers(1, 56, size=20)
  reqs = lambda: [Request(i, [1 + i, 2, 5], dataclasses.replace(params, max_new_tokens=int(n)))
                  for i, n in enumerate(lengths)]
  one, four = _multi(tiny_model, 1), _multi(tiny_model, 4)
  want, got = one.generate(reqs()), four.generate(reqs())
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"request {a.request_id}")
    # the scan compiles to another program: its filtered log-probs may differ in the last bit
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    assert a.finish_reason == b.finish_reason and b.steps == len(b.tokens) and b.accepted == 0
  assert {r.finish_reason for r in want} == {"eos", "length"}
  s1, s4 = one.stats, four.stats
  # short caps (1-55 tokens) keep many launches at one step while requests queue
  assert s1.launches == s1.steps and s4.launches < 0.6 * s4.steps
  assert s4.tokens == s1.tokens == s4.useful_slot_steps and s4.accepted == 0
  assert len(s4.timeline) == s4.launches
  by_shape = collections.Counter()
  for entry in s4.timeline:
    by_shape[entry[1]] += entry[6]
  assert by_shape == s4.steps_by_shape and set(entry[6] for entry in s4.timeline) == {1, 4}
  assert len({s for _, _, _, s in s4.steps_by_shape}) == 2  # both cache-length buckets ran


def test_multi_step_launches_stop_at_token_caps(tiny_model):
  """A launch runs one step where a longer one would step past token caps: while requests
  queue, past any live row's (its slot goes to the next request as soon as one step would
  free it); with none queued, past every row's (no launch runs on for nobody)."""
  reqs = lambda: [Request(i, [1 + i, 2, 5], SamplingParams(temperature=1.0, max_new_tokens=6))
                  for i in range(12)]
  one, four = _multi(tiny_model, 1, eos_ids=()), _multi(tiny_model, 4, eos_ids=())
  want, got = one.generate(reqs()), four.generate(reqs())
  assert [r.tokens.tolist() for r in want] == [r.tokens.tolist() for r in got]
  assert all(r.finish_reason == "length" and len(r.tokens) == 6 for r in got)
  # Three waves of four 6-token rows: 4 + 1 + 1 steps each and one pipelined step past the
  # caps, as one step per launch takes (two 4-step launches would take 8 or more per wave)
  assert four.stats.steps == one.stats.steps == 3 * 7
  assert four.stats.slot_steps == one.stats.slot_steps
  assert four.stats.launches == 3 * 4 < one.stats.launches


def test_a_request_parked_in_flight_waits_as_a_queued_one():
  """A request parked while the step in flight runs (`landing`) rejoins the queue once that
  step is read: for the token-cap rule it waits, so a launch stops where any row reaches its
  cap (its slot goes to that request), not only where every row does."""
  import types
  from rhyme_jax.rollout.loop import Rollout
  row = lambda left: types.SimpleNamespace(
      req=Request(0, [1], SamplingParams(max_new_tokens=10)), tokens=[0] * (10 - left))
  r = types.SimpleNamespace(cfg=EngineConfig(max_len=64, multi_step=4), queue=[], landing=[],
                            slots=[row(2), row(9)])
  steps = lambda: Rollout._launch_steps(r, [0, 1], 0, 9)
  assert steps() == 4  # nothing waits: the longer row runs on
  r.landing = ["parked"]
  assert steps() == 1
  r.landing, r.queue = [], ["queued"]
  assert steps() == 1


def test_drain_steps_single_launches_one_step_once_nothing_waits(tiny_model):
  """With drain_steps "single", once no request is queued every launch runs one step (each
  response's end is read a step after it, not at a 4-step launch's end); while requests wait
  launches keep multi_step. Same tokens as either launch length; nothing compiles (one-step
  launches are the warm-up's plain steps)."""
  from rhyme_jax.rollout.engine import TRACE_COUNTS
  lengths = np.random.default_rng(2).integers(8, 56, size=14)
  reqs = lambda: [Request(i, [1 + i, 2, 5], SamplingParams(temperature=1.0,
                                                           max_new_tokens=int(n)))
                  for i, n in enumerate(lengths)]
  four = _multi(tiny_model, 4)
  drain = RolloutEngine(tiny_model, dataclasses.replace(four.config, drain_steps="single"))
  drain.warmup(filters=False)
  before = dict(TRACE_COUNTS)
  got = drain.generate(reqs())
  assert dict(TRACE_COUNTS) == before, "a rollout compiled"
  want = four.generate(reqs())
  assert [r.tokens.tolist() for r in want] == [r.tokens.tolist() for r in got]
  # (queued requests at dispatch, the launch's steps) per launch
  launches = lambda st: [(tr[3], tl[6]) for tr, tl in zip(st.trace, st.timeline)]
  assert {k for q, k in launches(drain.stats) if q == 0} == {1}
  assert {k for q, k in launches(drain.stats) if q > 0} == {1, 4}
  assert 4 in {k for q, k in launches(four.stats) if q == 0}  # without it the drain runs 4
  assert drain.stats.launches > four.stats.launches and drain.stats.tokens == four.stats.tokens


def test_multi_step_compiles_at_warmup_only(tiny_model):
  """Multi-step launches compile at warm-up (per bucket and cache length); rollouts with a
  drafter that the cost model weighs each step ("auto") then compile nothing, and sample what
  one step per launch samples."""
  from rhyme_jax.rollout.drafts import RandomDrafter
  from rhyme_jax.rollout.engine import TRACE_COUNTS
  reqs = lambda: [Request(i, [1 + i, 2, 5], SamplingParams(temperature=1.0, max_new_tokens=30),
                          group_id=i // 4) for i in range(10)]
  eng = _multi(tiny_model, 4, RandomDrafter(64, seed=0))
  eng.warmup(filters=False)
  before = dict(TRACE_COUNTS)
  got = eng.generate(reqs())
  assert dict(TRACE_COUNTS) == before, "a rollout compiled"
  # Plain stretches ran as multi-step launches, unless the cost model asked for drafts at every
  # launch (a launch that asks runs one step): on this tiny model a speculative step costs about
  # what a plain one does, so under a loaded CPU's timings it may ask throughout.
  st = eng.stats
  assert any(t[-1] > 1 for t in st.timeline) or st.asked_steps == st.launches == st.steps
  want = _multi(tiny_model, 1).generate(reqs())
  assert [r.tokens.tolist() for r in want] == [r.tokens.tolist() for r in got]


def test_multi_step_is_checked():
  with pytest.raises(ValueError, match=r"multi_step=0: must be in \[1, 64\]"):
    EngineConfig(multi_step=0)
  # room for a launch past a row's end and a pipelined one after it
  assert EngineConfig(max_len=64, max_draft=0, multi_step=8).cache_len >= 64 + 2 * 8
