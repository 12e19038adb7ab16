"""The engine's decode attention on a Pallas kernel (interpreted on CPU): it samples exactly what
the XLA path samples through the same step shapes, plain and speculative with real drafts;
nothing compiles inside a rollout; CPU or an unsupported shape falls back to the XLA path with
one logged reason; the engine's cache lengths are ones both kernels take."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.models import attention
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rollout.drafts import OracleDrafter, RandomDrafter
from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

from tests.rollout.conftest import mixed_prompts

EOS = 3
VOCAB = 64
BUDGET = 4
LOGGER = "rhyme_jax.models.attention"


@pytest.fixture(scope="module")
def model16():
  """Tiny model with head dim 16: both kernels take it (the GPU kernel needs a power of two
  >= 16), so the same model runs through the TPU and the GPU kernel."""
  cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
  return init_model(cfg, seed=2)


def engine(model, drafter, attention_choice, budget, buckets=(4,), platform=None,
           monkeypatch=None):
  """One step shape per run (the largest speculative one for budget > 0, plain for 0), so the
  kernel and XLA runs go through identical shapes. `platform` pretends the backend for the
  choice of kernel only (it is still interpreted on the CPU)."""
  cfg = EngineConfig(max_len=32, buckets=buckets, max_draft=budget,
                     pack_factors=(budget + 1,) if budget else (2,),
                     speculate="always" if budget else "never", kv_buckets=1, eos_ids=(EOS,),
                     seed=5, attention=attention_choice)
  if platform is None:
    return RolloutEngine(model, cfg, drafter)
  with monkeypatch.context() as patch:
    patch.setattr(jax, "default_backend", lambda: platform)
    return RolloutEngine(model, cfg, drafter)


def requests(n=4, seed=0, max_new_tokens=10):
  params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
  return [Request(i, p, params, group_id=i // 2)
          for i, p in enumerate(mixed_prompts(n, VOCAB, seed, max_prompt=12))]


def assert_same(a_results, b_results, what):
  for a, b in zip(a_results, b_results, strict=True):
    np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"{what}: request {a.request_id}")
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def xla_runs(model16):
  """The XLA path's plain and speculative runs (real drafts: the plain run's tokens, partly
  wrong and branching), the reference the kernel runs must equal."""
  plain = engine(model16, None, "xla", 0).generate(requests())
  targets = {r.request_id: r.tokens for r in plain}
  drafter = lambda: OracleDrafter(targets, VOCAB, accuracy=0.7, branches=2, seed=1)
  eng = engine(model16, drafter(), "xla", BUDGET)
  spec = eng.generate(requests())
  assert_same(plain, spec, "xla: speculation invisible")
  assert eng.stats.accepted > 0 and eng.stats.accepted < eng.stats.drafted
  return plain, spec, drafter


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_path_samples_what_the_xla_path_samples(model16, xla_runs, kernel, monkeypatch):
  """float32, T=1: the interpreted kernel's engine emits the XLA engine's tokens (and
  log-probabilities to 1e-5), plain and speculative with real tree drafts."""
  plain, spec, drafter = xla_runs
  platform = "gpu" if kernel == "gpu" else None
  eng = engine(model16, None, "pallas_interpret", 0, platform=platform, monkeypatch=monkeypatch)
  assert eng.attention_impl == f"{kernel}_interpret"
  assert_same(plain, eng.generate(requests()), f"{kernel} kernel, plain")
  eng = engine(model16, drafter(), "pallas_interpret", BUDGET, platform=platform,
               monkeypatch=monkeypatch)
  assert_same(spec, eng.generate(requests()), f"{kernel} kernel, speculative")
  assert eng.stats.accepted > 0 and eng.stats.spec_steps == eng.stats.steps


def test_kernel_path_matches_on_the_default_tiny_model(tiny_model):
  """The engine tests' own tiny model (head dim 8, GQA 2): on CPU 'pallas_interpret' is the TPU
  kernel, which takes any head dim; greedy speculative decoding with garbage drafts that include
  EOS equals the XLA path."""
  params = SamplingParams(temperature=0.0, max_new_tokens=8)
  reqs = lambda: [Request(i, p, params) for i, p in enumerate(mixed_prompts(3, VOCAB, 4, 10))]
  want = engine(tiny_model, RandomDrafter(VOCAB, seed=2, extra_tokens=(EOS,)), "xla",
                BUDGET).generate(reqs())
  eng = engine(tiny_model, RandomDrafter(VOCAB, seed=2, extra_tokens=(EOS,)),
               "pallas_interpret", BUDGET)
  assert eng.attention_impl == "tpu_interpret"
  assert_same(want, eng.generate(reqs()), "tpu kernel, head dim 8")


def test_nothing_compiles_inside_a_rollout_on_the_kernel_path(model16, monkeypatch):
  """Warm-up compiles every shape with the kernel (one cache length: a kernel reads only live
  KV, so there are no cache-length buckets); rollouts of mixed lengths then trace nothing."""
  eng = engine(model16, RandomDrafter(VOCAB, seed=0), "pallas_interpret", BUDGET,
               buckets=(2,), platform="gpu", monkeypatch=monkeypatch)
  assert eng.kv_lengths == (eng.config.cache_len,)
  eng.warmup(filters=False)
  before = dict(TRACE_COUNTS)
  eng.generate(requests(n=3, seed=2, max_new_tokens=6))
  eng.generate([Request(0, list(range(1, 20)), SamplingParams(0.0, max_new_tokens=4))])
  assert dict(TRACE_COUNTS) == before


def test_pallas_on_cpu_falls_back_to_xla_with_one_warning(model16, caplog):
  """'pallas' on a backend without a kernel: the XLA path (cache-length buckets and all), and
  the reason logged once however many engines are built."""
  attention._warned.clear()
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    engines = [engine(model16, None, "pallas", 0) for _ in range(2)]
  assert all(e.attention_impl == "xla" for e in engines)
  records = [r for r in caplog.records if r.name == LOGGER]
  assert len(records) == 1
  assert "attention='pallas' uses the XLA path: no Pallas kernel for the 'cpu' backend" in (
      records[0].getMessage())


def test_unsupported_shape_falls_back_with_the_reason(tiny_model, caplog):
  """The GPU kernel cannot take head dim 8: resolution says so in one line and picks the XLA
  path; the model's attention, asked for that kernel anyway, falls back at trace time and
  computes the XLA path's result."""
  attention._warned.clear()
  cfg = tiny_model.cfg
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    for _ in range(2):
      assert attention.resolve_attention("pallas", cfg, 48, platform="gpu") == "xla"
  records = [r for r in caplog.records if r.name == LOGGER]
  assert len(records) == 1
  message = records[0].getMessage()
  assert "the gpu kernel cannot take head dim 8, cache length 48, float32" in message
  assert "head dim H=8 is not a power of two >= 16" in message

  rng = np.random.default_rng(0)
  b, s, k, g, h = 2, 48, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  q = jnp.asarray(rng.standard_normal((4, k * g, h)), jnp.float32)
  kv = [jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32) for _ in range(2)]
  args = (q, *kv, jnp.array([5, 9]), jnp.array([0, 2]), jnp.array([2, 2]),
          jnp.array([[1], [3], [1], [3]], jnp.uint32))
  run = lambda impl: jax.jit(lambda *a: attention.tree_attention(*a, max_q_len=2, impl=impl))
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    out = run("gpu_interpret")(*args)
  assert "attention='gpu_interpret' uses the XLA path" in caplog.text
  np.testing.assert_array_equal(out, run("xla")(*args))


