"""The rollout's compiled programs, lowered for the GPU and the TPU on this CPU (jax.export):
no host round trip hides inside a call.

XLA:GPU runs control flow from the host. A conditional copies its branch index to the host and
waits for the stream (a blocking sync in the middle of the call: the device drains and idles
while the host launches the rest). A while loop launches its body's kernels once per
iteration, and reads its predicate back every iteration unless XLA knows the trip count. The
engine pipelines one call behind another, so either would stall every decode step.
bench/lowering.py prints the same counts for SmolLM2's shapes.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import lowering  # noqa: E402

NONE = {"while": 0, "conditional": 0}


@pytest.fixture(scope="module")
def engine(tiny_model):
  return RolloutEngine(tiny_model, EngineConfig(max_len=48, buckets=(lowering.BUCKET,),
                                                max_draft=4, eos_ids=(), multi_step=4,
                                                park_rows=4))


@pytest.fixture(scope="module")
def flows(engine):
  """{(program, platform): counts} for every compiled call of a rollout."""
  return {(name, platform): lowering.control_flow(fn, platform, *args, **kw)
          for name, (fn, args, kw) in lowering.programs(engine).items()
          for platform in lowering.PLATFORMS}


def test_every_rollout_call_is_lowered(flows):
  names = {name for name, _ in flows}
  assert len(names) == 11 and any(name.startswith("speculative step (T=5)") for name in names)


def test_decode_steps_lower_without_loops_or_conditionals(flows):
  """Plain and speculative steps, XLA or Pallas attention: straight-line programs."""
  steps = {k: v for k, v in flows.items()
           if k[0].startswith(("plain step", "speculative step")) and "top-p" not in k[0]}
  assert len(steps) == 8 and all(v == NONE for v in steps.values()), steps


def test_admission_and_copies_lower_without_loops_or_conditionals(flows):
  """Prefill, slot loading, bucket moves, divided rollout's row copies and the prompt copies
  between a group's slots."""
  calls = {k: v for k, v in flows.items()
           if k[0] in ("prefill chunk", "slot loading", "bucket move",
                       "row copies (divided rollout)", "prompt copies (admission)")}
  assert len(calls) == 10 and all(v == NONE for v in calls.values()), calls


def test_filtered_sampling_has_only_its_fallback_conditional(flows):
  """Top-p / top-k: the one conditional is sampling's full-sort fallback
  (`sampling.filtered_logits`); a second would be a second sync per step on a GPU."""
  for platform in lowering.PLATFORMS:
    assert flows[("plain step, top-p/top-k", platform)] == {"while": 0, "conditional": 1}


def test_multi_step_launch_is_one_loop_with_a_known_trip_count(engine, flows):
  """K plain steps in one call: the scan is the only loop, and XLA knows its trip count (the
  annotation XLA:GPU's while thunk reads to skip its per-iteration predicate read-back,
  checked on the CPU compiler's optimized HLO, which runs the same trip-count analysis)."""
  for platform in lowering.PLATFORMS:
    assert flows[("4 plain steps in one launch", platform)] == {"while": 1, "conditional": 0}
  fn, args, kw = lowering.programs(engine)["4 plain steps in one launch"]
  hlo = fn.lower(*args, **kw).compile().as_text()
  loops = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
  assert loops and all('"known_trip_count":{"n":' in line for line in loops), loops
  assert any('"known_trip_count":{"n":"4"}' in line for line in loops)
