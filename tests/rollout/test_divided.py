"""Divided rollout (rollout/divided.py): running requests yield their slot to queued ones, their
KV parked on the device and brought back; what is sampled never changes, nothing compiles
inside a rollout, the pool's size bounds the parked requests."""

import dataclasses

import numpy as np
import pytest

from rhyme_jax.rollout.drafts import OracleDrafter
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams
from rhyme_jax.scheduling.admission import make_policy
from rhyme_jax.scheduling.engine_order import EngineOrder
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable

from tests.rollout.conftest import mixed_prompts

EOS = 3
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24)
FILTERED = SamplingParams(temperature=1.0, top_p=0.8, top_k=12, max_new_tokens=24)


class FewestTokensFirst:
  """An online order that always runs the request with the fewest tokens so far (ties: the
  front of the queue), so every request yields each time it is asked while others wait."""

  online = True

  def __init__(self):
    self.asked_about_running = 0

  def order(self, requests):
    return list(requests)

  def next_to_admit(self, queue, finished, live):
    del finished
    if queue[-1].request_id in live and live[queue[-1].request_id] > 0:
      self.asked_about_running += 1
    return min(range(len(queue)), key=lambda i: (live.get(queue[i].request_id, 0), i))


def requests(n=16, seed=0, params=PARAMS):
  return [Request(i, p, params, group_id=i // 4)
          for i, p in enumerate(mixed_prompts(n, 64, seed))]


def engine(model, drafter=None, budget=0, filters=False, **kw):
  # Bucket moves where the rows fit ("always"): the cost model's choice ("cost") weighs measured
  # step times, so two runs on a loaded machine could move at different passes and then step,
  # yield and admit differently; these tests compare runs.
  kw.setdefault("bucket_moves", "always")
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=budget,
                     pack_factors=(budget + 1,) if budget else (2,),
                     speculate="always" if budget else "never", kv_buckets=1, eos_ids=(EOS,),
                     seed=5, **kw)
  eng = RolloutEngine(model, cfg, drafter)
  eng.warmup(filters)
  return eng


def _same(a_results, b_results):
  for a, b in zip(a_results, b_results):
    np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"request {a.request_id}")
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("budget, multi_step, params", [
    (0, 1, PARAMS), (4, 1, PARAMS), (0, 4, PARAMS), (4, 1, FILTERED)])
def test_divided_rollout_samples_what_an_undivided_one_does(tiny_model, budget, multi_step,
                                                            params):
  """Requests yield every 4 tokens to queued ones (the pool holds 3) and resume in other
  slots; tokens and log-probs equal the undivided rollout's, plain steps (pipelined, one or
  four per launch: parked behind a launch, a row's KV holds all its tokens) and speculative
  ones alike, with top-p / top-k sampling too (a row's truncation is its own, whichever rows
  share its steps), and nothing compiles after warm-up."""
  filters = params.filters
  base = engine(tiny_model, budget=budget, filters=filters).generate(requests(params=params))
  drafter = (OracleDrafter({r.request_id: r.tokens for r in base}, 64, accuracy=0.7, seed=1)
             if budget else None)
  eng = engine(tiny_model, drafter, budget, filters, divide_every=4, park_rows=3,
               multi_step=multi_step)
  before = dict(TRACE_COUNTS)
  order = FewestTokensFirst()
  divided = eng.generate(requests(params=params), admission=order)
  assert dict(TRACE_COUNTS) == before, "a divided rollout compiled"
  _same(base, divided)
  assert eng.stats.yields >= 4 and order.asked_about_running >= eng.stats.yields
  assert 1 <= eng.stats.parked_peak <= 3
  assert sorted(eng.stats.admitted) == list(range(16))  # a resumption is not an admission
  assert eng.stats.tokens == sum(len(r.tokens) for r in divided)
  assert (eng.stats.launches < eng.stats.steps) == (multi_step > 1)


def test_a_static_order_never_divides(tiny_model):
  """Without an online order (none, or a static policy) no request yields its slot."""
  eng = engine(tiny_model, divide_every=2, park_rows=4)
  base = eng.generate(requests())
  assert eng.stats.yields == 0
  _same(base, eng.generate(requests(), admission=EngineOrder(make_policy("fifo"))))
  assert eng.stats.yields == 0


