"""Rollout speed: plain decoding vs tree speculation with oracle drafts at controlled acceptance.

On SmolLM2-135M-Instruct with GSM8K prompts (chat template), for each batch size: a plain
rollout (budget 0) produces greedy responses; those responses become oracle drafts whose tokens
are right with probability `accuracy`, verified at each budget. Reports rollout tokens/s, target
forward passes per generated token, mean accepted length per verify step (bonus included) and the
speed-up over plain decoding in the same run. Every speculative rollout is checked to emit the
plain rollout's tokens (greedy; divergences would be float near-ties between step shapes).

  python bench/rollout.py                       # CPU defaults (a few minutes)
  python bench/rollout.py --batches 1,8,32,128 --max_new_tokens 256 --budgets 4,8,16   # GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from rhyme_jax.data import datasets, prompts  # noqa: E402
from rhyme_jax.models import loading, tokenizer  # noqa: E402
from rhyme_jax.rollout.drafts import NoDrafts, OracleDrafter  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--budgets", default="8")
  p.add_argument("--accuracies", default="0.5,0.8,0.95")
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--no_record", action="store_true", help="do not append to bench/RESULTS.md")
  return p.parse_args(argv)


def ints(s):
  return [int(x) for x in s.split(",") if x]


def make_requests(tok, n, max_new_tokens):
  examples = datasets.load_gsm8k("train")[:n]
  template = prompts.get_prompt_template("gsm8k")
  render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
  params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
  return [Request(i, tok.encode(prompts.render_prompt(ex, render, template)), params, group_id=i)
          for i, ex in enumerate(examples)]


def timed(engine, reqs):
  engine.warmup()
  t0 = time.perf_counter()
  res = engine.generate(reqs)
  return res, time.perf_counter() - t0


def main(argv=None):
  args = parse_args(argv)
  model, _ = loading.load_model(args.model)
  tok = tokenizer.load_tokenizer(args.model)
  budgets, accs = ints(args.budgets), [float(a) for a in args.accuracies.split(",")]
  headers = ["batch", "drafts", "budget", "tokens/s", "fwd/token", "accepted len", "speed-up",
             "same tokens"]
  rows = []
  for b in ints(args.batches):
    reqs = make_requests(tok, b, args.max_new_tokens)
    max_len = max(len(r.prompt) for r in reqs) + args.max_new_tokens + 1
    base = dict(max_len=max_len, buckets=(b,), eos_ids=tuple(tok.stop_ids))
    plain_engine = RolloutEngine(model, EngineConfig(max_draft=0, **base), NoDrafts())
    plain, t_plain = timed(plain_engine, reqs)
    s = plain_engine.stats
    rows.append([b, "none", 0, f"{s.tokens / t_plain:.1f}", f"{s.forwards_per_token:.3f}",
                 "1.00", "1.00", "-"])
    print(rows[-1], flush=True)
    targets = {r.request_id: r.tokens for r in plain}
    for budget in budgets:
      for acc in accs:
        cfg = EngineConfig(max_draft=budget, speculate="always", pack_factors=(budget + 1,),
                           **base)
        eng = RolloutEngine(model, cfg, OracleDrafter(targets, model.cfg.vocab_size, acc))
        res, t = timed(eng, reqs)
        same = sum(np.array_equal(a.tokens, c.tokens) for a, c in zip(plain, res))
        s = eng.stats
        rows.append([b, f"oracle p={acc}", budget, f"{s.tokens / t:.1f}",
                     f"{s.forwards_per_token:.3f}", f"{s.mean_accepted_length:.2f}",
                     f"{(s.tokens / t) / (plain_engine.stats.tokens / t_plain):.2f}",
                     f"{same}/{len(res)}"])
        print(rows[-1], flush=True)
  table = common.markdown_table(headers, rows)
  print(table)
  if not args.no_record:
    common.append_results(
        "Rollout: plain decoding vs oracle tree speculation (bench/rollout.py)", table,
        notes=[f"{args.model}, float32, greedy, GSM8K train prompts (chat template), "
               f"max_new_tokens={args.max_new_tokens}; one bucket per batch size; compile time "
               "excluded (warm-up); oracle drafts = the plain run's tokens, each right with "
               "probability p; speed-up = tokens/s ratio to plain decoding in the same run",
               "'same tokens': speculative responses identical to the plain ones"])


if __name__ == "__main__":
  main()
