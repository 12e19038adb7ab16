"""Rollout engine warm-up per trainer variant: step shapes compiled and seconds, plain vs HistoSpec.

Every rollout shape compiles at warm-up (`RolloutEngine.warmup`), so a config's first GRPO step
waits for all of them; speculation adds shapes (packed sizes x KV lengths per bucket). This
builds the trainer's engine for a flagfile (`rl.rollouts.engine_config`, real weights) with
`--spec=none` and with `--spec=histospec` (and its history drafter, built as the trainer does),
each in its own process (engines in one process share compilations), and times `warmup()`: the
compilations per compiled function and the seconds (ratio: to plain's warm-up at the first
--compile_threads value). `--compile_threads=1,0` runs each variant with the buckets compiled
one after another and side by side (the trainer's --compile_threads; 0 = its default: one
thread per bucket up to the host's CPUs on a CPU, one on an accelerator).

  python bench/warmup_cost.py                                   # the GPU GRPO run's config
  python bench/warmup_cost.py --flag=--prompts_per_step=4 --compile_threads=1,0 --no_append
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import common  # noqa: E402

VARIANTS = {"plain": "--spec=none", "+HistoSpec": "--spec=histospec"}


def measure(flags: list[str]) -> dict:
  """Builds one engine from trainer flags and times its warm-up (in this process)."""
  from rhyme_jax.config import parse_flags
  from rhyme_jax.history.drafter import HistoryDrafter
  from rhyme_jax.history.store import HistoryStore
  from rhyme_jax.models.loading import load_model
  from rhyme_jax.models.tokenizer import load_tokenizer
  from rhyme_jax.rl.rollouts import engine_config
  from rhyme_jax.rollout.compiled import TRACE_COUNTS
  from rhyme_jax.rollout.engine import RolloutEngine
  from rhyme_jax.rollout.warmup import compile_threads
  config = parse_flags(["--run_dir=/nonexistent/warmup_cost", *flags])
  c = config
  t0 = time.perf_counter()
  drafter = (HistoryDrafter(HistoryStore(), max_budget=c.rollout.draft_budget)
             if c.rollout.spec == "histospec" else None)  # as rl.rollouts.Rollouts builds it
  drafter_s = time.perf_counter() - t0
  tokenizer = load_tokenizer(c.model.tokenizer or c.model.model)
  eng_cfg = engine_config(c, tokenizer.stop_ids, drafter is not None)
  model, _ = load_model(c.model.model)
  engine = RolloutEngine(model, eng_cfg, drafter)
  t0 = time.perf_counter()
  engine.warmup()
  return dict(seconds=time.perf_counter() - t0, drafter_seconds=drafter_s,
              buckets=list(eng_cfg.buckets),
              threads=compile_threads(engine),
              kv_lengths=list(engine.kv_lengths), traces=dict(TRACE_COUNTS))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--flagfile", default="configs/gsm8k_smollm2.flags")
  p.add_argument("--flag", action="append", default=None,
                 help="a trainer flag added to both variants (repeatable; default "
                      "--prompts_per_step=16: the GPU GRPO run's 128 samples)")
  p.add_argument("--compile_threads", type=_threads, default=[0],
                 help="comma-separated --compile_threads values, each variant run with each "
                      "(default 0: the trainer's default)")
  p.add_argument("--worker", help=argparse.SUPPRESS)  # one variant's flags, JSON
  common.add_results_args(p)
  args = p.parse_args(argv)
  if args.worker:
    print("RESULT " + json.dumps(measure(json.loads(args.worker))), flush=True)
    return 0
  flagfile = os.path.join(REPO, args.flagfile)  # an absolute --flagfile stays as it is
  if not os.path.isfile(flagfile):
    p.error(f"--flagfile={args.flagfile}: no such file")
  extra = args.flag if args.flag is not None else ["--prompts_per_step=16"]
  print(f"[warmup_cost] device: {common.device_description()}", flush=True)
  results = {}
  for threads in args.compile_threads:
    for name, spec in VARIANTS.items():
      flags = [f"--flagfile={flagfile}", *extra, spec, f"--compile_threads={threads}"]
      out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                            json.dumps(flags)], capture_output=True, text=True, cwd=REPO,
                           check=False)
      line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
      if out.returncode or not line:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"[warmup_cost] {name}: the worker failed (rc {out.returncode}): "
                         f"{tail}")
      results[name, threads] = r = json.loads(line[0][len("RESULT "):])
      print(f"[warmup_cost] {name}, {r['threads']} compile thread(s): "
            f"{r['traces'].get('step', 0)} step shapes, {r['seconds']:.1f} s", flush=True)
  first = args.compile_threads[0]
  base = results["plain", first]
  rows = [[name, r["threads"], " ".join(map(str, r["buckets"])),
           " ".join(map(str, r["kv_lengths"])), r["traces"].get("step", 0),
           sum(r["traces"].values()), f"{r['drafter_seconds']:.1f}", f"{r['seconds']:.1f}",
           f"{r['seconds'] / base['seconds']:.2f}",
           f"{results[name, first]['seconds'] / r['seconds']:.2f}"]
          for (name, _), r in results.items()]
  table = common.markdown_table(["variant", "compile threads", "buckets", "kv lengths",
                                 "step shapes compiled", "all compilations", "drafter build s",
                                 "warm-up s", "ratio", "speed-up vs first threads"], rows)
  print(table)
  if not args.no_append:
    common.append_results(
        "Engine warm-up per variant (bench/warmup_cost.py)", table,
        [f"trainer engine of {args.flagfile} with {' '.join(extra)}, real weights; each "
         "variant in its own process; warm-up = RolloutEngine.warmup (compiles and times every "
         "step shape, prefill, slot loading and bucket moves); compile threads = buckets "
         "compiled side by side before the timed pass (rollout/warmup.py); host CPUs: "
         f"{os.cpu_count()}", *args.note])
  return 0


def _threads(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0, comma-separated") from None
  if not values or min(values) < 0:
    raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0, comma-separated")
  return values


if __name__ == "__main__":
  sys.exit(main())
