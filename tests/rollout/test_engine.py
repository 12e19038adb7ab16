"""Engine behaviour: speculation never changes what is sampled, shapes compile once, slots stay
full, bad requests fail alone."""

import dataclasses
import zlib

import numpy as np
import pytest

from rhyme_jax.rollout.drafts import (DraftTree, NoDrafts, OracleDrafter, RandomDrafter,
                                      StatelessDrafter)
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.live import LiveRequest
from rhyme_jax.rollout.sampling import SamplingParams

from tests.rollout.conftest import mixed_prompts

EOS = 3
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=24),
    "t1.0": SamplingParams(temperature=1.0, max_new_tokens=24),
    "t0.7_topp0.9": SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24),
}


def requests(params, n=8, seed=0):
  return [Request(i, p, params, group_id=i // 4) for i, p in enumerate(mixed_prompts(n, 64, seed))]


def engine(model, drafter, budget=4, buckets=(4, 2, 1)):
  """Every step in one shape: the largest speculative one for budget > 0, plain for 0."""
  cfg = EngineConfig(max_len=64, buckets=buckets, max_draft=budget,
                     pack_factors=(budget + 1,) if budget else (2,),
                     speculate="always" if budget else "never", kv_buckets=1, eos_ids=(EOS,),
                     seed=5)
  return RolloutEngine(model, cfg, drafter)


class MalformedDrafter(StatelessDrafter):
  """Right tokens in trees that break the contract while claiming to keep it (`clean`): a
  sibling repeating the right token, tokens outside the vocabulary (above it, negative),
  parents that are not earlier nodes. Such drafts may only cost speed."""

  def __init__(self, targets, vocab):
    self.targets, self.vocab = targets, vocab

  def propose(self, queries):
    out = []
    for q in queries:
      t = [int(x) for x in self.targets[q.request_id][len(q.response):]] + [0, 0, 0]
      nodes = [[(t[0], -1), (t[0], -1), (t[1], 0), (t[2], 2)],  # repeat, then the right path
               [(self.vocab + 7, -1), (t[0], -1), (-5, 1), (t[1], 1)],
               [(t[0], -1), (t[1], 5), (t[1], -3), (t[1], 0)]][q.request_id % 3]
      tok, par = zip(*nodes)
      out.append(DraftTree(np.asarray(tok, np.int32), np.asarray(par, np.int32),
                           np.ones(len(tok), bool), clean=True))
    return out


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_speculation_is_invisible_same_step_shape(tiny_model, name):
  """Oracle, wrong-branch, garbage, EOS-laden and malformed drafts emit exactly what empty
  drafts emit."""
  params = PARAMS[name]
  plain = engine(tiny_model, NoDrafts()).generate(requests(params))
  targets = {r.request_id: r.tokens for r in plain}
  drafters = {
      "oracle": OracleDrafter(targets, 64, accuracy=1.0),
      "oracle_branchy": OracleDrafter(targets, 64, accuracy=0.7, branches=2, seed=1),
      "garbage_with_eos": RandomDrafter(64, seed=2, extra_tokens=(EOS,)),
      "malformed": MalformedDrafter(targets, 64),
  }
  for dname, drafter in drafters.items():
    eng = engine(tiny_model, drafter)
    spec = eng.generate(requests(params))
    for a, b in zip(plain, spec):
      np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"{dname} request {a.request_id}")
      assert a.finish_reason == b.finish_reason
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    if dname == "oracle":
      assert eng.stats.mean_accepted_length > 3.0  # perfect drafts: ~budget+1 per verify
      assert eng.stats.forwards_per_token < 0.5
    if dname == "malformed":  # its right tokens were taken where the tree let them be
      assert eng.stats.mean_accepted_length > 1.5
  assert any(r.finish_reason == "eos" for r in plain) or name == "greedy"


def test_against_one_token_decoding_divergences_are_near_ties(tiny_model):
  """Tree verification vs true one-token steps (different matmul shapes): any divergence is a
  float near-tie of the two top logits at the first differing position."""
  params = SamplingParams(temperature=0.0, max_new_tokens=40)
  reqs = lambda: requests(params, n=12, seed=3)
  one = engine(tiny_model, None, budget=0).generate(reqs())
  targets = {r.request_id: r.tokens for r in one}
  spec = engine(tiny_model, OracleDrafter(targets, 64, accuracy=0.8), budget=6).generate(reqs())
  divergent = 0
  for a, b in zip(one, spec):
    if np.array_equal(a.tokens, b.tokens):
      continue
    divergent += 1
    k = int(np.argmax(a.tokens[:len(b.tokens)] != b.tokens[:len(a.tokens)]))
    seq = np.concatenate([a.prompt, a.tokens[:k]])[None]
    logits = np.asarray(tiny_model(seq, np.arange(seq.shape[1])[None]).logits_BxTxV)[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 1e-4, f"request {a.request_id}: not a near-tie"
  assert divergent <= 2  # divergences are rare


def test_no_recompilation_after_warmup(tiny_model):
  """Warm-up compiles every shape; rollouts with mixed prompt and response lengths then
  compile nothing (counted traces)."""
  eng = engine(tiny_model, RandomDrafter(64, seed=0), buckets=(8, 4, 2, 1))
  eng.warmup(filters=False)
  before = dict(TRACE_COUNTS)
  eng.generate(requests(PARAMS["t1.0"], n=11, seed=2))
  eng.generate(requests(SamplingParams(0.0, max_new_tokens=5), n=3, seed=4))
  eng.generate([Request(0, list(range(1, 40)), SamplingParams(0.0, max_new_tokens=20))])
  assert dict(TRACE_COUNTS) == before


def test_no_compilation_with_params_on_a_mesh(tiny_model):
  """The trainer's case: params placed on a (one-device) mesh. Steps return mesh-placed states;
  fresh states and warm-up match them, so a rollout after warm-up compiles nothing."""
  import jax
  from flax import nnx
  from rhyme_jax import parallel
  graphdef, params = nnx.split(tiny_model)
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  eng = engine(nnx.merge(graphdef, placed), RandomDrafter(64, seed=1), buckets=(4, 2, 1))
  eng.warmup(filters=False)
  before = dict(TRACE_COUNTS)
  eng.generate(requests(PARAMS["t1.0"], n=7, seed=3))
  assert dict(TRACE_COUNTS) == before


def test_continuous_batching_keeps_slots_full(tiny_model):
  params = [SamplingParams(temperature=1.0, max_new_tokens=int(n))
            for n in np.random.default_rng(0).integers(1, 30, size=20)]
  reqs = [Request(i, [1 + i, 2, 5], p) for i, p in enumerate(params)]
  eng = engine(tiny_model, None, budget=0, buckets=(4, 2, 1))
  results = eng.generate(reqs)
  assert all(len(r.tokens) <= p.max_new_tokens for r, p in zip(results, params))
  while_queued = [(b, live) for b, _, live, queued in eng.stats.trace if queued > 0]
  assert while_queued and all(live == b for b, live in while_queued)
  # The tail runs in smaller buckets (which ones depends on how finishes coincide).
  used = {b for b, _, _, _ in eng.stats.trace}
  assert 4 in used and 1 in used and used <= {4, 2, 1}


def test_bad_requests_fail_alone(tiny_model):
  good = SamplingParams(temperature=0.0, max_new_tokens=8)
  reqs = [
      Request(0, [1, 2, 3], good),
      Request(1, [], good),
      Request(2, list(range(60)), good),  # 60 + 8 > max_len 64
      Request(3, [1, 2], SamplingParams(temperature=0.0, max_new_tokens=0)),
      Request(4, [1, 2], SamplingParams(temperature=-1.0)),
      Request(5, [1, 2], SamplingParams(top_p=2.0)),
      Request(6, [1, 999], good),
      Request(0, [4, 5], good),  # duplicate id
      Request(7, [4, 5, 6], good),
      Request(2**31, [4, 5], good),  # the device holds ids as int32
      Request(8, [1, 2], SamplingParams(top_k=2**40)),
  ]
  reqs.append(reqs[8])  # the same request object twice: its second copy is the duplicate
  # a float cap equal to an integer: it reached a drafter's budget as 2.0 and crashed the step
  reqs.append(Request(12, [1, 2], SamplingParams(max_new_tokens=5.0)))
  # a field of the wrong type (a TypeError, which stopped the whole call)
  reqs.append(Request(13, [1, 2], SamplingParams(stop_sequences=(7, 8))))
  # a fractional id: 1.5 and 1.7 would both be request 1 on the device (the same keys)
  reqs.append(Request(1.5, [1, 2], good))
  res = engine(tiny_model, RandomDrafter(64, seed=0)).generate(reqs)
  assert len(res) == len(reqs)
  errors = {i: r.error for i, r in enumerate(res) if r.finish_reason == "error"}
  assert set(errors) == {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14}
  assert "invalid sampling params" in errors[13]
  assert "request_id must be an integer" in errors[14]
  assert "max_new_tokens=5.0: must be an integer" in errors[12]
  assert "int32" in errors[9] and "top_k" in errors[10]
  assert "duplicate" in errors[11] and res[11].request_id == 7
  assert "empty prompt" in errors[1]
  assert "max_len=64" in errors[2] and "60 tokens" in errors[2]
  assert "max_new_tokens" in errors[3]
  assert "temperature" in errors[4]
  assert "top_p" in errors[5]
  assert "999" in errors[6] and "vocabulary" in errors[6]
  assert "duplicate" in errors[7]
  for i in (0, 8):
    assert res[i].finish_reason in ("length", "eos") and len(res[i].tokens) > 0
  # The good requests produce what they produce alone.
  alone = engine(tiny_model, RandomDrafter(64, seed=0)).generate([reqs[0]])[0]
  np.testing.assert_array_equal(alone.tokens, res[0].tokens)


def test_stop_sequences_and_max_tokens(tiny_model):
  free = engine(tiny_model, None, budget=0).generate(
      [Request(0, [7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=12))])[0]
  stop = tuple(int(t) for t in free.tokens[4:6])
  params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_sequences=(stop,))
  for drafter in (None, OracleDrafter({0: free.tokens}, 64)):
    res = engine(tiny_model, drafter).generate([Request(0, [7, 8, 9], params)])[0]
    first = next(i for i in range(2, len(free.tokens) + 1)
                 if tuple(free.tokens[i - 2:i]) == stop)
    np.testing.assert_array_equal(res.tokens, free.tokens[:first])
    assert res.finish_reason == "stop"
    if drafter is not None:  # right drafts past the stop: accepted counts the kept ones only
      assert res.drafted > len(res.tokens)
      assert res.accepted == len(res.tokens) - (res.steps - 1)


@pytest.mark.slow  # ~90 s on 2 cores: a warm-up of every speculative shape
def test_unverified_drafts_do_not_count_as_rejected(tiny_model):
  """A step that asked for drafts but verified none of a row's (the cost model found them not
  worth it) teaches the acceptance estimate nothing: before, each such step counted as a failed
  level for every row, so the estimate fell until no step even asked for drafts. What such
  steps teach is that asking does not pay: the asking decision's own calibration stops it."""
  calls = []

  class Unlikely(OracleDrafter):  # right drafts the drafter itself rates as near-hopeless
    def propose(self, queries):
      calls.append(len(queries))
      return [dataclasses.replace(t, probs=np.full(len(t.tokens), 0.01, np.float32))
              for t in super().propose(queries)]

  params = SamplingParams(temperature=0.0, max_new_tokens=12)
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=8, eos_ids=(EOS,), seed=5)
  plain = RolloutEngine(tiny_model, cfg, None).generate(requests(params))
  eng = RolloutEngine(tiny_model, cfg, Unlikely({r.request_id: r.tokens for r in plain}, 64))
  eng.warmup()
  eng.costs.seconds = {shape: 1.0 + 0.1 * shape[1] for shape in eng.costs.seconds}
  eng.costs.observe_time = lambda *a, **k: None
  res = eng.generate(requests(params))
  assert calls and eng.stats.spec_steps == 0  # asked (alpha's prior), then chose plain steps
  # ... and stopped asking once asking had delivered nothing: before the asking decision was
  # calibrated, every step of this rollout asked, drained the pipeline and stepped plain
  # (24 of 24 steps were blocking reads).
  assert len(calls) == eng.stats.asked_steps <= 0.25 * eng.stats.steps
  assert eng.stats.host_waits <= 0.25 * eng.stats.steps
  assert eng.costs.ask_scale < 1.0
  assert eng.costs.alpha("a request never seen") == pytest.approx(0.5)  # the prior, unmoved
  for a, b in zip(plain, res):
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_cost_model_chooses_plain_and_packed_steps(tiny_model):
  """speculate="auto": without a drafter every step is plain (one position per live row, and
  pipelined: almost no blocking host waits), and so is it with empty drafts; with perfect short drafts the cost model verifies
  them in packed steps, positions verified stay within 1.3x of live rows + drafted nodes, the
  tokens are the plain run's, nothing compiles after warm-up; group ends reach the drafter."""
  class Recorder(OracleDrafter):
    ended = []

    def end_group(self, group_id):
      self.ended.append(group_id)

  params = SamplingParams(temperature=0.0, max_new_tokens=12)
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=8, eos_ids=(EOS,), seed=5)
  eng = RolloutEngine(tiny_model, cfg, None)
  eng.warmup()
  before = dict(TRACE_COUNTS)
  plain = eng.generate(requests(params))
  assert {t for _, _, t, _ in eng.stats.steps_by_shape} == {1}
  assert eng.stats.host_waits <= 0.25 * eng.stats.steps
  eng = RolloutEngine(tiny_model, cfg, NoDrafts())  # asks for drafts, gets none: plain steps
  res = eng.generate(requests(params))
  assert {t for _, _, t, _ in eng.stats.steps_by_shape} == {1}
  for a, b in zip(plain, res):
    np.testing.assert_array_equal(a.tokens, b.tokens)
  drafter = Recorder({r.request_id: r.tokens for r in plain}, 64, max_len=2)
  eng = RolloutEngine(tiny_model, cfg, drafter)
  eng.warmup()  # step times of every shape, measured
  # A tiny model's step times are noise (a loaded machine can make a bigger step look dearer
  # than anything drafts gain): from here step costs are fixed and nearly flat in packed
  # positions (as on an accelerator), so the choice follows acceptance alone.
  eng.costs.seconds = {shape: 1.0 + 0.1 * shape[1] for shape in eng.costs.seconds}
  eng.costs.observe_time = lambda *a, **k: None
  res = eng.generate(requests(params))
  assert dict(TRACE_COUNTS) == before, "a rollout compiled"
  stats = eng.stats
  assert stats.spec_steps > 0 and stats.accepted > 0
  assert stats.positions <= 1.3 * stats.live_positions
  for a, b in zip(plain, res):
    np.testing.assert_array_equal(a.tokens, b.tokens)
  assert sorted(drafter.ended) == [0, 1]


