"""Admission orders: static policies (fifo, history, alternation, oracle), Seer's probe-first
online policy, and metadata from the engine's real Request type."""

import pytest

from rhyme_jax.rollout.engine import Request
from rhyme_jax.rollout.sampling import SamplingParams
from rhyme_jax.scheduling.admission import (ContextAwarePolicy, RequestMeta, longest_first,
                                            make_policy, metas_from_requests)
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable


def _metas(groups=3, size=3):
  return [RequestMeta(g * size + j, f"g{g}", f"p{g}", g * size + j, 512)
          for g in range(groups) for j in range(size)]


def _predictor(lengths_by_prompt):
  table = LengthTable()
  for key, lengths in lengths_by_prompt.items():
    table.add(key, 0, lengths)
  return LengthPredictor(table, "mean")


def _drain(policy, metas, finish=None):
  """Admits everything, one request at a time, as an engine would; returns request ids."""
  queue = policy.order(metas)
  finished, live, out = {}, {}, []
  while queue:
    m = queue.pop(policy.next_to_admit(queue, finished, live))
    out.append(m.request_id)
    live[m.request_id] = 0
    if finish and m.request_id in finish:
      finished[m.request_id] = finish[m.request_id]
      del live[m.request_id]
  return out


def test_longest_first_is_stable_in_data_order():
  assert longest_first([3, 5, 3, 1], [0, 1, 2, 3]) == [1, 0, 2, 3]
  assert longest_first([3, 5, 3, 1], [0, 1, 2, 3], reverse=True) == [3, 0, 2, 1]
  assert longest_first([3, 3], [9, 4]) == [1, 0]


def test_static_orders():
  metas = _metas()
  pred = _predictor({"p0": [10, 10], "p1": [300, 100], "p2": [50]})
  assert _drain(make_policy("fifo"), metas) == list(range(9))
  assert _drain(make_policy("history", predictor=pred), metas) == [3, 4, 5, 6, 7, 8, 0, 1, 2]
  alt_even = make_policy("history_alt", predictor=pred, step=2)
  alt_odd = make_policy("history_alt", predictor=pred, step=3)
  assert _drain(alt_even, metas) == [3, 4, 5, 6, 7, 8, 0, 1, 2]
  assert _drain(alt_odd, metas) == [0, 1, 2, 6, 7, 8, 3, 4, 5]
  truth = {m.request_id: 100 - m.request_id for m in metas}
  assert _drain(make_policy("oracle", true_lengths=truth), metas) == list(range(9))
  order = _drain(make_policy("random", seed=3), metas)
  assert sorted(order) == list(range(9)) and order == _drain(make_policy("random", seed=3), metas)


def test_probe_first_runs_one_sample_per_group_then_the_longest_estimate():
  metas = _metas()
  policy = ContextAwarePolicy()
  queue = policy.order(metas)
  finished, live, admitted = {}, {}, []
  for _ in range(3):  # three free slots: one probe per group, in data order
    m = queue.pop(policy.next_to_admit(queue, finished, live))
    admitted.append(m.request_id)
    live[m.request_id] = 0
  assert admitted == [0, 3, 6]
  # The probe of g1 finished at 40 tokens, g0's is still running at 90: g0 is the longest.
  finished[3] = 40
  del live[3]
  live[0], live[6] = 90, 20
  m = queue.pop(policy.next_to_admit(queue, finished, live))
  assert m.group_id == "g0"
  live[m.request_id] = 0
  live[0] = 95
  del live[0]
  finished[0] = 95
  # Now g0 (95) > g1 (40) > g2 (20 so far).
  nxt = [queue.pop(policy.next_to_admit(queue, finished, live)).group_id for _ in range(5)]
  assert nxt == ["g0", "g1", "g1", "g2", "g2"]


def test_history_probe_uses_the_prior_and_lets_siblings_override_it():
  metas = _metas()
  pred = _predictor({"p0": [10], "p1": [30], "p2": [20]})  # p0..p2 all known
  policy = make_policy("history_probe", predictor=pred)
  queue = policy.order(metas)
  first = [queue.pop(policy.next_to_admit(queue, {}, {})).group_id for _ in range(3)]
  assert first == ["g1", "g2", "g0"]  # probes by prior, longest first
  nxt = queue[policy.next_to_admit(queue, {0: 500}, {})]  # g0's probe ran 500 tokens
  assert nxt.group_id == "g0"


