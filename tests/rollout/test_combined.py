"""Every rollout feature at once, against the plainest engine: the same tokens.

The other engine tests vary one thing at a time. Here each variant switches on several of the
things that move a request between rows and calls together: divided rollout with a park pool
of one or two rows, bucket moves, two cache lengths, multi-step launches (pipelined or not),
chunked prefill with prompts shared inside GRPO groups, speculation from an oracle or a garbage
drafter (EOS among its tokens), prompts whose length plus token cap fill the cache, stop
sequences, top-p / top-k, greedy rows; under three online orders (fewest tokens first, which
makes every asked request yield; history_residual; history_probe). The baseline decodes each
request alone in its own group: one token per step, one step per call, no yields, one cache
length. Tokens and finish reasons must match exactly, log-probs to float32 noise.

Slow (about two minutes a variant on a 2-core CPU, most of it warm-up).
"""

import dataclasses

import numpy as np
import pytest

from rhyme_jax.rollout.drafts import OracleDrafter, RandomDrafter
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams
from rhyme_jax.scheduling.admission import make_policy
from rhyme_jax.scheduling.engine_order import EngineOrder
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable

pytestmark = pytest.mark.slow

EOS, VOCAB, MAX_LEN, GROUP = 3, 64, 64, 3

VARIANTS = {
    "spec_auto+divide2+park1+kv2+multi3+moves": dict(
        buckets=(4, 2, 1), max_draft=4, pack_factors=(2, 5), speculate="auto", kv_buckets=2,
        multi_step=3, prefill_chunk=4, divide_every=2, park_rows=1, bucket_moves="always"),
    "plain+divide3+kv2+multi4_drain": dict(
        buckets=(4, 2, 1), max_draft=0, kv_buckets=2, multi_step=4, prefill_chunk=3,
        divide_every=3, park_rows=2, bucket_moves="always", drain_steps="multi"),
    "spec_auto+divide1+park1+multi4+unpiped+cost_moves": dict(
        buckets=(4, 2, 1), max_draft=5, pack_factors=(3,), speculate="auto", kv_buckets=2,
        multi_step=4, prefill_chunk=7, divide_every=1, park_rows=1, bucket_moves="cost",
        pipeline=False),
}


class FewestTokensFirst:
  """Online: the request with the fewest tokens so far runs (every asked request yields)."""

  online = True

  def order(self, requests):
    return list(requests)

  def next_to_admit(self, queue, finished, live):
    del finished
    return min(range(len(queue)), key=lambda i: (live.get(queue[i].request_id, 0), i))


def make_requests(seed: int, n: int = 14, fill_cache: bool = False) -> list[Request]:
  """GRPO groups of 3 (one prompt each); with `fill_cache` prompt + cap reach MAX_LEN or 1-2
  tokens short of it."""
  rng = np.random.default_rng(seed)
  out = []
  for group in range((n + GROUP - 1) // GROUP):
    prompt = rng.integers(0, VOCAB, int(rng.integers(30, 60) if fill_cache
                                        else rng.integers(1, 30))).tolist()
    for _ in range(min(GROUP, n - len(out))):
      cap = (MAX_LEN - len(prompt) - int(rng.choice([0, 0, 1, 2])) if fill_cache
             else int(rng.choice([1, 2, 5, 9, 17, 24])))
      params = SamplingParams(
          temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
          top_p=float(rng.choice([1.0, 1.0, 0.8])), top_k=int(rng.choice([0, 0, 10])),
          max_new_tokens=cap, stop_sequences=((7, 9),) if rng.random() < 0.2 else ())
      out.append(Request(len(out), prompt, params, group_id=group))
  return out


def _engine(model, filters: bool, **kw) -> RolloutEngine:
  eng = RolloutEngine(model, EngineConfig(max_len=MAX_LEN, eos_ids=(EOS,), seed=5, **kw))
  eng.warmup(filters)
  return eng


def _orders(seed: int):
  """(name, admission order, whether requests carry prompt keys for the history orders)."""
  table = LengthTable()
  rng = np.random.default_rng(seed)
  for group in range(10):
    table.add(group, 0, rng.integers(1, 25, GROUP).tolist())
  yield "fewest", FewestTokensFirst(), False
  for name in ("history_residual", "history_probe"):
    yield name, EngineOrder(make_policy(name, predictor=LengthPredictor(table))), True


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_feature_at_once_samples_what_plain_decoding_samples(tiny_model, variant):
  kw = VARIANTS[variant]
  engines = {}
  for seed, fill_cache in ((1, False), (2, False), (3, True)):
    reqs = make_requests(seed, fill_cache=fill_cache)
    filters = any(r.params.filters for r in reqs)
    if filters not in engines:
      engines[filters] = (_engine(tiny_model, filters, buckets=(4, 2, 1), max_draft=0,
                                  kv_buckets=1),
                          _engine(tiny_model, filters, **kw))
    plain, eng = engines[filters]
    base = plain.generate([dataclasses.replace(r, group_id=1000 + r.request_id)
                           for r in reqs])
    assert all(b.finish_reason != "error" for b in base)
    yields = 0
    for name, order, keyed in _orders(seed):
      if kw["max_draft"]:  # odd seeds: drafts from the answer (mostly right); even: garbage
        eng.drafter = (OracleDrafter({b.request_id: b.tokens for b in base}, VOCAB,
                                     accuracy=0.6, branches=2, seed=seed) if seed % 2 else
                       RandomDrafter(VOCAB, seed, extra_tokens=(EOS,)))
      got = eng.generate([dataclasses.replace(r, prompt_key=r.group_id) for r in reqs]
                         if keyed else reqs, admission=order)
      yields += eng.stats.yields
      for a, b in zip(base, got):
        where = f"seed {seed}, {name}, request {a.request_id}"
        assert b.finish_reason == a.finish_reason, where
        np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=where)
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, err_msg=where)
    assert yields > 0, f"seed {seed}: no request yielded; the variant tests less than it says"
