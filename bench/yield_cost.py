"""Host time per divided-rollout yield and per admitted request, a checkout (`--old`) vs this tree.

On a GPU a 135M model's decode step is launch-bound (~4 ms for 32 rows on an H200), so the host
work around a yield (parking a request's KV row, bringing it back) and around an admission (the
prefill dispatches) is on the critical path: bench/schedule_engine.py measured ~1.5 ms of wall
clock per yield there. This bench times that host work alone with a tiny random model, whose
device work is negligible, so the figure does not depend on the model: 64 yields (park +
resume, no waits; one per pass, and in passes of 4, as the engine makes a pass's copies: in
the call that loads its slots) and 16 admissions of 40-token prompts (prefill chunk
dispatches and slot loading), the fastest of 5 rounds, each tree in its own process; and one
pass of yield checks (32 running requests asked with 96 waiting, history_residual),
residual-life estimates that miss the order's cache (`LengthPredictor.remaining_tokens`), and
admission choices over 96 waiting requests (`next_to_admit`, once per admission and per rule a
yield pass builds).

  python bench/yield_cost.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)
YIELDS, ADMITS, ROUNDS = 64, 16, 5
PASS = 4  # yields per engine pass (bench/schedsim.py's traces: 3 to 5 where a pass yields)
CHECKS, QUEUED = 32, 96  # a yield-check pass: running requests asked, requests waiting
PICKS = 200  # admission choices timed per round


def measure(code: str) -> dict:
  sys.path.insert(0, code)
  import jax
  import numpy as np
  from rhyme_jax.models.config import ModelConfig
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
  model = init_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8), seed=1)
  cfg = EngineConfig(max_len=96, buckets=(ADMITS,), max_draft=0, speculate="never",
                     kv_buckets=1, eos_ids=(3,), divide_every=4, park_rows=YIELDS,
                     prefill_chunk=16)
  eng = RolloutEngine(model, cfg)
  eng.warmup()
  pool = eng.park_pool()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 64, 40).tolist() for _ in range(ADMITS)]
  per_yield, per_admit = {}, float("inf")
  for _ in range(ROUNDS):
    state = eng._new_state(ADMITS)  # pylint: disable=protected-access
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = eng._admit(state, [(i, Request(100 + i, p)) for i, p in enumerate(prompts)])  # pylint: disable=protected-access
    per_admit = min(per_admit, (time.perf_counter() - t0) / ADMITS)
    jax.block_until_ready(state)
    for n in (1, PASS):
      pool.reset()
      t0 = time.perf_counter()
      state = yields(pool, state, n)
      per_yield[n] = min(per_yield.get(n, float("inf")), (time.perf_counter() - t0) / YIELDS)
      jax.block_until_ready(state)
  return dict(code="this tree" if code == HERE else code, per_yield_us=1e6 * per_yield[1],
              per_yield_pass_us=1e6 * per_yield[PASS], per_admit_us=1e6 * per_admit,
              per_check_us=1e6 * check_pass(), per_miss_us=1e6 * residual_miss(),
              per_pick_us=1e6 * admission_pick())


def yields(pool, state, per_pass: int):
  """YIELDS parks and YIELDS resumes, `per_pass` of each per pass, as the engine's passes make
  them: in the call that loads a pass's slots (`ParkPool.flush`: each pass parks `per_pass`
  rows and resumes the previous pass's), or in a checkout from before that, all the parks
  then all the resumes, `per_pass` per copy call (`ParkPool.park(cache, [(slot, record),
  ...])`) or one at a time (`park(cache, slot, record)`). Returns the state."""
  import numpy as np
  from rhyme_jax.rollout.engine import Request
  from rhyme_jax.rollout.live import LiveRequest
  params = len(inspect.signature(pool.park).parameters)
  if params == 1:
    ints, floats = np.zeros((5, state.batch), np.int32), np.ones((2, state.batch), np.float32)
    before = []
    for i in range(0, YIELDS, per_pass):
      now = [((i + j) % ADMITS, i + j) for j in range(per_pass)]
      pool.park([(slot, LiveRequest(Request(r, [0]))) for slot, r in now])
      pool.resume(before)
      state = pool.flush(state, ints, floats)
      before = now
    pool.resume(before)
    return pool.flush(state, ints, floats)
  cache = state.cache
  if params == 3:
    for i in range(YIELDS):
      pool.park(cache, i % ADMITS, LiveRequest(Request(i, [0])))
    for i in range(YIELDS):
      cache = pool.resume(cache, i % ADMITS, i)
    return state.replace(cache=cache)
  for i in range(0, YIELDS, per_pass):
    pool.park(cache, [((i + j) % ADMITS, LiveRequest(Request(i + j, [0])))
                      for j in range(per_pass)])
  for i in range(0, YIELDS, per_pass):
    cache = pool.resume(cache, [((i + j) % ADMITS, i + j) for j in range(per_pass)])
  return state.replace(cache=cache)


def history_table(rng, keys):
  """A LengthTable of one epoch: 8 kept lengths in [20, 256) for each of `keys`, drawn from
  `rng` (the history the yield check, admission choice and residual-life rows rank by)."""
  from rhyme_jax.scheduling.predictor import LengthTable
  table = LengthTable()
  for k in keys:
    table.add(k, 0, rng.integers(20, 256, 8).tolist())
  return table


def check_pass() -> float:
  """Host seconds per running request asked whether to yield, in one pass of
  `slots_to_yield` over CHECKS running requests (all due) with QUEUED requests waiting, under
  history_residual (16 prompts of history); the fastest of ROUNDS passes."""
  import numpy as np
  from rhyme_jax.rollout import divided
  from rhyme_jax.rollout.engine import Request
  from rhyme_jax.rollout.live import LiveRequest
  from rhyme_jax.scheduling.admission import make_policy
  from rhyme_jax.scheduling.engine_order import EngineOrder
  from rhyme_jax.scheduling.predictor import LengthPredictor
  rng = np.random.default_rng(0)
  table = history_table(rng, range(16))
  reqs = [Request(1000 + i, [1], prompt_key=i % 16, group_id=i % 16)
          for i in range(CHECKS + QUEUED)]
  order = EngineOrder(make_policy("history_residual", predictor=LengthPredictor(table)))
  order.order(reqs)
  running, queue = reqs[:CHECKS], reqs[CHECKS:]
  live = {r.request_id: 16 * (1 + i % 8) for i, r in enumerate(running)}
  slots = [LiveRequest(r) for r in running]
  for lv in slots:
    lv.tokens = [0] * live[lv.req.request_id]
  best = float("inf")
  for _ in range(ROUNDS):
    for lv in slots:
      lv.since = 0
    t0 = time.perf_counter()
    if hasattr(divided, "YieldRules"):  # a fresh rule: the pass's work over the queue
      divided.slots_to_yield(slots, queue, divided.YieldRules(order, {}, live, 16), 16,
                             CHECKS + QUEUED)
    else:  # a checkout from before (--old)
      divided.slots_to_yield(slots, queue, order, {}, live, 16, CHECKS + QUEUED)
    best = min(best, time.perf_counter() - t0)
  return best / CHECKS


def admission_pick() -> float:
  """Host seconds per admission choice (`EngineOrder.next_to_admit`) under history_residual,
  with QUEUED requests waiting, half of them started (yielded earlier, each at its own length);
  prompt keys are 32-character hex digests, as the trainer's (`history.store.prompt_key`);
  the fastest of ROUNDS rounds of PICKS choices over the same queue (the order's caches warm,
  as for every admission after a request's first)."""
  import numpy as np
  from rhyme_jax.rollout.engine import Request
  from rhyme_jax.scheduling.admission import make_policy
  from rhyme_jax.scheduling.engine_order import EngineOrder
  from rhyme_jax.scheduling.predictor import LengthPredictor
  rng = np.random.default_rng(0)
  keys = [f"{k:032x}" for k in rng.integers(0, 1 << 62, 16)]
  table = history_table(rng, keys)
  queue = [Request(1000 + i, [1], prompt_key=keys[i % 16], group_id=i % 16)
           for i in range(QUEUED)]
  order = EngineOrder(make_policy("history_residual", predictor=LengthPredictor(table)))
  order.order(queue)
  live = {r.request_id: 1 + (7 * i) % 200 for i, r in enumerate(queue) if i % 2}
  order.next_to_admit(queue, {}, live)
  best = float("inf")
  for _ in range(ROUNDS):
    t0 = time.perf_counter()
    for _ in range(PICKS):
      order.next_to_admit(queue, {}, live)
    best = min(best, time.perf_counter() - t0)
  return best / PICKS


def residual_miss() -> float:
  """Host seconds per `LengthPredictor.remaining_tokens` call that misses the order's cache (a
  running request asked at a length not asked before: every yield check of it), 16 prompts x 8
  kept lengths, each (prompt, length) once; the fastest of ROUNDS fresh predictors."""
  import numpy as np
  from rhyme_jax.scheduling.predictor import LengthPredictor
  rng = np.random.default_rng(0)
  table = history_table(rng, range(16))
  asks = [(k, n) for n in range(0, 256, 4) for k in range(16)]
  best = float("inf")
  for _ in range(ROUNDS):
    pred = LengthPredictor(table)
    pred.remaining_tokens(0, 0, 256)  # builds what it keeps across calls, once
    t0 = time.perf_counter()
    for k, n in asks:
      pred.remaining_tokens(k, n, 256)
    best = min(best, time.perf_counter() - t0)
  return best / len(asks)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(p)
  common.add_results_args(p)
  args = p.parse_args(argv)
  rows = common.per_checkout(__file__, args, measure, HERE)
  if rows is None:
    return
  base = rows[0]
  table = common.markdown_table(
      ["code", "host us per yield (park + resume)", "ratio",
       f"host us per yield, passes of {PASS}", "ratio", "host us per admitted request",
       "ratio", "host us per yield check", "ratio", "host us per residual-life miss", "ratio",
       f"host us per admission choice, {QUEUED} queued", "ratio"],
      [[r["code"], f"{r['per_yield_us']:.0f}", f"{r['per_yield_us'] / base['per_yield_us']:.2f}",
        f"{r['per_yield_pass_us']:.0f}",
        f"{r['per_yield_pass_us'] / base['per_yield_pass_us']:.2f}",
        f"{r['per_admit_us']:.0f}", f"{r['per_admit_us'] / base['per_admit_us']:.2f}",
        f"{r['per_check_us']:.1f}", f"{r['per_check_us'] / base['per_check_us']:.2f}",
        f"{r['per_miss_us']:.1f}", f"{r['per_miss_us'] / base['per_miss_us']:.2f}",
        f"{r['per_pick_us']:.1f}", f"{r['per_pick_us'] / base['per_pick_us']:.2f}"]
       for r in rows])
  print(table)
  if not args.no_append:
    common.append_results("Host time per yield and per admission (bench/yield_cost.py)", table,
                          notes=[f"tiny random model (host work only): {YIELDS} yields (park + "
                                 f"resume dispatch, no waits; one per pass, and {PASS} per "
                                 "pass: a pass's copies in the call that loads its slots "
                                 "where the tree has ParkPool.flush, else a copy call per "
                                 "direction per pass, or one per yield in older checkouts) "
                                 f"and {ADMITS} admissions of "
                                 "40-token prompts (prefill chunks of 16 and slot loading), "
                                 f"fastest of {ROUNDS} rounds, each tree in its own process",
                                 f"yield check: one slots_to_yield pass asking {CHECKS} running "
                                 f"requests (all due) with {QUEUED} waiting, history_residual "
                                 "over 16 prompts' history; per request asked",
                                 "residual-life miss: LengthPredictor.remaining_tokens for "
                                 "(prompt, tokens so far) pairs not asked before (16 prompts x "
                                 "8 kept lengths, 64 lengths each), per call",
                                 f"admission choice: EngineOrder.next_to_admit under "
                                 f"history_residual over {QUEUED} queued requests, half of "
                                 "them started, 32-character prompt keys (the trainer's); "
                                 f"fastest of {ROUNDS} rounds of {PICKS}",
                                 *args.note])


if __name__ == "__main__":
  main()
