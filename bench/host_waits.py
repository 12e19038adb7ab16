"""Blocking host waits per emitted token, before (a checkout of `main`) vs after (this tree):
a tiny random model (the count does not depend on the model), plain decoding and speculative
decoding with an oracle drafter (acceptance 0.8), 16 requests x 48 tokens over 8 slots.

  python bench/host_waits.py --old /work/main
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)


def count(code: str) -> list[dict]:
  sys.path.insert(0, code)
  import numpy as np
  from rhyme_jax.models.config import ModelConfig
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout import drafts, engine as eng_lib
  from rhyme_jax.rollout.sampling import SamplingParams
  model = init_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8), seed=1)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 64, 8).tolist() for _ in range(16)]
  reqs = lambda: [eng_lib.Request(i, p, SamplingParams(1.0, max_new_tokens=48))
                  for i, p in enumerate(prompts)]
  new = "speculate" in eng_lib.EngineConfig.__dataclass_fields__
  base = dict(max_len=64, buckets=(8, 4, 2, 1), eos_ids=())
  plain_cfg = (eng_lib.EngineConfig(max_draft=0, **base) if new
               else eng_lib.EngineConfig(budgets=(0,), **base))
  spec_cfg = (eng_lib.EngineConfig(max_draft=8, **base) if new
              else eng_lib.EngineConfig(budgets=(0, 8), budget_by_batch=((1 << 30, 8),), **base))
  rows = []
  e = eng_lib.RolloutEngine(model, plain_cfg, None)
  e.warmup()
  plain = e.generate(reqs())
  targets = {r.request_id: r.tokens for r in plain}
  for label, eng in (("plain", e), ("oracle drafts p=0.8", eng_lib.RolloutEngine(
      model, spec_cfg, drafts.OracleDrafter(targets, 64, accuracy=0.8)))):
    if label != "plain":
      eng.warmup()  # compiles and times every shape (the cost model's starting point)
      eng.generate(reqs())
    s = eng.stats
    waits = getattr(s, "host_waits", s.steps)  # main: one blocking device_get per step
    rows.append(dict(code="after" if code == HERE else "before", run=label, steps=s.steps,
                     tokens=s.tokens, waits=waits))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(p)
  common.add_results_args(p, note=False)
  args = p.parse_args(argv)
  outs = common.per_checkout(__file__, args, count, HERE)
  if outs is None:
    return
  rows = [row for out in outs for row in out]
  table = common.markdown_table(
      ["code", "run", "steps", "tokens", "blocking host waits", "waits / token"],
      [[r["code"], r["run"], r["steps"], r["tokens"], r["waits"],
        f"{r['waits'] / r['tokens']:.3f}"] for r in rows])
  print(table)
  if not args.no_append:
    common.append_results("Blocking host waits per emitted token, before vs after", table, notes=[
        "a wait is blocking when the host reads a step's outputs with no later step queued "
        "(the device idles until the host dispatches again); before = main (every step), "
        "after = this branch (plain steps pipelined; speculative steps still read before "
        "drafting the next)", "tiny random model: counts, not times; engines warmed up (after: step times per shape "
        "seed the cost model, which decides per step whether to speculate); machine shared"])


if __name__ == "__main__":
  main()
