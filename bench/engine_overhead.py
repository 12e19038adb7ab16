"""Where a rollout step's time goes: the bare jitted verify step vs the engine's whole step.

For each (bucket B, budget T): B requests decode `--new_tokens` tokens each (EOS off) through
`RolloutEngine.generate` with empty drafts (plain decoding through a T-token verify shape), and
the same verify step is timed bare, looping on its own state:

- bare sync: one call + `block_until_ready` per step (what a step costs when the host waits);
- bare async: `--reps` calls dispatched back to back, one wait (the device's own time per step);
- engine: the generate loop's time per decode step (prefill excluded), split into host work
  before dispatch (drafting, packing), dispatch-to-outputs, and the rest of the host loop.

The gap between engine and bare-async is host time the device sits idle for: what overlapping
host work with the device can win, and what a step costs beyond the model. Random weights with
SmolLM2-135M's shapes by default (timing does not depend on the values).

`--multi_step K` adds, for budget 0, rows where an engine launches K plain steps per compiled
call (EngineConfig.multi_step): bare times per decode step of the K-step call, and the
engine's time per decode step with it (the host's work per launch spread over K steps).

  python bench/engine_overhead.py --buckets 1,8 --budgets 0,8 --new_tokens 32   # CPU
  python bench/engine_overhead.py --buckets 1,8,64 --budgets 0,16 --dtype bfloat16  # a GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.forward import SMOLLM2_135M  # noqa: E402
from rhyme_jax.config import MAX_MULTI_STEP  # noqa: E402
from rhyme_jax.models.transformer import init_model  # noqa: E402
from rhyme_jax.rollout import accept  # noqa: E402
from rhyme_jax.rollout.drafts import NoDrafts  # noqa: E402
from rhyme_jax.rollout.engine import (  # noqa: E402
    EngineConfig, Request, RolloutEngine)
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--buckets", default="1,8,64")
  p.add_argument("--budgets", default="0,16")
  p.add_argument("--new_tokens", type=int, default=64, help="tokens per request")
  p.add_argument("--prompt_len", type=int, default=96)
  p.add_argument("--reps", type=int, default=20, help="bare steps timed per measurement")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="default float32 on cpu, else bfloat16")
  p.add_argument("--top_p", type=float, default=1.0,
                 help="< 1: sample with top-p, so every step compiles sampling's filters (one "
                      "conditional, which XLA:GPU resolves by a host read mid-call)")
  p.add_argument("--multi_step", type=int, default=1,
                 help="also time budget 0 with this many plain steps per launch (> 1)")
  p.add_argument("--profile", action="store_true",
                 help="print the top host functions of the largest engine run (cProfile)")
  common.add_results_args(p)
  args = p.parse_args(argv)
  args.buckets = tuple(int(x) for x in args.buckets.split(","))
  args.budgets = tuple(int(x) for x in args.budgets.split(","))
  if not 1 <= args.multi_step <= MAX_MULTI_STEP:
    p.error(f"--multi_step={args.multi_step}: must be in [1, {MAX_MULTI_STEP}]")
  if not 0 < args.top_p <= 1:
    p.error(f"--top_p={args.top_p}: must be in (0, 1]")
  return args


def bare_times(engine, bucket, budget, reps, steps=1, filters=False):
  """(sync ms, async ms, dispatch ms) per verify step on one state (empty trees, as the engine
  runs them); dispatch = the host's time in the call itself with nothing queued (the sync
  loop; queued back to back, a call can also wait for room in the device's queue): what
  launching a step costs the host, the floor of the engine's host time per step. `steps` > 1:
  calls of that many plain steps, every figure per decode step. `filters`: the step compiled
  with top-p / top-k sampling (`--top_p`)."""
  state = engine._admit(engine._new_state(bucket),
                        [(i, Request(-1 - i, [1, 2, 3], SamplingParams(1.0)))
                         for i in range(bucket)])
  p, t = engine.shapes(bucket)[-1]
  wire = accept.pack([None] * bucket, [True] * bucket, p).wire()
  step = lambda s: engine._verify_wire(s, wire, filters, engine.config.cache_len, t, steps)
  for _ in range(3):
    state, out = step(state)
  jax.block_until_ready(out)
  t0, dispatch = time.perf_counter(), 0.0
  for _ in range(reps):
    td = time.perf_counter()
    state, out = step(state)  # nothing queued: the call's time is the launch alone
    dispatch += time.perf_counter() - td
    jax.device_get(out)  # the step's outputs, as the engine reads them
  sync = (time.perf_counter() - t0) / reps
  t0 = time.perf_counter()
  for _ in range(reps):
    state, out = step(state)
  jax.block_until_ready((state, out))
  per = 1e3 / (reps * steps)
  return sync * 1e3 / steps, (time.perf_counter() - t0) * per, dispatch * per


def main(argv=None):
  args = parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  cfg = SMOLLM2_135M.replace(param_dtype=dtype, dtype=dtype)
  model = init_model(cfg, 0)
  print(f"[overhead] {common.device_description()}; SmolLM2-135M shapes, random weights, "
        f"{dtype}", flush=True)
  rng = np.random.default_rng(0)
  rows, profile_text = [], ""
  filters = args.top_p < 1
  runs = [(b, 1) for b in args.budgets]
  if args.multi_step > 1 and 0 in args.budgets:
    runs.append((0, args.multi_step))
  for budget, k in runs:
    ecfg = EngineConfig(max_len=args.prompt_len + args.new_tokens, buckets=args.buckets,
                        max_draft=budget, speculate="always" if budget else "never",
                        pack_factors=(budget + 1,) if budget else (2,), eos_ids=(),
                        multi_step=k)
    engine = RolloutEngine(model, ecfg, NoDrafts())
    t0 = time.perf_counter()
    engine.warmup(filters=filters)
    print(f"[overhead] budget {budget}, {k} step(s)/launch: warm-up "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    for bucket in args.buckets:
      sync_ms, async_ms, dispatch_ms = bare_times(engine, bucket, budget, args.reps, k,
                                                  filters)
      reqs = [Request(i, rng.integers(10, cfg.vocab_size, args.prompt_len).tolist(),
                      SamplingParams(temperature=1.0, top_p=args.top_p,
                                     max_new_tokens=args.new_tokens))
              for i in range(bucket)]
      if args.profile and bucket == max(args.buckets):
        profile_text += common.profiled(lambda: engine.generate(reqs),
                                        f"\n--- B={bucket}, budget {budget} ---", top=18,
                                        keys=("tottime",))
      else:
        engine.generate(reqs)
      st = engine.stats
      n = max(st.steps, 1)
      step_ms = 1e3 * (st.total_time_s - st.prefill_time_s) / n
      draft_ms, device_ms = 1e3 * st.draft_time_s / n, 1e3 * st.device_time_s / n
      rows.append([bucket, budget if k == 1 else f"{budget}, {k} steps/launch",
                   f"{async_ms:.2f}", f"{sync_ms:.2f}", f"{dispatch_ms:.3f}",
                   f"{1e3 * st.dispatch_time_s / n:.3f}", f"{step_ms:.2f}",
                   f"{draft_ms:.2f}", f"{device_ms:.2f}", f"{step_ms - draft_ms - device_ms:.2f}",
                   f"{step_ms / async_ms:.2f}x"])
      print(f"[overhead] B={bucket} T={budget}: bare {async_ms:.2f} ms (sync {sync_ms:.2f}), "
            f"engine {step_ms:.2f} ms/step", flush=True)
  headers = ["batch", "budget", "bare ms/step (async)", "bare ms/step (sync)",
             "bare dispatch ms (host, nothing queued)", "engine dispatch ms (host)",
             "engine ms/step", "before dispatch", "dispatch to outputs", "after outputs",
             "engine / bare"]
  table = common.markdown_table(headers, rows)
  print(table)
  if profile_text:
    print(profile_text)
  if not args.no_append:
    common.append_results("Engine step vs bare verify step (bench/engine_overhead.py)", table, [
        f"SmolLM2-135M shapes, random weights, {dtype}; prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens per request, EOS off, empty drafts (plain decoding "
        f"through the budget's verify shape), T=1.0"
        + (f", top-p {args.top_p} (sampling's filters compiled in every step)"
           if filters else ""),
        "bare async = device time per step (calls queued back to back); bare sync = one call "
        "and a wait per step; engine = generate's time per decode step (prefill excluded): "
        "host work before the dispatch + dispatch-to-outputs + host work after the outputs",
        "dispatch ms (host) = the host's time inside the step call alone (bare: with nothing "
        "queued, in the sync loop, i.e. launching a step, the floor of the host's work per "
        "step; engine: EngineStats.dispatch_time_s per step, the previous step in flight)",
        "'k steps/launch' rows: k plain steps per compiled call (EngineConfig.multi_step); "
        "every figure per decode step (a launch's time / k)",
        *args.note])


if __name__ == "__main__":
  main()
