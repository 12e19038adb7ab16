"""history_residual (`admission.ResidualPolicy`): longest remaining work first, where a request
that already ran is ranked by its prompt's history of L - n given L > n: the mean (the
hand-computed tests, `quantile=None`) or an upper quantile (the default); its KV cap; and the
simulator's divided rollout with it (hand-computed schedule, KV dropped or kept)."""

import numpy as np
import pytest

from rhyme_jax.scheduling.admission import RequestMeta, ResidualPolicy, make_policy
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable
from rhyme_jax.scheduling.simulate import DividedRollout, SimConfig, simulate
from rhyme_jax.scheduling.step_time import StepTimeTable

FLAT = StepTimeTable({(1, 0): 1.0, (64, 0): 1.0})


def _predictor(history):
  """Residual life from each prompt's own lengths alone (hand-computed below)."""
  table = LengthTable()
  for key, lengths in history.items():
    table.add(key, 0, lengths)
  return LengthPredictor(table, residual_prior=0)


def _jobs(groups, prompt_len=0):
  """[(meta, length)] for {prompt key: true lengths}, groups and samples in data order."""
  jobs = []
  for g, (key, lengths) in enumerate(groups.items()):
    for n in lengths:
      jobs.append((RequestMeta(len(jobs), g, key, len(jobs), 1000, prompt_len), n))
  return jobs


def test_a_request_that_ran_long_is_predicted_long():
  pred = _predictor({"p0": [10, 10, 10, 100], "p1": [40, 40, 40, 40]})
  pol = ResidualPolicy(pred, quantile=None)
  a, b = RequestMeta(0, 0, "p0", 0, 1000), RequestMeta(1, 1, "p1", 1, 1000)
  assert pol.remaining(a, 0) == pytest.approx(32.5) and pol.remaining(b, 0) == 40
  assert pol.remaining(a, 20) == 80  # its short siblings drop out: only the 100 outran 20
  assert pol.remaining(b, 20) == 20
  assert [m.request_id for m in pol.order([a, b])] == [1, 0]  # n = 0: the history order
  assert pol.next_to_admit([a, b], {}, {0: 20}) == 0  # a ran 20 tokens: 80 left beats 40
  assert pol.next_to_admit([a, b], {}, {1: 20}) == 0  # b ran 20: 20 left loses to 32.5
  # At its cap of started requests only a started one resumes.
  capped = ResidualPolicy(pred, kv_budget=1, quantile=None)
  capped.order([a, b])  # the requests it orders: the started ones it counts against the cap
  assert capped.next_to_admit([a, b], {}, {1: 20}) == 1
  assert capped.next_to_admit([a, b], {}, {}) == 1
  with pytest.raises(ValueError, match="kv_budget"):
    ResidualPolicy(pred, kv_budget=0)
  with pytest.raises(ValueError, match="needs a length predictor"):
    make_policy("history_residual")


