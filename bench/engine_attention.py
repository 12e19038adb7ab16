"""Engine step times with the decode attention on the Pallas kernel vs the XLA path.

For each (rows B, live length L, mode): B slots whose committed lengths are spread uniformly over
[(1 - spread) L, L] (continuous batching: rows of one bucket differ in length), loaded straight
into the decode state (the cache holds zeros: step time does not depend on its values). The
engine's jitted verify step (`RolloutEngine.verify`, the one a rollout runs) is then timed for
  - plain: one root per row (P = B, T = 1);
  - spec: a chain of `--nodes` draft tokens per row (P = B(1 + nodes), T = nodes + 1);
once with EngineConfig(attention="xla") (its cache-length buckets, S/2 and S, as the engine
picks them) and once with attention="pallas" (the backend's kernel: reads only live KV; one
cache length). Times: `--reps` steps dispatched back to back after 2 untimed ones, one wait
(the device's own time per step). The first step's emitted tokens of both paths are compared
(equal up to float near-ties). Random weights with the named model's shapes.

  python bench/engine_attention.py                     # GPU/TPU: Qwen2.5-1.5B shapes, bf16
  python bench/engine_attention.py --model qwen2.5-7b --rows 16,64 --lengths 2048,8192
  python bench/engine_attention.py --smoke             # CPU: tiny model, kernel interpreted

On CPU without --smoke it stops with a one-line error ('pallas' has no kernel there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.forward import SMOLLM2_135M  # noqa: E402
from rhyme_jax.models.config import ModelConfig  # noqa: E402
from rhyme_jax.models.transformer import init_model  # noqa: E402
from rhyme_jax.rollout import accept, compiled, step  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402

MODELS = {
    "smollm2-135m": SMOLLM2_135M,
    "qwen2.5-1.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536,
                                intermediate_size=8960, num_layers=28, num_heads=12,
                                num_kv_heads=2, head_dim=128, rope_theta=1e6,
                                attention_bias=True, tie_word_embeddings=True,
                                max_position_embeddings=32768),
    "qwen2.5-7b": ModelConfig(arch="qwen2", vocab_size=152064, hidden_size=3584,
                              intermediate_size=18944, num_layers=28, num_heads=28,
                              num_kv_heads=4, head_dim=128, rope_theta=1e6,
                              attention_bias=True, tie_word_embeddings=False,
                              max_position_embeddings=32768),
    "tiny": ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
  p.add_argument("--rows", default="1,16,64,256", help="batch buckets B")
  p.add_argument("--lengths", default="1024,4096,16384", help="longest live length L")
  p.add_argument("--spread", type=float, default=0.5,
                 help="row lengths uniform in [(1 - spread) L, L]")
  p.add_argument("--nodes", type=int, default=8, help="draft tokens per row in 'spec' steps")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="default bfloat16 on an accelerator, float32 on CPU")
  p.add_argument("--max_cache_gib", type=float, default=30.0,
                 help="skip configurations whose K+V cache exceeds this")
  p.add_argument("--smoke", action="store_true",
                 help="CPU check: tiny model, B=2, L=40, kernel interpreted")
  common.add_results_args(p, note=False)
  args = p.parse_args(argv)
  if args.smoke:
    args.model, args.rows, args.lengths, args.nodes, args.reps = "tiny", "2", "40", 3, 2
  if not 0.0 <= args.spread < 1.0:
    p.error(f"--spread={args.spread}: expected a number in [0, 1)")
  args.rows = [int(x) for x in args.rows.split(",")]
  args.lengths = [int(x) for x in args.lengths.split(",")]
  return args


def load_rows(engine: RolloutEngine, bucket: int, lengths_B: np.ndarray):
  """A decode state of `bucket` live slots at the given committed lengths (cache left zero)."""
  state = engine._new_state(bucket)
  ints_5xB = np.stack([np.ones(bucket), lengths_B, np.full(bucket, 5), np.arange(bucket),
                       np.zeros(bucket)]).astype(np.int32)  # new, length, root, request, top-k
  return compiled.load_slots_jit(state, ints_5xB, np.ones((2, bucket), np.float32))


def time_steps(engine, bucket, lengths_B, nodes, reps):
  """(ms per step, first step's emitted tokens, cache length read by the XLA path)."""
  state = load_rows(engine, bucket, lengths_B)
  if nodes:
    chain = (np.full(nodes, 7, np.int32), np.arange(nodes, dtype=np.int32) - 1)
    trees, p, t = [chain] * bucket, bucket * (1 + nodes), nodes + 1
  else:
    trees, p, t = [None] * bucket, bucket, 1
  packed = accept.pack(trees, [True] * bucket, p)
  s = engine._kv_len_for(int(lengths_B.max()) + (reps + 3) * t)
  state, out = engine.verify(state, packed, False, s, t)
  first = step.from_wire(np.asarray(out))[0]  # the emitted tokens
  state, out = engine.verify(state, packed, False, s, t)
  jax.block_until_ready((state, out))
  t0 = time.perf_counter()
  for _ in range(reps):
    state, out = engine.verify(state, packed, False, s, t)
  jax.block_until_ready((state, out))
  return 1e3 * (time.perf_counter() - t0) / reps, first, s


def main(argv=None):
  args = parse_args(argv)
  backend = jax.default_backend()
  if backend not in ("tpu", "gpu") and not args.smoke:
    sys.exit(f"bench/engine_attention.py: the '{backend}' backend has no Pallas kernel "
             "(attention='pallas' would fall back to the XLA path); run it on a GPU/TPU, or "
             "with --smoke for the interpreted kernel on a tiny model")
  kernel_choice = "pallas_interpret" if args.smoke else "pallas"
  dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
  cfg = MODELS[args.model].replace(param_dtype=dtype, dtype=dtype)
  model = init_model(cfg, 0)
  itemsize = jnp.dtype(dtype).itemsize
  print(f"[engine_attention] {common.device_description()}; {args.model} shapes, random "
        f"weights, {dtype}; kernel choice {kernel_choice!r}", flush=True)
  rng = np.random.default_rng(0)
  rows, impls = [], set()
  for length in args.lengths:
    for bucket in args.rows:
      max_len = length + (args.reps + 4) * (args.nodes + 1)
      cache_bytes = 2 * cfg.num_layers * bucket * max_len * cfg.num_kv_heads * cfg.head_dim
      if cache_bytes * itemsize > args.max_cache_gib * (1 << 30):
        print(f"[engine_attention] skip B={bucket} L={length}: cache over "
              f"{args.max_cache_gib} GiB", flush=True)
        continue
      low = int((1 - args.spread) * length)
      lengths_B = rng.integers(low, length + 1, bucket)
      lengths_B[0] = length
      for mode, nodes in (("plain", 0), ("spec", args.nodes)):
        result = {}
        for choice in ("xla", kernel_choice):
          ecfg = EngineConfig(max_len=max_len, buckets=(bucket,), max_draft=max(nodes, 1),
                              pack_factors=(nodes + 1,) if nodes else (2,), eos_ids=(),
                              attention=choice)
          engine = RolloutEngine(model, ecfg)
          impls.add(engine.attention_impl)
          result[choice] = (*time_steps(engine, bucket, lengths_B, nodes, args.reps),
                            engine.attention_impl)
        (t_xla, tok_xla, s_xla, _), (t_k, tok_k, _, impl) = result["xla"], result[kernel_choice]
        same = float(np.mean(tok_xla == tok_k))
        rows.append([args.model, bucket, length, mode, ecfg.cache_len, s_xla, impl,
                     f"{t_xla:.3f}", f"{t_k:.3f}", f"{t_xla / t_k:.2f}x", f"{same:.3f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
  table = common.markdown_table(
      ["model", "B", "longest L", "mode", "cache S", "xla reads S", "kernel impl", "xla ms",
       "kernel ms", "xla/kernel", "first-step tokens equal"], rows)
  print(table)
  if not args.no_append and rows:
    notes = [f"{args.model} shapes, random weights, {dtype}; row lengths uniform in "
             f"[{1 - args.spread:.2f} L, L]; spec = chain of {args.nodes} draft tokens per row; "
             f"mean of {args.reps} back-to-back steps (one wait); kernel impls {sorted(impls)}"]
    if args.smoke:
      notes.append("SMOKE RUN on CPU: the kernel is interpreted, timings are meaningless; "
                   "this only checks that the bench runs and both paths agree.")
    common.append_results("Engine steps: attention='pallas' vs 'xla' "
                          "(bench/engine_attention.py)", table, notes)


if __name__ == "__main__":
  main()
