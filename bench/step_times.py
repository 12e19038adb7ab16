"""Device step times, plain vs speculative, per compiled shape (the cost model's inputs).

For each batch B and cache length S: a plain step (P = B packed roots) and speculative steps
with `nodes` draft nodes per row (P = B x (1 + nodes)), all rows near length S so attention reads
the S bucket. Times are medians of `reps` pipelined steps (dispatch, no host read between).
Ready for a GPU (the ISSUE 9 check: speculative <= 1.3x plain at 64 and 256 rows, cache 512 and
2048); on CPU use small sizes.

  python bench/step_times.py --batches 64,256 --caches 512,2048 --nodes 1,2,3 --dtype bfloat16
  python bench/step_times.py --batches 4 --caches 256 --nodes 2 --reps 5      # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.forward import SMOLLM2_135M  # noqa: E402
from rhyme_jax.models.transformer import init_model  # noqa: E402
from rhyme_jax.rollout import accept  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402


def step_ms(engine, bucket, cache, nodes, reps):
  prompt = list(range(10, 10 + max(8, cache - (reps + 2) * (1 + nodes) - 2)))
  state = engine._admit(engine._new_state(bucket),
                        [(i, Request(-1 - i, prompt, SamplingParams(1.0))) for i in range(bucket)])
  trees = [(np.full(nodes, 7, np.int32), np.arange(nodes, dtype=np.int32) - 1)] * bucket
  p = bucket * (1 + nodes)
  packed = accept.pack(trees if nodes else [None] * bucket, [True] * bucket, p)
  t = 1 if nodes == 0 else nodes + 1
  s = engine._kv_len_for(cache)
  times = []
  for i in range(reps + 2):
    t0 = time.perf_counter()
    state, out = engine.verify(state, packed, False, s, t)
    jax.block_until_ready(out)
    if i >= 2:
      times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times)), p, s


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batches", default="64,256")
  ap.add_argument("--caches", default="512,2048")
  ap.add_argument("--nodes", default="1,2,3")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--dtype", default="")
  common.add_results_args(ap, note=False)
  args = ap.parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  cfg = SMOLLM2_135M.replace(param_dtype=dtype, dtype=dtype)
  model = init_model(cfg, 0)
  rows = []
  for cache in [int(x) for x in args.caches.split(",")]:
    for b in [int(x) for x in args.batches.split(",")]:
      engine = RolloutEngine(model, EngineConfig(max_len=cache, buckets=(b,), max_draft=8,
                                                 kv_buckets=1, eos_ids=()))
      plain, _, s = step_ms(engine, b, cache, 0, args.reps)
      rows.append([b, cache, s, 0, b, f"{plain:.2f}", "1.00"])
      print(rows[-1], flush=True)
      for n in [int(x) for x in args.nodes.split(",")]:
        ms, p, s = step_ms(engine, b, cache, n, args.reps)
        rows.append([b, cache, s, n, p, f"{ms:.2f}", f"{ms / plain:.2f}"])
        print(rows[-1], flush=True)
  table = common.markdown_table(["B", "cache", "S bucket", "nodes/row", "P", "ms/step",
                                 "x plain"], rows)
  print(table)
  if not args.no_append:
    common.append_results("Decode step times per shape, plain vs packed speculative", table,
                          notes=[f"SmolLM2-135M shapes, random weights, {dtype}; median of "
                                 f"{args.reps} steps, outputs awaited each step"])


if __name__ == "__main__":
  main()