def test_more_cache_buckets_than_halvings_add_no_empty_length():
  """S >> i reaches 0 past log2(S) halvings: a zero-length bucket would be compiled and timed
  at warm-up for nothing (no row fits it)."""
  assert 0 not in EngineConfig(max_len=64, kv_buckets=8).kv_lengths()


@pytest.mark.parametrize("max_len", [2, 32, 64, 96, 352, 1000, 4096, 16384])
@pytest.mark.parametrize("max_draft", [0, 4, 16])
def test_cache_lengths_are_kernel_shapes(max_len, max_draft):
  """Every cache length the engine allocates or slices to is one both kernels take (bf16 and
  float32, the Qwen/SmolLM head dims), holds everything the old unrounded length held, and pads
  by less than max(16, S/16) positions."""
  cfg = EngineConfig(max_len=max_len, max_draft=max_draft, kv_buckets=3)
  needed = max_len + 2 * (1 + max_draft)
  s = cfg.cache_len
  assert needed <= s < needed + max(16, needed / 16)
  assert s % 16 == 0 and all(x % 16 == 0 and x <= s for x in cfg.kv_lengths())
  for kernel in ("tpu", "gpu"):
    for dtype in (jnp.float32, jnp.bfloat16):
      for n, kv, h in ((9, 3, 64), (28, 4, 128)):
        assert attention.kernel_unsupported(kernel, num_heads=n, num_kv_heads=kv, head_dim=h,
                                            cache_len=s, dtype=dtype) is None


def test_engine_attention_bench_stops_on_cpu_with_one_line():
  """bench/engine_attention.py needs a kernel backend (or --smoke): on CPU it says so and
  exits before building anything."""
  from bench import engine_attention
  with pytest.raises(SystemExit, match="the 'cpu' backend has no Pallas kernel"):
    engine_attention.main(["--no_append"])