def test_divided_rollout_hand_computed():
  # Two rows, chunk 5. p1 (12, 12) is predicted longer than p0 (mean 11.25), so both orders
  # start p1. The static order resumes each yielded request at once (no preemption): p1 ends
  # at 12, p0's first pair at 17, its 30-token sample runs alone from 17 to 47.
  truth = {"p0": [5, 5, 5, 30], "p1": [12, 12]}
  jobs = _jobs({"p1": truth["p1"], "p0": truth["p0"]})
  pred = _predictor(truth)
  cfg = SimConfig(slots=2, buckets=(2, 1), divided=DividedRollout(5))
  hist = simulate(jobs, lambda: make_policy("history", predictor=pred), FLAT, cfg)
  assert hist.makespan_ms == 47.0 and hist.peak_started == 2
  # Residual: after 5 tokens p1 has 7 left, p0's unstarted 11.25, so p0 runs; its 30-token
  # sample shows itself at 5 tokens (25 left) and keeps a row to the end: 15 + 25 = 40.
  mean_rule = lambda: make_policy("history_residual", predictor=pred, residual_quantile=None)
  res = simulate(jobs, mean_rule, FLAT, cfg)
  assert res.makespan_ms == 40.0 and res.peak_started == 4 and res.tokens == 69
  assert res.prefill_tokens == 0  # KV kept: resuming in place is free
  # Capped at 2 started requests it cannot displace p1: the static order's schedule.
  capped = simulate(jobs, lambda: make_policy("history_residual", predictor=pred, kv_budget=2,
                                                residual_quantile=None), FLAT, cfg)
  assert capped.makespan_ms == 47.0 and capped.peak_started == 2
  # KV dropped on yield: a displaced request re-prefills prompt + generated tokens on resuming
  # (the immediate resumptions of the static order stay free).
  drop = SimConfig(slots=2, buckets=(2, 1), divided=DividedRollout(5, keep_kv=False),
                   prefill_ms_per_token=0.5)
  jobs_p = _jobs({"p1": truth["p1"], "p0": truth["p0"]}, prompt_len=3)
  hist_d = simulate(jobs_p, lambda: make_policy("history", predictor=pred), FLAT, drop)
  assert hist_d.prefill_tokens == 3 * len(jobs_p)
  res_d = simulate(jobs_p, mean_rule, FLAT, drop)
  assert res_d.prefill_tokens > 3 * len(jobs_p) and res_d.makespan_ms > 40.0
  assert np.all(res_d.finish_ms > 0) and res_d.tokens == 69


def test_a_running_request_yields_to_more_expected_remaining_work():
  """should_yield (divided rollout): the running request gives way only when the queued pick
  is expected to need strictly more tokens than it still does."""
  pred = _predictor({"p0": [10, 10, 10, 100], "p1": [40, 40, 40, 40]})
  pol = ResidualPolicy(pred, quantile=None)
  fresh, running = RequestMeta(0, 0, "p0", 0, 1000), RequestMeta(1, 1, "p1", 1, 1000)
  assert pol.should_yield([fresh], running, {}, {1: 20}, chunk=8)  # 32.5 vs 20 left
  assert not pol.should_yield([fresh], running, {}, {1: 5}, chunk=8)  # 32.5 vs 35 left
  # The engine's adapter asks the policy's rule with Requests.
  from rhyme_jax.rollout.interface import Request
  from rhyme_jax.scheduling.engine_order import EngineOrder
  order = EngineOrder(pol)
  reqs = [Request(0, [1], prompt_key="p0", group_id=0), Request(1, [1], prompt_key="p1",
                                                                group_id=1)]
  order.order(reqs)
  assert order.online and order.should_yield([reqs[0]], reqs[1], {}, {1: 20}, 8)
  assert not order.should_yield([reqs[0]], reqs[1], {}, {1: 5}, 8)


