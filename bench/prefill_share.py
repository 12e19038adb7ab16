"""Admission with a GRPO group's prompt prefilled once, against a prefill per request, in one run.

GRPO samples G responses per prompt. The engine prefills the first sample's prompt and copies
that KV row into the other samples' slots (`RolloutEngine._admit`, `kv_cache.copy_rows_within`):
the prompt's KV is the same computation for each, so the tokens are the same either way. This
bench runs SmolLM2-135M-Instruct (real weights, chat template) on `--num_prompts` GSM8K train
prompts x `--group_size` samples in one bucket of as many slots (all admitted at once, the start
of every GRPO rollout), once with the requests grouped by prompt (shared) and once with a group
per request (nothing to share), alternating, `--repeats` times. It prints prefill calls, prompt
tokens computed, the rollout's wall time and its ratio per repeat (median), and checks that the
tokens (CRC32) match. Short responses by default: the figure is admission's share.

  python bench/prefill_share.py
  python bench/prefill_share.py --num_prompts 8 --group_size 8 --max_new_tokens 64
  python bench/prefill_share.py --model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf   # a GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.histospec import MODEL_NAME, gsm8k_prompts  # noqa: E402
from bench.schedule_engine import check_counts, tokens_crc  # noqa: E402
from rhyme_jax.models.loading import load_model  # noqa: E402
from rhyme_jax.models.tokenizer import load_tokenizer  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402

VARIANTS = ("shared", "per request")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=MODEL_NAME,
                 help="registry name, GGUF file or HF checkpoint directory")
  p.add_argument("--num_prompts", type=int, default=4)
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--max_new_tokens", type=int, default=8)
  p.add_argument("--prefill_chunk", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--prompt_offset", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  common.add_results_args(p)
  args = p.parse_args(argv)
  check_counts(p, args, ("num_prompts", "group_size", "max_new_tokens", "prefill_chunk",
                         "repeats"))
  return args


def main(argv=None):
  args = parse_args(argv)
  print(f"[prefill_share] device: {common.device_description()}", flush=True)
  model, _ = load_model(args.model)
  tok = load_tokenizer(args.model)
  _, prompt_ids = gsm8k_prompts(tok, args.num_prompts, args.prompt_offset)
  n = args.num_prompts * args.group_size
  cfg = EngineConfig(max_len=max(map(len, prompt_ids)) + args.max_new_tokens, buckets=(n,),
                     max_draft=0, speculate="never", kv_buckets=1, eos_ids=tuple(tok.stop_ids),
                     seed=args.seed, prefill_chunk=args.prefill_chunk)
  engine = RolloutEngine(model, cfg)
  engine.warmup()
  params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
  grouped = [Request(i * args.group_size + j, p, params, group_id=i)
             for i, p in enumerate(prompt_ids) for j in range(args.group_size)]
  requests = {"shared": grouped,
              "per request": [dataclasses.replace(r, group_id=-1 - r.request_id)
                              for r in grouped]}
  runs = {v: [] for v in VARIANTS}
  for _ in range(args.repeats):
    for v in VARIANTS:
      t0 = time.perf_counter()
      out = engine.generate(requests[v])
      wall = time.perf_counter() - t0
      st = engine.stats
      runs[v].append(dict(wall=wall, calls=st.prefill_chunks, shared=st.prefill_shared,
                          admit=st.prefill_time_s, crc=tokens_crc(out), tokens=st.tokens))
      print(f"[prefill_share] {v}: {wall:.2f} s, {st.prefill_chunks} prefill calls, "
            f"{st.prefill_shared} copies", flush=True)
  crcs = {r["crc"] for v in VARIANTS for r in runs[v]}
  if len(crcs) != 1:
    raise SystemExit(f"[prefill_share] tokens differ between variants: CRC32s {sorted(crcs)}")
  ratios = [s["wall"] / p["wall"] for s, p in zip(runs["shared"], runs["per request"])]
  prompt_tokens = sum(len(p) - 1 for p in prompt_ids)
  computed = {"shared": prompt_tokens, "per request": prompt_tokens * args.group_size}
  rows = []
  for v in VARIANTS:
    r = runs[v]
    rows.append([v, r[0]["calls"], r[0]["shared"], computed[v],
                 f"{1e3 * np.median([x['admit'] for x in r]):.1f}",
                 f"{np.median([x['wall'] for x in r]):.2f}",
                 f"{np.median(ratios):.2f}" if v == "shared" else "1.00",
                 f"{runs[v][0]['crc']:08x}"])
  table = common.markdown_table(
      ["prompts", "prefill calls", "rows copied", "prompt tokens prefilled",
       "admission dispatch ms (median)", "rollout s (median)",
       "rollout / per request's (median of repeats)", "tokens CRC32"], rows)
  print(table)
  notes = [f"SmolLM2-135M-Instruct, {args.num_prompts} GSM8K train prompts from "
           f"{args.prompt_offset} x G={args.group_size} samples = {n} requests in one bucket of "
           f"{n} slots (all admitted at once), T=1, {args.max_new_tokens} new tokens, prefill "
           f"chunk {args.prefill_chunk}; the two variants alternate, {args.repeats} repeats; "
           f"per-repeat ratios {', '.join(f'{x:.2f}' for x in ratios)}",
           "per request = the same requests, each its own group (nothing to share): the "
           "engine before prompt sharing", *args.note]
  if not args.no_append:
    common.append_results("Prompt prefill shared within a GRPO group (bench/prefill_share.py)",
                          table, notes)
  return 0


if __name__ == "__main__":
  sys.exit(main())
