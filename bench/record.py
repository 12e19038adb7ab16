"""Records real SmolLM2 GSM8K rollouts for offline drafter replay (`bench/replay.py`).

The real engine (`RolloutEngine`, plain one-token decoding, no drafter) answers GSM8K train
prompts rendered with the model's chat template and the `gsm8k` prompt template, G samples
each, for each `--runs` entry `T:epochs:G` (T = 0 is greedy). Every epoch uses a fresh seed
(`seed * 1000 + epoch`, as bench/histospec.py) and no policy change between epochs (same
weights, new random draws). Each epoch is written as soon as it finishes to
`--out_dir/gsm8k_T{T}_e{epoch}_p{first}-{end}.npz` (format: `rhyme_jax.history.recording`).

  nice -n 10 python bench/record.py --num_prompts 32 --max_new_tokens 256 \\
      --runs 0.6:2:8,0:1:1,1.0:2:8 --out_dir /work/recordings
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.data.datasets import load_gsm8k  # noqa: E402
from rhyme_jax.data.prompts import get_prompt_template, render_prompt  # noqa: E402
from rhyme_jax.history.recording import Recording  # noqa: E402
from rhyme_jax.history.store import prompt_key  # noqa: E402
from rhyme_jax.models.loading import load_model  # noqa: E402
from rhyme_jax.models.tokenizer import load_tokenizer  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"


def parse_runs(p, text):
  runs = []
  for part in text.split(","):
    try:
      t, e, g, *first = part.split(":")
      runs.append((float(t), int(e), int(g), int(first[0]) if first else 0))
    except (ValueError, IndexError):
      p.error(f"--runs entry {part!r}: expected TEMPERATURE:EPOCHS:GROUP_SIZE[:FIRST_EPOCH], "
              "e.g. 0.6:2:8")
    if runs[-1][0] < 0 or runs[-1][1] <= 0 or runs[-1][2] <= 0 or runs[-1][3] < 0:
      p.error(f"--runs entry {part!r}: need T >= 0, EPOCHS > 0, GROUP_SIZE > 0, FIRST_EPOCH >= 0")
  return runs


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=MODEL_NAME)
  p.add_argument("--num_prompts", type=int, default=32)
  p.add_argument("--prompt_offset", type=int, default=0)
  p.add_argument("--max_new_tokens", type=int, default=256)
  p.add_argument("--runs", default="0.6:2:8,0:1:1,1.0:2:8",
                 help="comma-separated TEMPERATURE:EPOCHS:GROUP_SIZE[:FIRST_EPOCH] (T=0: greedy)")
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--buckets", default="64,16,4,1")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
  p.add_argument("--out_dir", default="/work/recordings")
  args = p.parse_args(argv)
  args.runs = parse_runs(p, args.runs)
  try:
    args.buckets = tuple(int(b) for b in args.buckets.split(","))
  except ValueError:
    p.error(f"--buckets={args.buckets!r}: expected comma-separated integers")
  for flag in ("num_prompts", "max_new_tokens"):
    if getattr(args, flag) <= 0:
      p.error(f"--{flag}={getattr(args, flag)}: must be > 0")
  return args


def gsm8k_prompts(tok, num, offset):
  examples = load_gsm8k("train")
  if offset + num > len(examples):
    raise SystemExit(f"--prompt_offset={offset} + --num_prompts={num} exceeds the "
                     f"{len(examples)} GSM8K train examples")
  template = get_prompt_template("gsm8k")
  render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
  return [np.asarray(tok.encode(render_prompt(e, render, template)), np.int32)
          for e in examples[offset:offset + num]]


def main(argv=None):
  args = parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  os.makedirs(args.out_dir, exist_ok=True)
  model, _ = load_model(args.model, param_dtype=dtype)
  tok = load_tokenizer(args.model)
  prompts = gsm8k_prompts(tok, args.num_prompts, args.prompt_offset)
  keys = [prompt_key(p) for p in prompts]
  cfg = EngineConfig(max_len=max(map(len, prompts)) + args.max_new_tokens, buckets=args.buckets,
                     max_draft=0, eos_ids=tuple(tok.stop_ids), seed=args.seed)
  t0 = time.perf_counter()
  RolloutEngine(model, cfg, None).warmup()
  print(f"[record] {common.device_description()}; warm-up {time.perf_counter() - t0:.0f}s",
        flush=True)
  for temp, epochs, g, first_epoch in args.runs:
    params = SamplingParams(temperature=temp, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens)
    for epoch in range(first_epoch, first_epoch + epochs):
      # Request ids count from the dataset index, so recordings of consecutive prompt ranges
      # merge into the one a single run over all of them would have made (same random draws).
      base = args.prompt_offset
      reqs = [Request((base + i) * g + j, p, params, group_id=f"e{epoch}/p{base + i}",
                      prompt_key=keys[i]) for i, p in enumerate(prompts) for j in range(g)]
      seed = args.seed * 1000 + epoch
      engine = RolloutEngine(model, dataclasses.replace(cfg, seed=seed), None)
      t0 = time.perf_counter()
      results = engine.generate(reqs)
      bad = [r.error for r in results if r.finish_reason == "error"]
      if bad:
        raise SystemExit(f"[record] rollout failed: {bad[0]}")
      rec = Recording(
          responses=[np.asarray(r.tokens, np.int32) for r in results],
          request_ids=np.array([r.request_id for r in results], np.int64),
          prompt_index=np.array([r.request_id // g - base for r in results], np.int64),
          finish=[r.finish_reason for r in results], prompts=prompts, prompt_keys=keys,
          meta=dict(epoch=epoch, seed=seed, temperature=temp, top_p=args.top_p, top_k=0,
                    max_new_tokens=args.max_new_tokens, group_size=g, model=args.model,
                    dataset="gsm8k", split="train", prompt_offset=args.prompt_offset,
                    num_prompts=args.num_prompts, dtype=dtype,
                    device=common.device_description(), date=common.today()))
      path = os.path.join(args.out_dir,
                          f"gsm8k_T{temp:g}_e{epoch}_p{base}-{base + len(prompts)}.npz")
      rec.save(path)
      print(f"[record] T={temp} epoch {epoch}: {len(results)} responses, {rec.num_tokens} tokens, "
            f"{time.perf_counter() - t0:.0f}s -> {path}", flush=True)


if __name__ == "__main__":
  main()