def test_a_costly_yield_needs_a_margin_of_more_remaining_work():
  """With yield_cost Y (steps of the batch) a queued request must be expected to need more
  than sqrt(Y x requests x mean expected length) - chunk tokens beyond the running one's."""
  pred = _predictor({"p0": [10, 10, 10, 100], "p1": [40, 40, 40, 40]})
  fresh, running = RequestMeta(0, 0, "p0", 0, 1000), RequestMeta(1, 1, "p1", 1, 1000)
  pol = ResidualPolicy(pred, yield_cost=2.0, quantile=None)
  pol.order([fresh, running])  # 2 requests, mean expected length (32.5 + 40) / 2
  margin = np.sqrt(2.0 * 2 * 36.25) - 8
  assert pol.yield_margin(8) == pytest.approx(margin)  # ~4.04 tokens
  assert pol.yield_margin(16) == 0.0  # never below 0
  # The margin is for the work left: 72.5 tokens at the opening, less the tokens generated.
  assert pol.yield_margin(8, done=22.5) == pytest.approx(np.sqrt(2.0 * 50) - 8)  # 2 tokens
  assert pol.yield_margin(8, done=100.0) == 0.0
  assert pol.done_tokens({5: 7, 1: 3}, {0: 4, 9: 100}) == 7.0  # only its own requests count
  # running has 10 of 72.5 done: 32.5 vs 30 + 3.18 left, no yield; 12 done: 28 + 3.00, yield
  assert not pol.should_yield([fresh], running, {}, {1: 10}, chunk=8)
  assert pol.should_yield([fresh], running, {}, {1: 12}, chunk=8)
  # Late in the rollout (request 0 finished with 30 tokens, a sibling of it still queued):
  # with 39 of 72.5 tokens done the margin is nearly gone, so the running request gives way
  # to a queued one with 32.5 tokens left against its 31, which the margin of 9 tokens done
  # (3.27) forbids.
  sibling = RequestMeta(2, 0, "p0", 2, 1000)
  assert pol.done_tokens({0: 30}, {1: 9}) == 39.0
  assert pol.yield_margin(8, done=39.0) == pytest.approx(np.sqrt(2.0 * 33.5) - 8)  # 0.19
  assert pol.should_yield([sibling], running, {0: 30}, {1: 9}, chunk=8)
  assert not pol.should_yield([sibling], running, {}, {1: 9}, chunk=8)  # 32.5 vs 31 + 3.3
  assert pol.should_yield([fresh], running, {}, {1: 10}, chunk=16)  # a longer chunk: no margin
  pol.set_yield_cost(0.0)
  assert pol.should_yield([fresh], running, {}, {1: 10}, chunk=8)
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="yield_cost"):
      ResidualPolicy(pred, yield_cost=bad)
  # The engine hands its measured cost through the adapter; a static policy ignores it.
  from rhyme_jax.scheduling.engine_order import EngineOrder
  EngineOrder(pol).set_yield_cost(3.0)
  assert pol.yield_cost == 3.0
  EngineOrder(make_policy("fifo")).set_yield_cost(3.0)


def test_yields_stall_the_shard_in_the_simulator():
  """Each yield of an online order costs `yield_ms` on its shard; the decisions do not
  depend on time, so the makespan grows by exactly yields x yield_ms. Static orders never
  pay (their yield resumes in place)."""
  pred = _predictor({"a": [4, 40], "b": [30, 30]})
  jobs = _jobs({"a": [4, 40], "b": [30, 30]})
  runs = {}
  for cost in (0.0, 2.5):
    cfg = SimConfig(slots=1, buckets=(64, 1), divided=DividedRollout(8, yield_ms=cost))
    runs[cost] = simulate(jobs, lambda: make_policy("history_residual", predictor=pred),
                          FLAT, cfg)
    static = simulate(jobs, lambda: make_policy("fifo"), FLAT, cfg)
    assert static.yields == 0 and static.makespan_ms == 104
  assert runs[0.0].yields == runs[2.5].yields > 0
  assert runs[2.5].makespan_ms == pytest.approx(runs[0.0].makespan_ms + 2.5 * runs[0.0].yields)


def test_one_pass_of_yield_checks_scans_the_queue_once_and_pairs_yields_with_picks():
  """rollout/divided.slots_to_yield asks the order once per pass (`yield_rule`), with one scan
  of the queue, and the j-th running request to yield is compared with the j-th queued pick:
  the decisions of `should_yield` asked per running request against the rest of the queue,
  each yield taking the pick it gave way to out of it."""
  from rhyme_jax.rollout.divided import YieldRules, slots_to_yield
  from rhyme_jax.rollout.interface import Request
  from rhyme_jax.rollout.live import LiveRequest
  from rhyme_jax.scheduling.engine_order import EngineOrder
  rng = np.random.default_rng(0)
  keys = [f"p{k}" for k in range(6)]
  pred = _predictor({k: rng.integers(5, 120, 4).tolist() for k in keys})
  reqs = [Request(i, [1], prompt_key=keys[i % 6], group_id=i % 6) for i in range(40)]
  pol = ResidualPolicy(pred, yield_cost=0.3)
  order = EngineOrder(pol)
  order.order(reqs)
  running, queue = reqs[:16], reqs[16:]
  live = {r.request_id: int(rng.integers(0, 100)) for r in running}
  slots = []
  for r in running:
    lv = LiveRequest(r)
    lv.tokens = [0] * live[r.request_id]
    slots.append(lv)
  want, rest, alone = [], list(queue), []
  for i, r in enumerate(running):
    if len(slots[i].tokens) < 8:
      continue
    alone += [i] * order.should_yield(queue, r, {}, live, 8)
    if order.should_yield(rest, r, {}, live, 8):
      want.append(i)
      rest.pop(order.next_to_admit(rest, {}, live))
  scans = []
  pol._eligible = (lambda q, lv, _scan=pol._eligible: scans.append(len(q)) or _scan(q, lv))
  got = slots_to_yield(slots, queue, YieldRules(order, {}, live, 8), every=8, room=len(queue))
  assert got == want and 0 < len(got) < len(alone)  # fewer than if each met the best alone
  assert scans == [len(queue)]  # one scan of the queue for the whole pass


