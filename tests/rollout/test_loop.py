"""The rollout loop (loop.py): a plain step is read only after the next one is dispatched, which
changes nothing sampled; every step's timeline entry says what was dispatched before it."""

import collections

import numpy as np

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
