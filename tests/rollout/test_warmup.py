"""Warm-up (rollout/warmup.py): buckets compiled in threads compile exactly what a serial
warm-up does, and a rollout after either compiles nothing."""

import collections

import pytest

from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rollout.drafts import RandomDrafter
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

from tests.rollout.conftest import mixed_prompts


def test_threaded_warmup_compiles_what_a_serial_one_does():
  """Warm-up compiles its buckets in threads (`compile_threads`): each function is traced as
  often as by a warm-up one bucket after another, so its timed pass found every shape compiled,
  and a rollout after it compiles nothing. Two models of different structures, so neither
  engine finds the other's compilations."""
  traced = {}
  for threads, layers in ((1, 1), (2, 2)):
    model = init_model(ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=40,
                                   num_layers=layers, num_heads=2, num_kv_heads=1,
                                   head_dim=12), seed=2)
    cfg = EngineConfig(max_len=64, buckets=(2, 1), max_draft=2, pack_factors=(3,),
                       speculate="always", kv_buckets=2, eos_ids=(3,), seed=5,
                       divide_every=4, park_rows=2, compile_threads=threads)
    eng = RolloutEngine(model, cfg, RandomDrafter(64, seed=0))
    before = collections.Counter(TRACE_COUNTS)
    eng.warmup(filters=False)
    traced[threads] = collections.Counter(TRACE_COUNTS) - before
    before = dict(TRACE_COUNTS)
    eng.generate([Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=24))
                  for i, p in enumerate(mixed_prompts(7, 64, seed=3))])
    assert dict(TRACE_COUNTS) == before, f"a rollout compiled after warm-up in {threads} threads"
  assert traced[2] == traced[1] and traced[1]["step"] == 2 * 2 * 2  # buckets x shapes x kv
  assert traced[1]["park_resume_load"] > 0 and traced[1]["regroup"] == 1


def test_compile_threads_must_not_be_negative():
  with pytest.raises(ValueError, match=r"compile_threads=-1: must be >= 0"):
    EngineConfig(compile_threads=-1)


def test_default_threads_one_per_bucket_on_cpu_else_as_configured(tiny_model):
  import os
  from rhyme_jax.rollout.warmup import compile_threads
  auto = RolloutEngine(tiny_model, EngineConfig(max_len=64, buckets=(8, 4, 2, 1)))
  assert compile_threads(auto) == min(4, os.cpu_count())  # the tests run on a CPU backend
  fixed = RolloutEngine(tiny_model, EngineConfig(max_len=64, buckets=(8, 4, 2, 1),
                                                 compile_threads=3))
  assert compile_threads(fixed) == 3
