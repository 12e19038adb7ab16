"""Bucket moves in a rollout's tail: always at once, or where the cost model says they pay.

SmolLM2-135M-Instruct (real weights, chat template) answers `--num_prompts` GSM8K train
prompts, G = `--group_size` samples each, in arrival order through an engine of `--slots` rows,
so the tail (nothing queued, rows finishing one by one) runs in buckets of the live rows or not.
One engine, warmed up once, runs the same requests with `EngineConfig.bucket_moves` "always"
(the rows move to the smallest bucket that holds them as soon as nothing waits; each move
drains the pipeline) and "cost" (rollout/tail.py: a move is made where the warm-up's step times
say its saving over the steps the rows are expected to run repays the move and the drained
pipeline), alternating, `--repeats` times each; the fastest run of each is kept.

Reports per mode: wall time and its ratio to "always", decode steps, slot steps (rows computed:
the work the buckets cost), moves made, passes the cost model held the rows, blocking reads
(host waits: the device idles), and the CRC32 of all sampled tokens (a move never changes what
is sampled, so it is equal across modes). A second table gives what the cost model weighed: the
warm-up time of a plain step per bucket at the longest cache length and of the move out of it.
On a CPU a step costs by the row, so "cost" should move as "always" does; on a GPU a step below
a few dozen rows costs about the same, so it should mostly hold.

  python bench/bucket_moves.py                         # CPU: 4 prompts x G=8, 8 slots (~10 min)
  python bench/bucket_moves.py --num_prompts 1 --group_size 4 --slots 2 --max_new_tokens 16 \\
      --repeats 1 --no_append                          # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.histospec import gsm8k_prompts  # noqa: E402
from bench.schedule_engine import (  # noqa: E402
    add_engine_flags, buckets_for, check_counts, tokens_crc)
from rhyme_jax.models.loading import load_model  # noqa: E402
from rhyme_jax.models.tokenizer import load_tokenizer  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402

MODES = ("always", "cost")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_engine_flags(p, num_prompts=4, max_new_tokens=128)
  p.add_argument("--repeats", type=int, default=2, help="runs of each mode; fastest kept")
  args = p.parse_args(argv)
  check_counts(p, args, ("num_prompts", "group_size", "slots", "max_new_tokens", "multi_step",
                         "repeats"), ("compile_threads",))
  return args


def main(argv=None):
  args = parse_args(argv)
  print(f"[bucket_moves] device: {common.device_description()}", flush=True)
  model, _ = load_model(args.model)
  tok = load_tokenizer(args.model)
  _, prompt_ids = gsm8k_prompts(tok, args.num_prompts, args.prompt_offset)
  longest = max(len(p) for p in prompt_ids)
  cfg = EngineConfig(max_len=longest + args.max_new_tokens, buckets=buckets_for(args.slots),
                     max_draft=0, speculate="never", eos_ids=tuple(tok.stop_ids),
                     seed=args.seed, multi_step=args.multi_step,
                     drain_steps=args.drain_steps,
                     compile_threads=args.compile_threads)
  engine = RolloutEngine(model, cfg)
  t0 = time.perf_counter()
  engine.warmup()
  print(f"[bucket_moves] warm-up in {time.perf_counter() - t0:.1f} s", flush=True)
  long_kv = max(engine.kv_lengths)
  weighed = [(b, f"{1e3 * engine.costs.warm[(b, b, 1, long_kv)]:.2f}",
              f"{1e3 * engine.move_seconds[b]:.2f}" if b in engine.move_seconds else "-")
             for b in cfg.buckets]
  params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
  requests = [Request(i * args.group_size + j, p, params, group_id=i)
              for i, p in enumerate(prompt_ids) for j in range(args.group_size)]
  best: dict[str, dict] = {}
  for rep in range(args.repeats):
    for mode in MODES:
      # Only the tail's rule differs: it compiles nothing, so one warmed-up engine serves both.
      engine.config = dataclasses.replace(cfg, bucket_moves=mode)
      results = engine.generate(requests)
      st = engine.stats
      row = dict(wall=st.total_time_s, steps=st.steps, slot_steps=st.slot_steps,
                 moves=st.bucket_moves, held=st.moves_held, waits=st.host_waits,
                 tokens=st.tokens, crc=tokens_crc(results))
      print(f"[bucket_moves] {mode} run {rep}: {row}", flush=True)
      if mode not in best or row["wall"] < best[mode]["wall"]:
        best[mode] = row
  base = best["always"]["wall"]
  headers = ["mode", "wall s", "/ always", "decode steps", "slot steps", "moves", "held passes",
             "blocking reads", "tokens", "tokens CRC32"]
  rows = [(m, f"{r['wall']:.2f}", f"{r['wall'] / base:.3f}", r["steps"], r["slot_steps"],
           r["moves"], r["held"], r["waits"], r["tokens"], f"{r['crc']:08x}")
          for m, r in best.items()]
  table = common.markdown_table(headers, rows)
  weights = common.markdown_table(["bucket", f"plain step ms (warm-up, cache {long_kv})",
                                   "move out of it ms (warm-up)"], weighed)
  print(table + "\n\n" + weights, flush=True)
  if len({r["crc"] for r in best.values()}) != 1:
    raise SystemExit("[bucket_moves] the modes sampled different tokens")
  if not args.no_append:
    common.append_results(
        f"Bucket moves: always vs where the cost model says they pay ({args.num_prompts} "
        f"GSM8K prompts x G={args.group_size}, {args.slots} slots, {args.max_new_tokens} "
        f"tokens, {args.multi_step} step(s) per launch, fastest of {args.repeats})",
        table + "\n\nWhat the cost model weighed:\n\n" + weights, notes=args.note)
  return best


if __name__ == "__main__":
  main()