def test_history_residual_divides_with_a_real_predictor(tiny_model):
  """scheduling's history_residual order (longest expected remaining work first, from a
  history of lengths) drives the yields; one park row bounds the parked requests."""
  reqs = requests()
  table = LengthTable()
  for g in range(4):  # every prompt ran to the cap last epoch: fresh requests outrank
    table.add(g, 0, [24, 24, 24, 24])  # running ones by more than a chunk from 6 tokens on
  reqs = [dataclasses.replace(r, prompt_key=r.group_id) for r in reqs]
  base = engine(tiny_model).generate(reqs)
  eng = engine(tiny_model, divide_every=3, park_rows=1)
  policy = make_policy("history_residual", predictor=LengthPredictor(table))
  divided = eng.generate(reqs, admission=EngineOrder(policy))
  _same(base, divided)
  assert eng.stats.yields > 0 and eng.stats.parked_peak == 1
  # Warm-up timed a yield's two row copies (queued, and each waited for) against a plain
  # step; the order was told the queued cost.
  assert 0 < eng.yield_steps < float("inf") and policy.yield_cost == eng.yield_steps
  assert 0 < eng.yield_seconds_waited < float("inf")


class _FreeYields(EngineOrder):
  """An order that keeps yield cost 0 whatever the engine measured: no margin (plain LRPT)."""

  def set_yield_cost(self, steps: float) -> None:
    del steps


class _Rebuilt(_FreeYields):
  """history_residual without `stable_rule`: the engine builds its yield rule every pass."""

  stable_rule = False


def test_a_kept_yield_rule_decides_as_one_rebuilt_every_pass(tiny_model):
  """history_residual's yield rule is kept across passes until a request is queued, admitted
  or finishes (divided.YieldRules): the same yields, admissions and steps as building it every
  pass, with fewer rules built. (At yield cost 0: with a cost, a kept rule's margin is the one
  of when it was built, which the tokens generated since only shrink, so a kept rule may yield
  a little less.) The live map it reads holds the started, unfinished requests only, each at no
  more tokens than it ends with."""
  rng = np.random.default_rng(3)
  table = LengthTable()
  for g in range(4):
    table.add(g, 0, rng.integers(2, 25, 4).tolist())
  reqs = [dataclasses.replace(r, prompt_key=r.group_id) for r in requests()]
  eng = engine(tiny_model, divide_every=3, park_rows=4)
  seen = []

  class Watched(_FreeYields):
    def next_to_admit(self, queue, finished, live):
      seen.append((dict(finished), dict(live)))
      return super().next_to_admit(queue, finished, live)

  runs = {}
  for name, cls in (("kept", Watched), ("rebuilt", _Rebuilt)):
    policy = make_policy("history_residual", predictor=LengthPredictor(table))
    out = eng.generate(reqs, admission=cls(policy))
    st = eng.stats
    runs[name] = (out, st.yields, st.steps, list(st.admitted),
                  [e[2:5] for e in st.timeline], st.yield_rules)
  (kept, *k_rest, k_rules), (rebuilt, *r_rest, r_rules) = runs["kept"], runs["rebuilt"]
  _same(rebuilt, kept)
  assert k_rest == r_rest and k_rest[0] > 0  # same yields, steps, admissions and timeline
  assert 0 < k_rules < r_rules
  final = {r.request_id: len(r.tokens) for r in kept}
  for finished, live in seen:
    assert not set(finished) & set(live)
    assert all(0 <= n <= final[i] for i, n in live.items())


class _FewestTokens:
  """Online, with neither `yield_rule` nor `should_yield`: the queued request with the fewest
  tokens so far goes next (an unstarted one has none)."""

  online = True

  def order(self, requests):
    return list(requests)

  def next_to_admit(self, queue, finished, live):
    return min(range(len(queue)), key=lambda i: (live.get(queue[i].request_id, 0), i))