def test_meta_from_the_engine_request_and_bad_names():
  reqs = [Request(7, [1, 2, 3], SamplingParams(max_new_tokens=33), group_id="g", prompt_key="k"),
          Request(8, [4, 5], SamplingParams(max_new_tokens=9))]
  a, b = metas_from_requests(reqs)
  assert a == RequestMeta(7, "g", "k", 0, 33, 3)
  assert b.group_id == 8 and b.index == 1
  # Without a prompt_key a request is known by its tokens, under the key the drafter records
  # them by: the predictor finds their history (it predicted every such request as unknown).
  from rhyme_jax.history.store import HistoryStore, prompt_key, store_key
  from rhyme_jax.scheduling.predictor import LengthPredictor, Prediction, StoreLengths
  assert b.prompt_key == prompt_key([4, 5]) == store_key((4, 5))
  store = HistoryStore()
  store.add_group(store_key((4, 5)), 0, [[1] * 40, [1] * 50])
  store.add_group("k", 0, [[1] * 10] * 2)
  assert LengthPredictor(StoreLengths(store)).predict(b.prompt_key) == Prediction(45.0, True)
  with pytest.raises(ValueError, match="needs a length predictor"):
    make_policy("history")
  with pytest.raises(ValueError, match="needs the true lengths"):
    make_policy("oracle")
  with pytest.raises(ValueError, match="expected one of"):
    make_policy("lifo")
  with pytest.raises(IndexError, match="empty queue"):
    make_policy("fifo").next_to_admit([], {}, {})


def test_probe_first_yield_rule_asks_without_admitting():
  """Divided rollout with probe-first: groups A and B run one sample each (300 and 280 tokens),
  C and D have not started. Both running requests yield, one for each unprobed group, and the
  freed slots then probe C and D. (The generic rule asked `next_to_admit`, which marked a
  group started per request asked: after the two asks no probe was left, and the first freed
  slot went back to request 0, which had just yielded.)"""
  from rhyme_jax.rollout.interface import yield_rule
  metas = [RequestMeta(rid, g, g, rid, 512) for rid, g in enumerate("AABBCCDD")]
  policy = ContextAwarePolicy()
  policy.order(metas)
  live, finished = {0: 300, 2: 280}, {}
  queue = [metas[i] for i in (1, 3, 4, 5, 6, 7)]
  rule = yield_rule(policy, queue, finished, live, 16)
  assert rule(metas[0]) and rule(metas[2])
  assert policy._started == set()  # asking admitted nothing
  queue += [metas[0], metas[2]]  # both yielded: back in the queue, tokens so far kept
  picks = [queue.pop(policy.next_to_admit(queue, finished, live)).request_id for _ in range(2)]
  assert picks == [4, 6]  # the probes of C and D
  # Once every group has started, a running request yields only to a longer group's sibling.
  rule = yield_rule(policy, queue, finished, {0: 300, 2: 280, 4: 5, 6: 400}, 16)
  assert not rule(metas[6]) and rule(metas[4])
  # Two empty slots take the probes of C and D: a running request yields to neither.
  queue = [metas[i] for i in (1, 3, 4, 5, 6, 7)]
  rule = yield_rule(policy, queue, finished, live, 16, free=2)
  assert not rule(metas[0]) and not rule(metas[2])


def test_a_started_request_from_another_shard_is_no_probe():
  """In the simulator a yielded request may be requeued on another shard, whose order never
  saw its group: it has run, so it is no probe, and its tokens so far bound its estimate."""
  a = [RequestMeta(i, "A", "A", i, 512) for i in range(2)]
  b = [RequestMeta(10 + i, "B", "B", 10 + i, 512) for i in range(2)]
  def pick(ran):  # A0 runs here at 50 tokens; B1 ran `ran` elsewhere and was requeued
    pol = ContextAwarePolicy()
    pol.order(a)
    return pol.next_to_admit([a[1], b[1]], {}, {0: 50, 11: ran})

  assert pick(70) == 1  # its 70 beats A's 50
  assert pick(20) == 0  # not a probe: A's 50 beats its 20


def test_the_kv_budget_counts_the_orders_own_requests():
  """The simulator's shards share one `live` map: a shard's cap counts its own requests."""
  table = LengthTable()
  for i, n in enumerate([10, 10, 90]):
    table.add(f"p{i}", 0, [n] * 4)
  mine = [RequestMeta(i, i, f"p{i}", i, 100) for i in range(3)]
  pol = make_policy("history_residual", predictor=LengthPredictor(table), kv_budget=2)
  pol.order(mine)
  others = {100 + i: 5 for i in range(10)}  # another shard's started requests
  # One of its own started (request 1, yielded): below its cap, the longer unstarted p2 goes.
  assert pol.next_to_admit(mine[1:], {}, {1: 5, **others}) == 1
  # Two of its own: at the cap only a started request resumes.
  assert pol.next_to_admit(mine[1:], {}, {0: 5, 1: 5, **others}) == 0
