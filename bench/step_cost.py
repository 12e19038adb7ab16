"""Hardware-independent cost of one decode step: XLA's cost analysis of the compiled plain and
speculative steps (bytes accessed, flops), before (a checkout of `main`) vs after (this tree).

SmolLM2-135M shapes (random weights, float32), B rows, a cache of S positions, ~`nodes` draft
nodes per row. The old engine verifies B x (budget + 1) positions over the whole cache; the new
one packs roots and nodes on one axis (P = B + B * nodes) and reads a cache bucket.

  python bench/step_cost.py --old /work/main   # CPU is enough: nothing runs, it compiles
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(code: str, batch: int, cache: int, nodes: int, budgets: list[int]) -> list[dict]:
  """Runs in a process whose `rhyme_jax` is the one under `code`."""
  sys.path.insert(0, code)
  import jax
  import jax.numpy as jnp
  from rhyme_jax.models.attention import KVCache
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout import accept, engine as eng_lib, step
  sys.path.insert(0, HERE)
  from bench.forward import SMOLLM2_135M
  cfg = SMOLLM2_135M.replace(param_dtype="float32", dtype="float32")
  model = init_model(cfg, 0)
  state = jax.eval_shape(lambda: step.DecodeState.empty(KVCache.zeros(cfg, batch, cache)))
  seed = jnp.uint32(0)
  out = []

  def cost(lowered):
    c = lowered.compile().cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return {"bytes": float(c.get("bytes accessed", 0)), "flops": float(c.get("flops", 0))}

  # One layer's attention (the part that grows with verified positions and cache length).
  from rhyme_jax.models import attention as attn
  kh, n, h = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
  kv = jax.ShapeDtypeStruct((batch, cache, kh, h), jnp.float32)
  lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
  if hasattr(attn, "tree_attention"):
    t = max(4, 256 // batch)
    for label, per_row in (("plain", 0), (f"spec ~{nodes} nodes/row", nodes)):
      p = batch * (1 + per_row)
      fn = lambda q, k, v, a, b, c, m, per_row=per_row: attn.tree_attention(
          q, k, v, a, b, c, m, max_kv_len=cache, max_q_len=1 if per_row == 0 else t)
      low = jax.jit(fn).lower(jax.ShapeDtypeStruct((p, n, h), jnp.float32), kv, kv, lens, lens,
                              lens, jax.ShapeDtypeStruct((p, 1), jnp.uint32))
      out.append({"code": "after", "step": f"1-layer attention, {label}", "positions": p,
                  **cost(low)})
  else:
    for budget in budgets:
      tt = budget + 1
      fn = lambda q, k, v, ln, m: attn.attend(q, k, v, attn.cache_visibility(ln, m, cache))
      low = jax.jit(fn).lower(jax.ShapeDtypeStruct((batch, tt, n, h), jnp.float32), kv, kv, lens,
                              jax.ShapeDtypeStruct((batch, tt, tt), jnp.bool_))
      out.append({"code": "before", "step": "1-layer attention, " + (
          "plain" if budget == 0 else f"spec budget {budget}"), "positions": batch * tt,
          **cost(low)})

  if hasattr(accept, "pack"):  # the packed engine
    e = eng_lib.RolloutEngine(model, eng_lib.EngineConfig(max_len=cache, buckets=(batch,)))
    t = max(4, 256 // batch)
    for label, per_row in (("plain", 0), (f"spec ~{nodes} nodes/row", nodes)):
      trees = [(jnp.zeros(per_row, jnp.int32), jnp.arange(per_row, dtype=jnp.int32) - 1)] * batch
      packed = accept.pack([(jax.device_get(a), jax.device_get(b)) for a, b in trees],
                           [True] * batch, batch * (1 + per_row))
      low = e._verify_fn.lower(e._leaves, state, packed.wire() if hasattr(packed, "wire")
                               else packed, seed, filters=False,
                               max_kv_len=cache, max_q_len=1 if per_row == 0 else t)
      out.append({"code": "after", "step": label, "positions": batch * (1 + per_row),
                  **cost(low)})
  else:  # the padded engine on main
    e = eng_lib.RolloutEngine(model, eng_lib.EngineConfig(max_len=cache, buckets=(batch,),
                                                          budgets=tuple(budgets)))
    for budget in budgets:
      trees = accept.pack_trees([eng_lib.DraftTree.empty(budget)] * batch, budget)
      low = e._verify_fn.lower(e._leaves, state, trees, seed, filters=False)
      out.append({"code": "before", "step": "plain" if budget == 0 else f"spec budget {budget}",
                  "positions": batch * (budget + 1), **cost(low)})
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--old", default="", help="a checkout of the old code (e.g. /work/main)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--cache", type=int, default=2048)
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--budgets", default="0,2,16", help="old engine's budgets to measure")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  p.add_argument("--no_append", action="store_true")
  args = p.parse_args(argv)
  budgets = [int(x) for x in args.budgets.split(",")]
  if args.worker:
    print(json.dumps(measure(args.worker, args.batch, args.cache, args.nodes, budgets)))
    return
  rows = []
  for code in ([args.old] if args.old else []) + [HERE]:
    res = subprocess.run([sys.executable, __file__, "--worker", code, "--batch", str(args.batch),
                          "--cache", str(args.cache), "--nodes", str(args.nodes),
                          "--budgets", args.budgets], capture_output=True, text=True, check=True)
    rows += json.loads(res.stdout.strip().splitlines()[-1])
  sys.path.insert(0, HERE)
  from bench import common
  plain = {(r["code"], r["step"].startswith("1-layer")): r["bytes"] for r in rows
           if r["step"].endswith("plain")}
  table = common.markdown_table(
      ["code", "step", "positions", "GB accessed", "GFLOP", "bytes / plain (same code)"],
      [[r["code"], r["step"], r["positions"], f"{r['bytes'] / 1e9:.3f}", f"{r['flops'] / 1e9:.1f}",
        f"{r['bytes'] / plain[r['code'], r['step'].startswith('1-layer')]:.2f}"] for r in rows])
  print(table)
  if not args.no_append:
    common.append_results(
        f"Step cost from XLA cost analysis: B={args.batch}, cache {args.cache}, before vs after "
        "the packed hot path", table,
        notes=["SmolLM2-135M shapes, float32, random weights; compiled on CPU, nothing run "
               "(hardware-independent: jax.jit(...).lower(...).compile().cost_analysis())",
               "before = main (padded B x (budget+1) verify over the whole cache); after = packed "
               f"P = B x (1 + {args.nodes}) tokens, cache bucket {args.cache}",
               "whole-step bytes are dominated on both sides by XLA's accounting of the per-layer "
               "scatter into the stacked L x B x S x K x H cache (counted as the whole cache per "
               "layer, though done in place when donated), hence the 1-layer attention rows"])


if __name__ == "__main__":
  main()