def test_each_yield_gives_way_to_its_own_pick_after_the_free_slots_take_theirs():
  """Requests 0 and 1 run at 8 tokens; queued: 2 (unstarted) and 3 (yielded at 20 tokens).
  Only one queued request beats a running one, so one yields: both did (each was compared with
  the one best pick), and the freed slot took request 0 straight back, two row copies for
  nothing. With a slot empty, that slot takes request 2 and none yields. The generic rule
  (interface.yield_rule over `next_to_admit`) through the engine's slots_to_yield."""
  from rhyme_jax.rollout.divided import YieldRules, slots_to_yield
  from rhyme_jax.rollout.interface import yield_rule
  from rhyme_jax.rollout.live import LiveRequest
  reqs = [Request(i, [1], SamplingParams(max_new_tokens=64)) for i in range(4)]
  order, live = _FewestTokens(), {0: 8, 1: 8, 3: 20}
  running = []
  for r in reqs[:2]:
    lv = LiveRequest(r)
    lv.tokens = [0] * live[r.request_id]
    running.append(lv)
  queue = [reqs[2], reqs[3]]
  rule = yield_rule(order, queue, {}, live, 8)
  assert [rule(r) for r in reqs[:2]] == [True, False]
  assert slots_to_yield(running, queue, YieldRules(order, {}, live, 8), every=8, room=4) == [0]
  for lv in running:
    lv.since = 0
  assert slots_to_yield(running + [None], queue + [reqs[3]], YieldRules(order, {}, live, 8),
                        every=8, room=4) == []  # the empty slot takes 2; 3 trails them both
  rule = yield_rule(order, queue, {}, live, 8, free=1)
  assert [rule(r) for r in reqs[:2]] == [False, False]


def test_divide_every_needs_park_rows():
  with pytest.raises(ValueError, match="park_rows"):
    EngineConfig(divide_every=8)
  with pytest.raises(ValueError, match="divide_every"):
    EngineConfig(divide_every=-1, park_rows=2)


def test_a_request_parked_in_flight_that_finished_frees_its_row(tiny_model, monkeypatch):
  """Rows park while the step before is still in flight; when that step ends the request
  (EOS or its cap), its pool row is freed without a copy back and it never resumes."""
  from rhyme_jax.rollout import divided
  drops = []
  real_drop = divided.ParkPool.drop
  monkeypatch.setattr(divided.ParkPool, "drop",
                      lambda self, rid: (drops.append(rid), real_drop(self, rid)))
  base = engine(tiny_model).generate(requests(24, seed=4))
  eng = engine(tiny_model, divide_every=1, park_rows=4)
  divided_results = eng.generate(requests(24, seed=4), admission=FewestTokensFirst())
  _same(base, divided_results)
  assert drops and eng.stats.yields > len(drops)
  assert eng.park_pool().free_rows() == 4  # every row back in the pool at the end


def test_no_compilation_when_dividing_with_params_on_a_mesh(tiny_model):
  """The trainer's case: params on a (one-device) mesh; the park pool is placed as the states
  are, so parking and resuming after warm-up compile nothing."""
  import jax
  from flax import nnx
  from rhyme_jax import parallel
  graphdef, params = nnx.split(tiny_model)
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  eng = engine(nnx.merge(graphdef, placed), divide_every=4, park_rows=3)
  before = dict(TRACE_COUNTS)
  eng.generate(requests(), admission=FewestTokensFirst())
  assert dict(TRACE_COUNTS) == before and eng.stats.yields > 0


def _unpack(state, ints_N):
  """`step.pass_ints`' array as (park_2xW, resume_2xW, ints_5xB)."""
  b = state.batch
  w = (len(ints_N) - 5 * b) // 4
  return (ints_N[:2 * w].reshape(2, w), ints_N[2 * w:4 * w].reshape(2, w),
          ints_N[4 * w:].reshape(5, b))


def _real_pairs(state, ints_N, sink):
  """The distinct (pool row, slot) parks and (slot, pool row) resumes of one
  `park_resume_load` call, less its padding (copies to or from the pool's sink row)."""
  park_2xW, resume_2xW, _ = _unpack(state, ints_N)
  parks = {(int(r), int(s)) for r, s in zip(*park_2xW) if r != sink}
  resumes = {(int(s), int(r)) for s, r in zip(*resume_2xW) if r != sink}
  return parks, resumes


