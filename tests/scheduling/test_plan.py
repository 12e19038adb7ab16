"""plan_step: the trainer's one call (shard plan + admission order), and the guarantee that an
admission order changes when requests run, never what they sample (the real engine)."""

import zlib

import numpy as np
import pytest

from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams
from rhyme_jax.scheduling.plan import SCHEDULES, plan_step
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable

G = 4


@pytest.fixture(scope="module")
def tiny_model():
  """A random tiny Llama-style model (vocab 64): the real engine, small."""
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  return init_model(cfg, seed=1)


def mixed_prompts(n, vocab, seed=0, max_prompt=20):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(1, max_prompt))).tolist()
          for _ in range(n)]


def _requests(n_groups=4, seed=0):
  params = SamplingParams(temperature=1.0, max_new_tokens=24)
  prompts = mixed_prompts(n_groups, 64, seed)
  return [Request(g * G + j, prompts[g], params, group_id=g, prompt_key=f"p{g}")
          for g in range(n_groups) for j in range(G)]


def test_plan_orders_and_shards_deterministically():
  reqs = _requests(6)
  table = LengthTable()
  for g, n in enumerate([5, 40, 10, 30, 20, 35]):
    table.add(f"p{g}", 0, [n] * G)
  pred = LengthPredictor(table)
  plan = plan_step(reqs, pred, num_shards=2)
  # LPT on group work 8x{40,35,30,20,10,5}: {40,20,10} / {35,30,5} -> 70 each.
  assert plan.shard_of_group == {1: 0, 5: 1, 3: 1, 4: 0, 2: 0, 0: 1}
  assert [r.group_id for r in plan.requests_for(0)] == [1] * G + [4] * G + [2] * G
  alt = plan_step(reqs, pred, num_shards=2, step=1, policy="history_alt")
  assert [r.group_id for r in alt.requests_for(0)] == [2] * G + [4] * G + [1] * G
  rr = plan_step(reqs, None, num_shards=2, policy="fifo")
  assert rr.shard_of_group == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
  assert len(plan.policies) == 2 and plan.policies[0] is not plan.policies[1]
  with pytest.raises(ValueError, match="shard 2 of 2"):
    plan.requests_for(2)


def _crc(results):
  return zlib.crc32(b"".join(r.tokens.astype("<i4").tobytes() for r in results))


def test_admission_order_does_not_change_what_is_sampled(tiny_model):
  """The real engine under every trainer schedule (fifo, history longest-first, the odd step of
  the alternation, Seer probe-first with online feedback) and a random order: it admits in the
  plan's order and samples the same tokens (CRC32 over all responses)."""
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=0, eos_ids=(3,), seed=5)
  reqs = _requests(4)
  first = RolloutEngine(tiny_model, cfg).generate(reqs)
  lengths = {r.request_id: len(r.tokens) for r in first}
  assert len(set(lengths.values())) > 3
  table = LengthTable()
  for g in range(4):
    table.add(f"p{g}", 0, [lengths[g * G + j] for j in range(G)])
  pred = LengthPredictor(table)
  crcs = {"fifo": _crc(first)}
  for name, step in [*[(s, 1) for s in SCHEDULES.values()], ("random", 0)]:
    plan = plan_step(reqs, pred, policy=name, step=step, seed=1)
    eng = RolloutEngine(tiny_model, cfg)
    res = eng.generate(reqs, admission=plan.admission(0))
    crcs[name] = _crc(res)
    for a, b in zip(first, res):
      np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"{name}: {a.request_id}")
    opening = [r.request_id for r in plan.requests_for(0)]
    if name == "history_probe":  # probes (one per group) first, by predicted length
      assert len({i // G for i in eng.stats.admitted[:4]}) == 4
      assert eng.stats.admitted[:4] == [opening[k] for k in range(0, 16, G)]
    else:
      assert eng.stats.admitted == opening, name
    if name != "fifo":
      assert opening != [r.request_id for r in reqs], name
  assert len(set(crcs.values())) == 1, crcs
  # The alternation: long->short on even steps, short->long on odd ones.
  for step, sign in ((0, -1), (1, 1)):
    order = plan_step(reqs, pred, policy="history_alt", step=step).requests_for(0)
    predicted = [pred.predict(r.prompt_key).length for r in order]
    assert predicted == sorted(predicted, key=lambda x: sign * x)
