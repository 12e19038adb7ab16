"""The rollout's compiled programs, lowered for the GPU and the TPU on this CPU (jax.export):
no host round trip hides inside a call.

XLA:GPU runs control flow from the host. A conditional copies its branch index to the host and
waits for the stream (a blocking sync in the middle of the call: the device drains and idles
while the host launches the rest). A while loop launches its body's kernels once per
iteration, and reads its predicate back every iteration unless XLA knows the trip count. The
engine pipelines one call behind another, so either would stall every decode step.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from rhyme_jax.rollout import accept, compiled
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine

PLATFORMS = ("cuda", "tpu")


@pytest.fixture(scope="module")
def engine(tiny_model):
  return RolloutEngine(tiny_model, EngineConfig(max_len=48, buckets=(4,), max_draft=4,
                                                eos_ids=(), multi_step=4, park_rows=4))


def control_flow(fn, platform, *args, **kw) -> dict[str, int]:
  """Counts of while loops and conditionals in `fn`'s StableHLO for `platform`."""
  module = jax.export.export(fn, platforms=[platform])(*args, **kw).mlir_module()
  return {"while": module.count("stablehlo.while"),
          "conditional": module.count("stablehlo.case") + module.count("stablehlo.if")}


def verify_flow(engine, platform, *, steps=1, filters=False, drafts=False):
  state = engine._new_state(4)
  p, t = engine.shapes(4)[-1] if drafts else (4, 1)
  trees = [(np.arange(1, t, dtype=np.int32), np.arange(-1, t - 2, dtype=np.int32))
           if drafts else None] * 4
  wire = accept.pack(trees, [True] * 4, p).wire()
  return control_flow(engine._verify_fn, platform, engine._leaves, state, wire, engine._seed,
                      filters=filters, max_kv_len=engine.kv_lengths[-1], max_q_len=t,
                      attention_impl="xla", steps=steps)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_steps_lower_without_loops_or_conditionals(engine, platform):
  """A plain step and a speculative one (a chain per row): straight-line programs."""
  assert engine.shapes(4)[-1][1] > 1  # the speculative shape is there to lower
  assert verify_flow(engine, platform) == {"while": 0, "conditional": 0}
  assert verify_flow(engine, platform, drafts=True) == {"while": 0, "conditional": 0}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_multi_step_launch_is_one_loop_with_a_known_trip_count(engine, platform):
  """K plain steps in one call: the scan is the only loop, and XLA knows its trip count (the
  annotation XLA:GPU's while thunk reads to skip its per-iteration predicate read-back,
  checked on the CPU compiler's optimized HLO, which runs the same trip-count analysis)."""
  assert verify_flow(engine, platform, steps=4) == {"while": 1, "conditional": 0}
  state = engine._new_state(4)
  hlo = engine._verify_fn.lower(
      engine._leaves, state, engine._plain_roots((True,) * 4), engine._seed, filters=False,
      max_kv_len=engine.kv_lengths[-1], max_q_len=1, attention_impl="xla",
      steps=4).compile().as_text()
  loops = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
  assert loops and all('"known_trip_count":{"n":' in line for line in loops), loops
  assert any('"known_trip_count":{"n":"4"}' in line for line in loops)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_filtered_sampling_has_only_its_fallback_conditional(engine, platform):
  """Top-p / top-k (`filters`): the one conditional is sampling's full-sort fallback
  (`sampling.filtered_logits`); a second would be a second sync per step on a GPU."""
  assert verify_flow(engine, platform, filters=True) == {"while": 0, "conditional": 1}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_admission_and_copies_lower_without_loops_or_conditionals(engine, platform):
  """Prefill, slot loading, bucket moves and divided rollout's row copies."""
  state = engine._new_state(4)
  chunk = np.zeros(2 + engine.config.prefill_chunk, np.int32)
  flows = [
      control_flow(engine._prefill_fn, platform, engine._leaves, state.cache, chunk),
      control_flow(compiled.load_slots_jit, platform, state, np.zeros((5, 4), np.int32),
                   np.ones((2, 4), np.float32)),
      control_flow(compiled.regroup_jit, platform, state, np.arange(2, dtype=np.int32)),
      control_flow(compiled.copy_rows_jit, platform, state.cache, state.cache,
                   np.zeros((2, 4), np.int32)),
  ]
  assert flows == [{"while": 0, "conditional": 0}] * 4
