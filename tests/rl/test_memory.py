"""rl/memory.py: the start-up estimate against XLA's memory analysis of the compiled steps,
and the refusal of a config that cannot fit."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from rhyme_jax import parallel
from rhyme_jax.config import ConfigError, parse_flags
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rl import memory
from rhyme_jax.rl.learner import HEAD_CHUNK, Learner
from rhyme_jax.rl.rollouts import engine_config
from rhyme_jax.rl.samples import length_buckets
from rhyme_jax.rollout import accept
from rhyme_jax.rollout.engine import RolloutEngine

# Small, but with the proportions of a real run: parameters and optimiser state dominate.
CFG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=32)
FLAGS = ["--run_dir=unused", "--group_size=4", "--prompts_per_step=2", "--max_prompt_len=32",
         "--max_new_tokens=32", "--micro_batch_size=4", "--spec=none"]


def _setup(*extra):
  config = parse_flags(FLAGS + list(extra))
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  return config, mesh, memory.estimate(config, CFG, mesh)


def _compiled_update(config, model_config, mesh, tokens):
  """XLA's memory analysis of the learner's compiled update at `tokens` per row."""
  learner = Learner(config, init_model(model_config, 0), mesh, model_config)
  b, t = config.rl.samples_per_step, length_buckets(tokens)[-1]
  batch = parallel.shard_batch(dict(tokens=np.zeros((b, t), np.int32),
                                    targets=np.zeros((b, t), np.int32),
                                    adv=np.zeros((b,), np.float32),
                                    mask=np.ones((b, t), np.float32)), mesh)
  return learner._update.lower(learner.params, learner.opt_state, batch).compile(
      ).memory_analysis()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("new_tokens", [32, 224])
def test_train_step_estimate_close_to_compiled(new_tokens, remat):
  """Within 15% of XLA's own count and never below it by more than 3%, at 64 and 256 tokens
  (where the attention's T^2 arrays weigh most), with --remat too (at 256 tokens the loss
  head runs in two chunks)."""
  config, mesh, est = _setup(f"--max_new_tokens={new_tokens}", *(["--remat"] if remat else []))
  ma = _compiled_update(config, CFG, mesh, 32 + new_tokens)
  # Parameters and Adam moments are the compiled step's (donated) arguments: exact.
  assert abs((est.params + est.opt_state) / ma.argument_size_in_bytes - 1) < 0.01
  # The whole step: arguments plus XLA's temporaries (outputs alias the donated arguments).
  compiled = ma.argument_size_in_bytes + ma.temp_size_in_bytes
  estimated = est.params + est.opt_state + est.grads + est.activations
  assert 0.97 < estimated / compiled < 1.15, (estimated, compiled)


def test_bfloat16_state_counts_the_float32_master_weights():
  """--param_dtype=bfloat16: the optimiser keeps float32 master weights besides its two
  moments (learner.with_master_weights), 12 bytes per 2-byte parameter, and the estimate of
  the step's arguments is still XLA's. (Its temporaries are not compared: XLA's CPU backend
  computes bfloat16 in float32.)"""
  cfg = dataclasses.replace(CFG, param_dtype="bfloat16", dtype="bfloat16")
  config = parse_flags(FLAGS + ["--param_dtype=bfloat16"])
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  est = memory.estimate(config, cfg, mesh)
  assert 5.9 < est.opt_state / est.params < 6.1
  assert est.grads == 5 * est.params  # the step's gradient, and a float32 sum and update
  ma = _compiled_update(config, cfg, mesh, 64)
  assert abs((est.params + est.opt_state) / ma.argument_size_in_bytes - 1) < 0.01


def test_rollout_step_estimate_within_10_percent_of_compiled():
  config, mesh, est = _setup()
  eng_cfg = engine_config(config, (), drafting=False)
  engine = RolloutEngine(init_model(CFG, 0), eng_cfg, None)
  bucket = max(eng_cfg.buckets)
  assert (est.kv_bucket, est.kv_positions) == (bucket, eng_cfg.cache_len)
  state = engine._new_state(bucket)
  trees = accept.pack([None] * bucket, [True] * bucket, bucket)
  s = eng_cfg.kv_lengths()[-1]
  ma = engine._verify_fn.lower(engine._leaves, state, trees.wire(), engine._seed, filters=False,
                               max_kv_len=s, max_q_len=1, attention_impl=engine.attention_impl
                               ).compile().memory_analysis()
  # Arguments: the parameters and the cache (plus a few per-row scalars).
  assert abs((est.params + est.kv_cache) / ma.argument_size_in_bytes - 1) < 0.10


def test_oversized_config_refused_naming_the_parts():
  config, mesh, est = _setup("--device_memory_gib=0.01")  # 10 MiB: the Adam moments alone
  with pytest.raises(ConfigError) as e:
    memory.check_fits(config, CFG, mesh)
  msg = str(e.value)
  assert "--device_memory_gib" in msg and "optimiser state" in msg and "KV cache" in msg
  assert "\n" not in msg
  config, mesh, _ = _setup("--device_memory_gib=1")
  assert memory.check_fits(config, CFG, mesh).total == est.total


def test_sharding_divides_the_estimate():
  """On an fsdp mesh each device holds a share of the parameters and moments (an abstract
  mesh: the estimate needs no devices, so a pod's plan can be checked from a laptop)."""
  config = parse_flags(FLAGS)
  one = memory.estimate(config, CFG, parallel.make_mesh(devices=jax.devices()[:1]))
  fsdp = jax.sharding.AbstractMesh((1, 4, 1), ("data", "fsdp", "tensor"))
  four = memory.estimate(config, CFG, fsdp)
  assert four.params < 0.4 * one.params and four.opt_state < 0.4 * one.opt_state
  assert four.activations == one.activations  # every row on every device (errs high)
  assert four.activations_sharded == one.activations // 4  # rows split four ways: the least
  assert four.least < four.total and one.least == one.total


def test_a_run_that_fits_only_with_sharded_activations_is_warned_not_refused(caplog):
  """On a mesh the estimate brackets the activations (every row on every device / rows split
  over the batch axes): a run above the lower bound cannot fit and is refused; one between
  the two may fit and gets a warning."""
  mesh = jax.sharding.AbstractMesh((1, 4, 1), ("data", "fsdp", "tensor"))
  est = memory.estimate(parse_flags(FLAGS), CFG, mesh)
  between = (est.least + est.total) / 2 / memory.GIB
  config = parse_flags(FLAGS + [f"--device_memory_gib={between}"])
  with caplog.at_level("WARNING"):
    assert memory.check_fits(config, CFG, mesh) == est
  assert "may not fit" in caplog.text
  assert memory.fit_verdict(est, int(between * memory.GIB)) == "may not fit"
  below = parse_flags(FLAGS + [f"--device_memory_gib={0.99 * est.least / memory.GIB}"])
  with pytest.raises(ConfigError, match="does not fit in --device_memory_gib .* with the "
                     "activations split over the batch axes"):
    memory.check_fits(below, CFG, mesh)


def test_remat_estimate_keeps_one_input_per_layer_and_one_layers_working_set():
  """--remat: every layer keeps its B x T x D input; one layer's full working set is live at a
  time (tests/models/test_transformer.py checks what the gradient keeps); the head holds one
  chunk of positions' logits (tests/rl/test_learner.py checks XLA's count); the layers' scan
  holds a stacked copy of their parameters."""
  flags = ["--max_new_tokens=224"]
  kept = memory.estimate(parse_flags(FLAGS + flags), CFG, _setup()[1])
  remat = memory.estimate(parse_flags(FLAGS + flags + ["--remat"]), CFG, _setup()[1])
  rows, seq = 4, length_buckets(32 + 224)[-1]
  assert seq > HEAD_CHUNK
  head = rows * seq * 3 * CFG.vocab_size * 4
  one_layer = (kept.activations - head) // CFG.num_layers
  inputs = CFG.num_layers * rows * seq * CFG.hidden_size * 4
  chunk_head = rows * HEAD_CHUNK * 3 * CFG.vocab_size * 4 + rows * seq * CFG.hidden_size * 4
  params = memory.abstract_params(CFG)
  stacked = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
  assert remat.activations == inputs + one_layer + chunk_head + stacked
  assert remat.activations < kept.activations / 2
