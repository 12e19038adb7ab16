"""Control flow in the rollout's compiled programs as lowered for the GPU and the TPU.

XLA:GPU runs control flow from the host: a conditional copies its branch index to the host and
waits for the stream mid-call (the device drains, then idles while the host launches the rest);
a while loop launches its body's kernels once per iteration (and without a known trip count
reads its predicate back each time). The engine keeps one call queued behind another, so a
loop or a conditional in a decode step costs host time, or a sync, in every step. This bench
lowers each compiled function of the engine (jax.export, no accelerator needed) and counts
`stablehlo.while` and conditionals (`case` / `if`) per platform: hardware-independent, one
process per checkout.

  python bench/lowering.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)

PLATFORMS = ("cuda", "tpu")
BUCKET = 4


PALLAS = {"cuda": "gpu", "tpu": "tpu"}  # the attention kernel each platform compiles
TRITON_CALL = "__gpu$xla.gpu.triton"


def control_flow(fn, platform: str, *args, **kw) -> dict[str, int]:
  """While loops and conditionals in `fn`'s StableHLO lowered for `platform`; an
  `attention_impl` of "pallas" picks the platform's kernel (a kernel's own loops are inside
  its custom call, not counted)."""
  if kw.get("attention_impl") == "pallas":
    kw = dict(kw, attention_impl=PALLAS[platform])
  # Triton calls carry no serialization-compatibility guarantee; they are only lowered here.
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  module = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(
      *args, **kw).mlir_module()
  return {"while": module.count("stablehlo.while"),
          "conditional": module.count("stablehlo.case") + module.count("stablehlo.if")}


def programs(engine) -> dict:
  """name -> (jitted function, args, kwargs): every call a rollout makes, at one bucket."""
  import numpy as np
  from rhyme_jax.rollout import accept, compiled
  state = engine._new_state(BUCKET)
  p, t = engine.shapes(BUCKET)[-1]
  n = min(t - 1, p // BUCKET - 1)  # a chain per row, as long as the packed size allows
  chain = (np.arange(1, n + 1, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32))
  plain = engine._plain_roots((True,) * BUCKET)
  drafted = accept.pack([chain] * BUCKET, [True] * BUCKET, p).wire()
  base = dict(filters=False, max_kv_len=engine.kv_lengths[-1], max_q_len=1,
              attention_impl="xla")
  verify = lambda wire, **kw: (engine._verify_fn, (engine._leaves, state, wire, engine._seed),
                               {**base, **kw})
  k = engine.config.multi_step
  return {
      "plain step": verify(plain),
      "plain step, top-p/top-k": verify(plain, filters=True),
      "plain step, Pallas attention": verify(plain, attention_impl="pallas"),
      f"speculative step (T={t})": verify(drafted, max_q_len=t),
      f"speculative step (T={t}), Pallas attention": verify(drafted, max_q_len=t,
                                                            attention_impl="pallas"),
      f"{k} plain steps in one launch": verify(plain, steps=k),
      "prefill chunk": (engine._prefill_fn, (engine._leaves, state.cache,
                                             np.zeros(2 + engine.config.prefill_chunk,
                                                      np.int32)), {}),
      "slot loading": (compiled.load_slots_jit, (state, np.zeros((5, BUCKET), np.int32),
                                                 np.ones((2, BUCKET), np.float32)), {}),
      "bucket move": (compiled.regroup_jit, (state, np.arange(2, dtype=np.int32)), {}),
      "row copies (divided rollout)": row_copies(compiled, state),
      **({"prompt copies (admission)": (compiled.copy_within_jit,
                                        (state.cache, np.zeros((2, 2), np.int32)), {})}
         if hasattr(compiled, "copy_within_jit") else {}),
  }


def row_copies(compiled, state):
  """Divided rollout's row copies: a pass's parks, resumes and slot loading in one call, or in
  a checkout from before that, the copies alone (`copy_rows_jit`)."""
  import numpy as np
  rows = np.zeros((2, 4), np.int32)
  if hasattr(compiled, "park_resume_load_jit"):
    from rhyme_jax.rollout import step
    return (compiled.park_resume_load_jit,
            (state, state.cache, step.pass_ints(rows, rows, np.zeros((5, BUCKET), np.int32)),
             np.ones((2, BUCKET), np.float32)), {})
  return compiled.copy_rows_jit, (state.cache, state.cache, rows), {}


def measure(code: str) -> list[dict]:
  sys.path.insert(0, code)
  from bench.forward import SMOLLM2_135M
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine
  engine = RolloutEngine(init_model(SMOLLM2_135M, 0),
                         EngineConfig(max_len=256, buckets=(BUCKET,), max_draft=8, eos_ids=(),
                                      multi_step=4, park_rows=4))
  return [dict(program=name, platform=platform, **control_flow(fn, platform, *a, **kw))
          for name, (fn, a, kw) in programs(engine).items() for platform in PLATFORMS]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(p)
  common.add_results_args(p)
  args = p.parse_args(argv)
  outs = common.per_checkout(__file__, args, measure, HERE)
  if outs is None:
    return
  codes = ([args.old] if args.old else []) + ["this tree"]
  rows = [[code, r["program"], r["platform"], r["while"], r["conditional"]]
          for code, out in zip(codes, outs) for r in out]
  table = common.markdown_table(["code", "program", "platform", "while loops", "conditionals"],
                                rows)
  print(table)
  if not args.no_append:
    common.append_results(
        "Control flow in the compiled rollout programs, lowered for GPU and TPU "
        "(bench/lowering.py)", table,
        ["SmolLM2-135M shapes, random weights; each function the engine calls in a rollout, "
         f"at bucket {BUCKET}, lowered with jax.export for each platform (StableHLO, before "
         "XLA's own passes; no accelerator used)",
         "on XLA:GPU a conditional reads its branch index back to the host and waits mid-call; "
         "a while loop's body is launched from the host once per iteration (without a known "
         "trip count its predicate is read back each time); on a TPU both run on the device",
         *args.note])


if __name__ == "__main__":
  main()
