"""The rollout engine's warm-up: every shape a rollout can use, compiled and timed up front.

A rollout must never compile (static shapes, compiled once), so before the first one the engine
calls each step function once per (bucket, packed size, tokens per row, cache length) and each
multi-step launch (`EngineConfig.multi_step`) per (bucket, cache length), the prefill, slot
loading, prompt copies between slots, the park pool's copies and each bucket move, and times
every step shape to seed its cost model (`CostModel.observe_time(..., warmup=True)`) and each
bucket move (`RolloutEngine.move_seconds`, which the cost model weighs before moving).

Compiling dominates (about 70% of a SmolLM2-135M warm-up on the CPU is XLA's backend compile)
and XLA compiles without holding the GIL, so with more than one compile thread
(`compile_threads`) the buckets first compile side by side, each on its own state
(`compile_bucket`); the timed pass then runs one call at a time on shapes already compiled, so
the timings are those of a quiet device. The threads change how long warm-up takes, never what
compiles (tests/rollout/test_warmup.py counts the traces). On the 2-core CPU this saves 4-15%
(bench/RESULTS.md, bench/warmup_cost.py: XLA's CPU compile already keeps ~1.4 cores busy).

By default (`EngineConfig.compile_threads` = 0) only a CPU backend compiles in threads: XLA's
GPU compiler times candidate kernels on the device while it compiles (autotuning), and
compilations running side by side can disturb each other's timings; that is not measured yet,
so on an accelerator threads are opt-in (`--compile_threads`). With 8 threads on 1 x H100 the
GSM8K GRPO config warmed up in 105 s (plain) and 178 s (+HistoSpec) and sampled the same tokens
(bench/RESULTS.md, 2026-11-26); the serial time there and the kernels' speed are not compared.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import numpy as np

from rhyme_jax.rollout import accept, compiled
from rhyme_jax.rollout.interface import Request
from rhyme_jax.rollout.sampling import SamplingParams

TIMING_REPS = 3  # warm-up timings of each step shape: the fastest of this many calls

_DUMMY = [(0, Request(-1, [0, 0], SamplingParams()))]  # one admission into slot 0


def warm_up(engine, filters: bool = False) -> None:
  """Compiles and times everything `engine` (a `RolloutEngine`) can run; see the module
  docstring. Sets `engine.yield_cost` when it has park rows."""
  cfg = engine.config
  buckets = sorted(cfg.buckets, reverse=True)
  threads = compile_threads(engine)
  if threads > 1:
    with concurrent.futures.ThreadPoolExecutor(threads, "warmup") as pool:
      for done in [pool.submit(compile_bucket, engine, b, filters) for b in buckets]:
        done.result()
  for bucket in buckets:
    # Every call as a rollout makes it: on a fresh state and on states that steps returned
    # (their placement may differ from a fresh one's on a multi-device mesh). Compiled first
    # (two calls each), then timed: the fastest of TIMING_REPS calls, as a first call after
    # other shapes can be several times slower than the step itself.
    state = _shared_copies(engine, engine._admit(engine._new_state(bucket), _DUMMY))
    for reps in (0, TIMING_REPS):
      state = _step_shapes(engine, state, bucket, filters, reps)
    state = engine._admit(state, _DUMMY)
    if cfg.park_rows:
      timed = bucket == buckets[0]  # passes of yields' row copies, at the largest bucket
      state, cost = engine.park_pool().warmup(state, TIMING_REPS if timed else 0)
      if timed:
        engine.yield_cost = cost
    if bucket != buckets[-1]:  # the move out of this bucket: compiled, then timed
      move = lambda: jax.block_until_ready(engine._shrink(state, bucket, list(range(bucket))))
      move()
      engine.move_seconds[bucket] = min(_seconds(move) for _ in range(TIMING_REPS))


def _seconds(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def compile_threads(engine) -> int:
  """Threads `warm_up` compiles in: `EngineConfig.compile_threads`, or by default one per
  bucket up to the host's CPUs on a CPU backend and one on an accelerator (module docstring)."""
  if engine.config.compile_threads:
    return engine.config.compile_threads
  platform = next(iter(engine._leaves[0].devices())).platform
  return min(len(engine.config.buckets), os.cpu_count() or 1) if platform == "cpu" else 1


def compile_bucket(engine, bucket: int, filters: bool) -> None:
  """The calls `warm_up` makes for one bucket, untimed, on this bucket's own state, so that
  buckets can compile in parallel threads. All but the park pool's row copies: they compile in
  a moment, and a pool per thread would hold park_rows x cache_len more KV per thread."""
  cfg = engine.config
  state = _shared_copies(engine, engine._admit(engine._new_state(bucket), _DUMMY))
  state = _step_shapes(engine, state, bucket, filters, reps=0)
  state = engine._admit(state, _DUMMY)
  if bucket != min(cfg.buckets):
    state, _ = engine._shrink(state, bucket, list(range(bucket)))
  jax.block_until_ready(state)


def _shared_copies(engine, state):
  """Compiles the prompt copies admission makes (`RolloutEngine.shared_sizes` widths) for
  `state`'s bucket, copying slot 0's row into the others (warm-up's rows hold nothing)."""
  cache = state.cache
  for w in engine.shared_sizes(state.batch):
    rows = np.array([[1 + i % (state.batch - 1) for i in range(w)], [0] * w], np.int32)
    cache = compiled.copy_within_jit(cache, rows)
  return state.replace(cache=cache)


def _step_shapes(engine, state, bucket: int, filters: bool, reps: int):
  """Calls every step shape of `bucket` on `state` (each shape on the state the last call
  returned): twice untimed with `reps` = 0, else `reps` times, the fastest into the cost
  model. Returns the last state."""
  for p, t in engine.shapes(bucket):
    for s in engine.kv_lengths:
      trees = accept.pack([None] * bucket, [True] * bucket, p)
      best = float("inf")
      for _ in range(reps or 2):
        t0 = time.perf_counter()
        state, out = engine.verify(state, trees, filters, s, t)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
      if reps:
        engine.costs.observe_time((bucket, p, t, s), best, warmup=True)
  k = engine.config.multi_step
  if k > 1 and not reps:  # multi-step launches: compiled, not timed (the cost model times steps)
    plain = engine._plain_roots((True,) * bucket)
    for s in engine.kv_lengths:
      for _ in range(2):
        state, out = engine._verify_wire(state, plain, filters, s, 1, steps=k)
  return state
