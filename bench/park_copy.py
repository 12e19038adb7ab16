"""Device cost of a divided-rollout yield: its two KV row copies, at a real model's cache shape.

A yield copies a request's KV row from the batch cache into a park row and, when it resumes,
back (`rollout.divided.ParkPool`). For each park pool size this times one yield's two copies
the ways `ParkPool.warmup` does:
  - queued: passes of one yield dispatched back to back and waited for once, per pass (what a
    rollout pays: its copies follow steps without a wait; the engine hands this to the
    admission order);
  - waited: the fastest single pass waited for (adds the host round trip);
  - a pass of 4 yields, queued (the engine makes a pass's parks and resumes in one call with
    its slot loading, `step.park_resume_load`), per yield: what batching the copies saves.
Each call also carries the pass's slot loading.
The copies update the pool and the batch in place (both donated); the time should not grow
with the pool's rows (it would if XLA copied a whole cache). Needs no weights: caches of
zeros with SmolLM2-135M's KV shape (30 layers x 3 KV heads x 64), float32.

  python bench/park_copy.py                       # any device, seconds
  python bench/park_copy.py --pool_rows 8,64,128 --batch 32 --cache_len 544
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.models.attention import KVCache  # noqa: E402
from rhyme_jax.models.config import ModelConfig  # noqa: E402
from rhyme_jax.rollout.divided import ParkPool  # noqa: E402
from rhyme_jax.rollout.step import DecodeState  # noqa: E402

# SmolLM2-135M's attention shape (the KV row a yield copies).
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pool_rows", default="8,64,128", help="park pool sizes, comma-separated")
  p.add_argument("--batch", type=int, default=32, help="rows of the batch cache")
  p.add_argument("--cache_len", type=int, default=544,
                 help="positions per row (the engine's cache_len; 544 for 256 new tokens after "
                      "GSM8K prompts)")
  p.add_argument("--reps", type=int, default=10)
  common.add_results_args(p)
  args = p.parse_args(argv)
  try:
    pools = [int(x) for x in args.pool_rows.split(",")]
  except ValueError:
    p.error(f"--pool_rows={args.pool_rows!r}: expected comma-separated integers")
  for flag, v in (("pool_rows", min(pools)), ("batch", args.batch),
                  ("cache_len", args.cache_len), ("reps", args.reps)):
    if v < 1:
      p.error(f"--{flag}: {v} must be >= 1")
  print(f"[park_copy] device: {common.device_description()}", flush=True)
  cfg = SMOLLM2_135M
  row_bytes = 2 * cfg.num_layers * args.cache_len * cfg.num_kv_heads * cfg.head_dim * 4
  rows = []
  for n in pools:
    pool = ParkPool(cfg, n, args.cache_len, lambda t: t)
    state = DecodeState.empty(KVCache.zeros(cfg, args.batch, args.cache_len))
    state, cost = pool.warmup(state, args.reps)
    # Each copy reads and writes one row (K and V): 2 x row_bytes per copy, two copies.
    per = cost.many / cost.rows
    rows.append([n, args.batch, f"{row_bytes / 2**20:.1f}", f"{1e3 * cost.one:.3f}",
                 f"{1e3 * cost.one_waited:.3f}", f"{4 * row_bytes / cost.one / 1e9:.0f}",
                 cost.rows, f"{1e3 * per:.3f}", f"{cost.one / per:.2f}"])
    print(f"[park_copy] pool {n}: queued {1e3 * cost.one:.3f} ms, waited "
          f"{1e3 * cost.one_waited:.3f} ms per yield; {1e3 * per:.3f} ms per yield in a pass "
          f"of {cost.rows}", flush=True)
    del pool, state
  table = common.markdown_table(["pool rows", "batch rows", "KV row MiB", "queued ms / yield",
                                 "waited ms / yield", "queued GB/s moved", "pass of",
                                 "queued ms / yield in the pass", "saving"], rows)
  print(table)
  notes = [f"SmolLM2-135M KV shape, float32, cache_len {args.cache_len}; one yield = two row "
           f"copies (park, resume); queued = {4 * args.reps} passes back to back, waited for "
           f"once; waited = fastest of {args.reps} passes of one yield each waited for; pass of "
           "n = n yields parked in one copy call and resumed in one more (the engine's pass); "
           "saving = one-yield pass / per-yield time in the larger pass", *args.note]
  if not args.no_append:
    common.append_results("Yield copies on the device (bench/park_copy.py)", table, notes)
  return 0


if __name__ == "__main__":
  sys.exit(main())