def test_the_free_slots_take_the_first_picks_and_each_yield_the_next():
  """history_residual's rule hands the queued requests out best first: with one slot empty, the
  longest queued request fills it, and a running request yields only to the next one."""
  pred = _predictor({"long": [200] * 4, "mid": [100] * 4, "run": [150] * 4})
  metas = [RequestMeta(i, k, k, i, 1000) for i, k in enumerate(("long", "mid", "run", "run"))]
  pol = ResidualPolicy(pred, quantile=None)
  pol.order(metas)
  queue, live = metas[:2], {2: 0, 3: 0}
  rule = pol.yield_rule(queue, {}, live, 8)
  assert [rule(metas[2]), rule(metas[3])] == [True, False]  # 200 > 150 once, then 100 < 150
  rule = pol.yield_rule(queue, {}, live, 8, free=1)
  assert not rule(metas[2])  # 200 fills the empty slot: 100 left to yield to


class _FewestTokensFirst:
  """Online: the request with the fewest tokens so far runs (an unstarted one has none), so
  every running request yields whenever one waits."""

  online = True
  name = "fewest_tokens"

  def order(self, queue):
    return list(queue)

  def next_to_admit(self, queue, finished, live):
    del finished
    return min(range(len(queue)), key=lambda i: (live.get(queue[i].request_id, 0), i))


def test_a_step_that_yields_pays_its_pass_once():
  """Requests admitted together reach their chunk together and yield in the same step: each
  yield costs `yield_ms`, each step that yields `pass_ms` once (the engine copies a pass's rows
  in one call each way), so the makespan grows by exactly yields x yield_ms + passes x pass_ms
  and passes are fewer than yields."""
  jobs = _jobs({"a": [16, 16], "b": [16, 16]})
  runs = {}
  for yield_ms, pass_ms in ((0.0, 0.0), (0.5, 0.0), (0.5, 2.0)):
    cfg = SimConfig(slots=2, buckets=(64, 2, 1),
                    divided=DividedRollout(8, yield_ms=yield_ms, pass_ms=pass_ms))
    runs[yield_ms, pass_ms] = simulate(jobs, _FewestTokensFirst, FLAT, cfg)
  free = runs[0.0, 0.0]
  assert free.yields == 4 and free.yield_passes == 2  # two rows out at 8 tokens, twice
  for (yield_ms, pass_ms), r in runs.items():
    assert (r.yields, r.yield_passes) == (free.yields, free.yield_passes)
    assert r.makespan_ms == pytest.approx(free.makespan_ms + yield_ms * r.yields
                                          + pass_ms * r.yield_passes)