def test_a_pass_makes_its_copies_and_slot_loading_in_one_call(tiny_model, monkeypatch):
  """Every request a pass yields is parked, and every parked request it admits comes back, in
  the one call that loads the pass's admitted slots: one call per pass that moves rows, fewer
  than one per yield when passes yield several (as the 4 requests admitted together do, each
  asked after 4 tokens)."""
  from rhyme_jax.rollout import compiled
  calls = []
  real = compiled.park_resume_load_jit
  monkeypatch.setattr(compiled, "park_resume_load_jit",
                      lambda state, pool, ints, floats: (
                          calls.append(_real_pairs(state, ints, pool.batch - 1)),
                          real(state, pool, ints, floats))[1])
  base = engine(tiny_model).generate(requests())
  eng = engine(tiny_model, divide_every=4, park_rows=3)
  calls.clear()
  _same(base, eng.generate(requests(), admission=FewestTokensFirst()))
  st = eng.stats
  parks = [len(p) for p, _ in calls]
  resumes = [len(r) for _, r in calls]
  # every yield's row out and back (none ended in flight), each pass's parks in one call
  assert sum(parks) == sum(resumes) == st.yields
  assert sum(n > 0 for n in parks) == st.yield_passes < st.yields and max(parks) > 1
  assert len(calls) < st.yield_passes + sum(n > 0 for n in resumes)  # some calls move both
  # The timeline: one entry per step, in order, each with what was dispatched before it;
  # together they count every yield, every request prefilled once and every resumption.
  times = [t for t, *_ in st.timeline]
  assert len(times) == st.steps and times == sorted(times) and times[-1] <= st.total_time_s
  assert {shape for _, shape, *_ in st.timeline} == set(st.steps_by_shape)
  yields, prefilled, resumed = (sum(e[k] for e in st.timeline) for k in (2, 3, 4))
  assert (yields, prefilled, resumed) == (st.yields, len(requests()), st.yields)
  # Warm-up timed passes of one yield and of several; the per-row part is what a yield adds
  # to a pass that already copies.
  cost = eng.yield_cost
  assert cost.rows == 3 and cost.one > 0 and cost.many > 0
  assert cost.pass_seconds(0) == 0 and cost.pass_seconds(1) <= cost.pass_seconds(3)
  assert cost.fixed >= 0 and cost.per_row >= 0


def _random_state(cfg, batch, cache_len, seed=0):
  import jax.numpy as jnp
  from rhyme_jax.models.attention import KVCache
  from rhyme_jax.rollout.step import DecodeState
  rng = np.random.default_rng(seed)
  shape = KVCache.zeros(cfg, batch, cache_len).k_LxBxSxKxH.shape
  return DecodeState.empty(KVCache(jnp.asarray(rng.normal(size=shape), jnp.float32),
                                   jnp.asarray(rng.normal(size=shape), jnp.float32)))


def _loads(batch, slots):
  """load_slots' arrays pointing `slots` at requests 500 + slot with cached length 7."""
  ints, floats = np.zeros((5, batch), np.int32), np.ones((2, batch), np.float32)
  for s in slots:
    ints[:, s] = 1, 7, 1, 500 + s, 0
  return ints, floats