class _Order:
  """A test admission order: opening order by `key`; online, the queued request whose group
  has the longest finished response so far (ties: queue order), as Seer's estimate does."""

  def __init__(self, key=None, online=False):
    self.key, self.online, self.calls = key, online, 0

  def order(self, reqs):
    return sorted(reqs, key=self.key) if self.key else list(reqs)

  def next_to_admit(self, queue, finished, live):
    self.calls += 1
    assert not set(finished) & set(live)
    if not self.online:
      return 0
    longest = {}
    for rid, n in finished.items():
      longest[rid // 4] = max(longest.get(rid // 4, 0), n)
    return min(range(len(queue)), key=lambda i: -longest.get(queue[i].request_id // 4, -1))


def test_admission_order_changes_when_not_what(tiny_model):
  """Requests of varied lengths (max_new_tokens 2..30, EOS) in arrival order, longest-first,
  shortest-first and an online order: the engine admits in the order asked, and every request
  samples the same tokens (keys depend on seed, request id and position only)."""
  rng = np.random.default_rng(7)
  prompts = mixed_prompts(12, 64, seed=5)
  reqs = [Request(i, prompts[i], SamplingParams(temperature=1.0, max_new_tokens=int(n)),
                  group_id=i // 4) for i, n in enumerate(rng.integers(2, 31, size=12))]
  cap = lambda r: r.params.max_new_tokens
  orders = {"fifo": None, "longest": _Order(key=lambda r: (-cap(r), r.request_id)),
            "shortest": _Order(key=lambda r: (cap(r), r.request_id)),
            "online": _Order(online=True)}
  runs = {}
  for name, order in orders.items():
    eng = engine(tiny_model, None, budget=0, buckets=(4, 2, 1))
    runs[name] = eng.generate(reqs, admission=order)
    admitted = eng.stats.admitted
    assert sorted(admitted) == list(range(12))
    if order is not None and order.key is not None:
      assert admitted == [r.request_id for r in order.order(reqs)], name
    if name == "online":
      assert order.calls == 12 and admitted[:4] == [0, 1, 2, 3]
  assert runs["fifo"] and [r.request_id for r in runs["longest"]] == list(range(12))
  crc = {name: zlib.crc32(b"".join(r.tokens.astype("<i4").tobytes() for r in res))
         for name, res in runs.items()}
  assert len(set(crc.values())) == 1, crc
  lengths = [len(r.tokens) for r in runs["fifo"]]
  assert len(set(lengths)) > 4  # varied lengths: the orders really differ in what runs when


def test_bad_admission_order_is_named(tiny_model):
  class Drops(_Order):
    def order(self, reqs):
      return list(reqs)[1:]

  class OutOfRange(_Order):
    def next_to_admit(self, queue, finished, live):
      return len(queue)

  reqs = requests(PARAMS["greedy"], n=3)
  with pytest.raises(ValueError, match="permutation of the valid requests"):
    engine(tiny_model, None, budget=0).generate(reqs, admission=Drops())
  with pytest.raises(ValueError, match="next_to_admit returned 3 for a queue of 3"):
    engine(tiny_model, None, budget=0).generate(reqs, admission=OutOfRange())


def test_bad_engine_config_is_named():
  with pytest.raises(ValueError, match=r"draft_mode='fast': expected one of \('sync'"):
    EngineConfig(draft_mode="fast")
  with pytest.raises(ValueError, match=r"max_draft=40: must be in \[0, 32\)"):
    EngineConfig(max_draft=40)
  with pytest.raises(ValueError, match=r"speculate='maybe'"):
    EngineConfig(speculate="maybe")
  with pytest.raises(ValueError, match=r"attention='triton': expected one of \('xla'"):
    EngineConfig(attention="triton")


def test_a_plain_step_moves_one_array_to_the_device(tiny_model):
  """A decode step's packed trees cross to the device as one array (PackedTrees.wire), its
  outputs come back as one (step.to_wire): on a GPU each transfer costs host time on
  the critical path. Two rollouts that differ only in length differ in host-to-device transfers
  by exactly their difference in steps (jax's transfer guard counts them)."""
  import os
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  from bench.common import host_to_device_transfers
  eng = RolloutEngine(tiny_model, EngineConfig(max_len=64, buckets=(4,), max_draft=0,
                                               speculate="never", eos_ids=(), seed=1))
  eng.warmup()
  moved, steps = [], []
  for n in (10, 25):
    reqs = [Request(i, [5, 6, 7, 8, 9], SamplingParams(temperature=1.0, max_new_tokens=n))
            for i in range(4)]
    moved.append(host_to_device_transfers(lambda: eng.generate(reqs)))
    steps.append(eng.stats.steps)
  assert steps[1] - steps[0] == 15 and moved[0] > steps[0]
  assert moved[1] - moved[0] == steps[1] - steps[0]
  # The one array read back holds the step's tokens, log-probs and counts, bit for bit: the
  # engine's call against the bare verify step on the same state.
  import jax
  from rhyme_jax.rollout import accept, step
  state = eng._admit(eng._new_state(4), list(enumerate(reqs)))
  trees = accept.pack([None] * 4, [True] * 4, 4)
  bare = jax.jit(step.verify_step, static_argnums=0,
                 static_argnames=("filters", "max_kv_len", "max_q_len"))
  _, out = bare(eng.graphdef, eng.params, state, trees, eng._seed, filters=False,
                max_kv_len=64, max_q_len=1)
  jax.block_until_ready(out)  # before the engine's call donates `state`
  _, wire = eng.verify(state, trees, False, 64, 1)
  for got, want in zip(step.from_wire(np.asarray(wire)),
                       (out.tokens_BxT, out.logprobs_BxT, out.num_emitted_B)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, np.asarray(want))


def test_a_plain_steps_roots_are_packed_once_per_live_pattern(tiny_model):
  """Plain steps reuse the wire array of the last live pattern (packing was a fifth of the
  host's time per step): it equals a fresh pack of that pattern, and a new pattern packs anew."""
  from rhyme_jax.rollout import accept
  eng = engine(tiny_model, NoDrafts(), budget=0)
  packs = []
  real_pack = accept.pack

  def counted(*args):
    packs.append(args[1])
    return real_pack(*args)

  patterns = [[True] * 4, [True] * 4, [True, False, True, True], [True] * 4]
  try:
    accept.pack = counted
    wires = [eng._plain_roots(tuple(live)) for live in patterns]
  finally:
    accept.pack = real_pack
  assert [tuple(p) for p in packs] == [tuple(patterns[i]) for i in (0, 2, 3)]
  assert wires[1] is wires[0]
  for live, wire in zip(patterns, wires):
    np.testing.assert_array_equal(wire, real_pack([None] * 4, live, 4).wire())


def test_a_rollout_warm_up_did_not_compile_for_is_named(tiny_model, caplog):
  """Steps compile per `filters`: a rollout with top-p requests on an engine warmed only for
  unfiltered ones compiles inside the rollout, and says so; once both are warmed, or before
  any warm-up (a caller that never warms), it says nothing."""
  import logging
  eng = engine(tiny_model, None, budget=0, buckets=(1,))
  topp = [Request(0, [1, 2], PARAMS["t0.7_topp0.9"])]
  with caplog.at_level(logging.WARNING):
    eng.generate(topp)
    assert not caplog.records
    eng.warmup(filters=False)
    eng.generate(topp)
    assert [r.getMessage() for r in caplog.records] == [
        "generate: these requests use top-p / top-k, but warm-up compiled steps only for "
        "requests that do not; each step shape compiles inside this rollout (call "
        "warmup(filters=True) first)"]
    caplog.clear()
    eng.warmup(filters=True)
    before = dict(TRACE_COUNTS)
    eng.generate(topp)
    eng.generate([Request(1, [1, 2], PARAMS["t1.0"])])
    assert not caplog.records and dict(TRACE_COUNTS) == before


def test_draft_choice_weighs_each_shape_at_the_cache_length_it_runs_in(tiny_model):
  """Near a cache-length boundary a plain step still fits the shorter length while every tree
  step needs the longer one; the choice must weigh each at the length its step will run in
  (the loop's), not all at the longest tree's. Here a step at the longer length costs 20x: at
  the boundary plain wins; well below it, where every shape fits the short length, trees do."""
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=8, kv_buckets=2, eos_ids=(EOS,),
                     seed=5)
  short, long = sorted(cfg.kv_lengths())
  assert short < long
  reqs = [Request(i, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_new_tokens=60))
          for i in range(4)]
  targets = {r.request_id: [5 + i % 7 for i in range(64)] for r in reqs}
  eng = RolloutEngine(tiny_model, cfg, OracleDrafter(targets, 64))
  eng.costs.seconds = {
      (b, p, t, s): (1.0 if s == short else 20.0)
      for b in cfg.buckets for p, t in [(b, 1)] + list(cfg.spec_shapes(b)) for s in (short, long)}
  assert max(t for _, t in cfg.spec_shapes(4)) > 2

  def chosen(context):  # (whether "auto" asks for drafts, the T of the shape chosen)
    slots = [LiveRequest(r, tokens=targets[r.request_id][:context - 4]) for r in reqs]
    ask, _ = eng._plan(4, slots, [0, 1, 2, 3], context)
    _, _, _, t, _ = eng._draft(4, slots, [0, 1, 2, 3], context, lookahead=False,
                               ahead_only=False)
    return ask, t

  assert chosen(short - 1) == (False, 1)  # plain fits `short`; any tree would run at `long`
  ask, t = chosen(short - 1 - max(t for _, t in cfg.spec_shapes(4)))  # all fit `short`
  assert ask and t > 1