def test_next_to_admit_keys_follow_the_live_counts_and_the_metas():
  # next_to_admit keeps each queued request's sort key between calls; a new count in `live`
  # or another meta under the same request id must be ranked afresh, as a fresh policy would.
  pred = _predictor({"p0": [10, 10, 10, 100], "p1": [40, 40, 40, 40]})
  a, b = RequestMeta(0, 0, "p0", 0, 1000), RequestMeta(1, 1, "p1", 1, 1000)
  pol = ResidualPolicy(pred, quantile=None)
  pol.order([a, b])
  for live in ({}, {0: 20}, {}, {1: 20}, {0: 20, 1: 5}, {0: 100}, {}):
    assert pol.next_to_admit([a, b], {}, live) == ResidualPolicy(pred, quantile=None).next_to_admit(
        [a, b], {}, live), live
  assert pol.next_to_admit([a, b], {}, {}) == 1  # p1's 40 beats p0's 32.5
  a_long = RequestMeta(0, 0, "p1", 0, 1000)  # request 0 again, now of the longer prompt
  assert pol.next_to_admit([a_long, b], {}, {}) == 0  # ties at 40: data order
  assert pol.next_to_admit([b, a_long], {}, {}) == 1


def test_the_upper_quantile_starts_a_prompt_that_may_run_to_the_cap_first():
  """A steady prompt (60 tokens each) has the longer mean; a risky one (half at 5, half at
  100) the longer upper quartile. The default ranks by the quartile, so the risky samples
  start first, and a long one among them does not end the rollout alone."""
  history = {"steady": [60, 60, 60, 60], "risky": [5, 5, 100, 100]}
  pred = _predictor(history)
  steady, risky = RequestMeta(0, 0, "steady", 0, 1000), RequestMeta(1, 1, "risky", 1, 1000)
  mean, quartile = ResidualPolicy(pred, quantile=None), ResidualPolicy(pred)
  assert [m.prompt_key for m in mean.order([steady, risky])] == ["steady", "risky"]
  assert [m.prompt_key for m in quartile.order([steady, risky])] == ["risky", "steady"]
  assert int(quartile.remaining(risky, 0)) == 100 and int(quartile.remaining(steady, 0)) == 60
  # Two rows, no divided rollout, this step's risky samples at 5 and 100: the mean starts the
  # steady pair (both end at 60), then the risky one that runs to 160; the quartile starts
  # the risky pair, the 5-token one frees its row for a steady sample (5 -> 65 -> 125).
  jobs = _jobs({"steady": [60, 60], "risky": [5, 100]})
  cfg = SimConfig(slots=2, buckets=(2, 1))
  by_mean = simulate(jobs, lambda: make_policy("history_residual", predictor=pred,
                                               residual_quantile=None), FLAT, cfg)
  by_quartile = simulate(jobs, lambda: make_policy("history_residual", predictor=pred), FLAT,
                         cfg)
  assert (by_mean.makespan_ms, by_quartile.makespan_ms) == (160.0, 125.0)


def test_equal_quantiles_rank_by_the_mean_and_bad_quantiles_name_themselves():
  # Both prompts' upper quartiles are the cap (24); the one with the longer mean goes first,
  # as with the mean alone, and the tie-break stays below one token.
  pred = _predictor({"a": [3, 24, 24, 24], "b": [20, 24, 24, 24]})
  a, b = RequestMeta(0, 0, "a", 0, 24), RequestMeta(1, 1, "b", 1, 24)
  pol = ResidualPolicy(pred)
  assert [m.prompt_key for m in pol.order([a, b])] == ["b", "a"]
  assert 24 < pol.remaining(a, 0) < pol.remaining(b, 0) < 25
  for bad in (0.0, 1.0, -0.5, 2.0):
    with pytest.raises(ValueError, match="quantile"):
      ResidualPolicy(pred, quantile=bad)


def test_equal_quantiles_never_make_a_running_request_yield():
  # The queued sample ranks above the running one by the mean's tie-break alone (both upper
  # quartiles are the cap): admissions follow it, but no yield is made for less than a token.
  pred = _predictor({"a": [3, 24, 24, 24], "b": [20, 24, 24, 24]})
  queued, running = RequestMeta(1, 1, "b", 1, 24), RequestMeta(0, 0, "a", 0, 24)
  pol = ResidualPolicy(pred)
  pol.order([running, queued])
  assert pol.remaining(queued, 0) > pol.remaining(running, 0)
  assert not pol.should_yield([queued], running, {}, {0: 0}, chunk=8)
  assert ResidualPolicy(pred, quantile=None).should_yield([queued], running, {}, {0: 0}, chunk=8)
