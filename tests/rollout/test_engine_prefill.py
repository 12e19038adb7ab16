"""Admission's prefill (RolloutEngine._admit): a GRPO group's prompt is prefilled once and its
KV row copied into the slots of the group's other samples; what is sampled never changes."""

import dataclasses

import pytest

from rhyme_jax.rollout.drafts import OracleDrafter
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

from tests.rollout.conftest import mixed_prompts
from tests.rollout.test_divided import FewestTokensFirst, _same

EOS = 3
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16)
G = 4


def grouped(groups=3, seed=0):
  """G samples of each of `groups` prompts (2 to 19 tokens), request ids in data order."""
  prompts = mixed_prompts(groups, 64, seed)
  prompts = [p if len(p) > 1 else p + [5, 7] for p in prompts]
  return [Request(g * G + j, prompts[g], PARAMS, group_id=g)
          for g in range(groups) for j in range(G)]


def engine(model, budget=0, **kw):
  cfg = EngineConfig(max_len=64, buckets=(4, 2, 1), max_draft=budget,
                     pack_factors=(budget + 1,) if budget else (2,),
                     speculate="always" if budget else "never", kv_buckets=1, eos_ids=(EOS,),
                     seed=5, prefill_chunk=4, **kw)
  eng = RolloutEngine(model, cfg)
  eng.warmup()
  return eng


@pytest.mark.parametrize("mode", ["plain", "speculative", "divided"])
def test_a_group_shares_its_prompt_prefill_and_samples_the_same(tiny_model, mode):
  """12 requests (3 prompts x G = 4) through 4 slots: the first sample of a prompt is
  prefilled, the others copy a row that holds the prompt (a sibling prefilled in the same pass,
  still running, or resumed after a yield). Tokens and log-probs equal those of the same
  requests with one group each (nothing to share), and nothing compiles after warm-up."""
  kw = dict(divide_every=3, park_rows=3) if mode == "divided" else {}
  budget = 4 if mode == "speculative" else 0
  alone = [dataclasses.replace(r, group_id=100 + r.request_id) for r in grouped()]
  solo = engine(tiny_model, budget, **kw)
  order = FewestTokensFirst if mode == "divided" else (lambda: None)
  base = solo.generate(alone, admission=order())
  assert solo.stats.prefill_shared == 0
  eng = engine(tiny_model, budget, **kw)
  if budget:
    eng.drafter = OracleDrafter({r.request_id: r.tokens for r in base}, 64, accuracy=0.7,
                                seed=1)
  before = dict(TRACE_COUNTS)
  shared = eng.generate(grouped(), admission=order())
  assert dict(TRACE_COUNTS) == before, "a rollout compiled"
  _same(base, shared)
  st = eng.stats
  assert st.prefill_shared >= 6 and st.prefill_chunks < solo.stats.prefill_chunks
  if mode == "divided":
    assert st.yields > 0


def test_a_group_id_with_another_prompt_is_prefilled(tiny_model):
  """Sharing needs the same prompt, not only the same group id: requests that all carry group
  id 0 but differ in prompt are each prefilled."""
  reqs = [Request(i, p, PARAMS, group_id=0) for i, p in enumerate(mixed_prompts(8, 64, 3))
          if len(p) > 1]
  assert len({tuple(r.prompt) for r in reqs}) == len(reqs)
  eng = engine(tiny_model)
  out = eng.generate(reqs)
  assert eng.stats.prefill_shared == 0
  _same(engine(tiny_model).generate([dataclasses.replace(r, group_id=r.request_id)
                                     for r in reqs]), out)


def test_shared_sizes_cover_a_pass():
  """Copy widths compiled per bucket: none for one slot (no sibling), powers of two up to
  the slots a pass can fill from another (bucket - 1, at most 8 per call)."""
  eng = RolloutEngine.__new__(RolloutEngine)
  assert eng.shared_sizes(1) == [] and eng.shared_sizes(2) == [1]
  assert eng.shared_sizes(4) == [1, 2, 4] and eng.shared_sizes(64) == [1, 2, 4, 8]


def test_no_compilation_when_sharing_with_params_on_a_mesh(tiny_model):
  """The trainer's case: params on a (one-device) mesh; the prompt copies compiled at warm-up
  serve the rollout's states, divided or not."""
  import jax
  from flax import nnx
  from rhyme_jax import parallel
  graphdef, params = nnx.split(tiny_model)
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  for kw in ({}, dict(divide_every=3, park_rows=3)):
    eng = engine(nnx.merge(graphdef, placed), **kw)
    before = dict(TRACE_COUNTS)
    eng.generate(grouped(), admission=FewestTokensFirst() if kw else None)
    assert dict(TRACE_COUNTS) == before and eng.stats.prefill_shared >= 6