def test_park_pool_moves_a_large_pass_in_calls_of_at_most_max_pass_rows(tiny_model, monkeypatch):
  """11 rows parked and resumed in one pass take four calls: the parks (8, then 3 padded to
  4), then the resumes (the same); resumed into other slots, each slot holds the KV row its
  request had, and only the last call loads slots. Widths are the compiled pass sizes."""
  from rhyme_jax.rollout import compiled, divided
  from rhyme_jax.rollout.live import LiveRequest
  cfg = tiny_model.cfg
  pool = divided.ParkPool(cfg, 12, 8, lambda t: t)
  assert pool.pass_sizes(12) == [1, 2, 4, 8] and pool.pass_sizes(3) == [1, 2, 4]
  state = _random_state(cfg, 12, 8)
  before = np.array(state.cache.k_LxBxSxKxH)
  widths, loaded = [], []
  real = compiled.park_resume_load_jit
  monkeypatch.setattr(compiled, "park_resume_load_jit",
                      lambda state, pool_, ints, floats: (
                          widths.append(tuple(a.shape[1] for a in _unpack(state, ints)[:2])),
                          loaded.append(int(_unpack(state, ints)[2][0].sum())),
                          real(state, pool_, ints, floats))[2])
  pool.park([(s, LiveRequest(Request(100 + s, [0]))) for s in range(11)])
  assert pool.free_rows() == 1 and pool.due() and not widths  # the copies wait for flush
  pool.resume([((s + 1) % 12, 100 + s) for s in range(11)])
  state = pool.flush(state, *_loads(12, [3]))
  assert widths == [(8, 8), (4, 4), (8, 8), (4, 4)] and loaded == [0, 0, 0, 1]
  assert pool.free_rows() == 12 and not pool.due()
  after = np.array(state.cache.k_LxBxSxKxH)
  for s in range(11):
    np.testing.assert_array_equal(after[:, (s + 1) % 12], before[:, s])
  assert np.asarray(state.length_B).tolist() == [7 if s == 3 else 0 for s in range(12)]


def test_a_slot_parked_and_refilled_in_one_pass_keeps_both_rows(tiny_model):
  """A pass that parks slot 2's request and resumes another parked request into slot 2 makes
  one call: the leaving row is saved before the returning one is written. A pass that only
  parks, or only resumes, pads the other way with copies nobody reads."""
  from rhyme_jax.rollout import divided
  from rhyme_jax.rollout.live import LiveRequest
  cfg = tiny_model.cfg
  pool = divided.ParkPool(cfg, 4, 8, lambda t: t)
  state = _random_state(cfg, 4, 8, seed=1)
  rows = np.array(state.cache.k_LxBxSxKxH)
  pool.park([(0, LiveRequest(Request(10, [0])))])  # only parks: slot 0's row saved
  state = pool.flush(state, *_loads(4, []))
  pool.park([(2, LiveRequest(Request(12, [0])))])
  pool.resume([(2, 10)])  # request 10's row back, into the slot request 12 leaves
  state = pool.flush(state, *_loads(4, [2]))
  after = np.array(state.cache.k_LxBxSxKxH)
  np.testing.assert_array_equal(after[:, 2], rows[:, 0])
  np.testing.assert_array_equal(after[:, 1], rows[:, 1])  # untouched
  np.testing.assert_array_equal(after[:, 3], rows[:, 3])
  pool.resume([(3, 12)])  # only resumes: request 12's row, from before the second pass
  state = pool.flush(state, *_loads(4, []))
  after = np.array(state.cache.k_LxBxSxKxH)
  np.testing.assert_array_equal(after[:, 3], rows[:, 2])
  np.testing.assert_array_equal(after[:, 2], rows[:, 0])
  assert pool.free_rows() == 4 and pool.record(10) is None


def test_host_time_is_split_by_part(tiny_model):
  """EngineStats splits the host's time outside blocking reads by part (bench/schedule_engine's
  second table): step dispatches, admissions, yield checks and parks, reading outputs. Each
  part is counted (yields only where the rollout is divided) and together they stay within
  the host time they split; the thread's CPU time is counted too."""
  reqs = requests(16, seed=2)
  for divide in (0, 1):
    eng = engine(tiny_model, divide_every=divide, park_rows=4 if divide else 0)
    eng.generate(reqs, admission=FewestTokensFirst() if divide else None)
    st = eng.stats
    parts = (st.dispatch_time_s, st.prefill_time_s, st.read_time_s, st.yield_time_s)
    assert all(p > 0 for p in parts[:3]) and (parts[3] > 0) == bool(divide)
    assert (st.yields > 0) == bool(divide)
    assert sum(parts) <= st.total_time_s - st.device_time_s
    assert 0 < st.cpu_time_s
