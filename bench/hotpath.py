"""Plain decoding throughput on the real SmolLM2-135M (float32): the rollout engine before (a
checkout of `main`) and after (this tree) against `transformers.generate`, same process
environment, forced new tokens (no EOS), greedy; plus blocking host waits per emitted token.

  nice -n 10 python bench/hotpath.py --old /work/main --batches 1,16 --new_tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LEN = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
  import numpy as np
  rng = np.random.default_rng(0)
  return [rng.integers(100, vocab, PROMPT_LEN).tolist() for _ in range(batch)]


def engine_run(code: str, batches: list[int], new: int) -> list[dict]:
  sys.path.insert(0, code)
  from rhyme_jax.models.loading import load_model
  from rhyme_jax.rollout import engine as eng_lib
  from rhyme_jax.rollout.sampling import SamplingParams
  model, _ = load_model("smollm2-135m-instruct", param_dtype="float32")
  rows = []
  for b in batches:
    kw = dict(max_len=PROMPT_LEN + new + 1, buckets=(b,), eos_ids=())
    if "speculate" in eng_lib.EngineConfig.__dataclass_fields__:
      cfg = eng_lib.EngineConfig(max_draft=0, speculate="never", **kw)
    else:
      cfg = eng_lib.EngineConfig(budgets=(0,), **kw)
    e = eng_lib.RolloutEngine(model, cfg, None)
    e.warmup()
    reqs = lambda: [eng_lib.Request(i, p, SamplingParams(0.0, max_new_tokens=new))
                    for i, p in enumerate(prompts(b, model.cfg.vocab_size))]
    best = cpu = None
    for _ in range(2):
      t0, c0 = time.perf_counter(), time.process_time()
      res = e.generate(reqs())
      dt, dc = time.perf_counter() - t0, time.process_time() - c0
      best = dt if best is None else min(best, dt)
      cpu = dc if cpu is None else min(cpu, dc)
    s = e.stats
    waits = getattr(s, "host_waits", s.steps)  # main: one blocking device_get per step
    rows.append(dict(code="after" if code == HERE else "before", batch=b,
                     tokens=sum(len(r.tokens) for r in res), seconds=best, cpu_seconds=cpu,
                     waits_per_token=waits / max(s.tokens, 1)))
  return rows


def hf_run(batches: list[int], new: int) -> list[dict]:
  import torch
  from transformers import AutoModelForCausalLM
  sys.path.insert(0, HERE)
  from rhyme_jax.models.loading import resolve_model_path
  torch.set_num_threads(os.cpu_count() or 1)
  path = resolve_model_path("smollm2-135m-instruct")
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                               gguf_file=os.path.basename(path),
                                               dtype=torch.float32).eval()
  rows = []
  for b in batches:
    ids = torch.tensor(prompts(b, model.config.vocab_size))
    best = cpu = None
    for _ in range(2):
      t0, c0 = time.perf_counter(), time.process_time()
      with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
      dt, dc = time.perf_counter() - t0, time.process_time() - c0
      best = dt if best is None else min(best, dt)
      cpu = dc if cpu is None else min(cpu, dc)
    rows.append(dict(code="transformers.generate", batch=b,
                     tokens=int((out.shape[1] - ids.shape[1]) * b), seconds=best, cpu_seconds=cpu,
                     waits_per_token=float("nan")))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--old", default="")
  p.add_argument("--batches", default="1,16")
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  p.add_argument("--no_append", action="store_true")
  args = p.parse_args(argv)
  batches = [int(x) for x in args.batches.split(",")]
  if args.worker:
    rows = (hf_run(batches, args.new_tokens) if args.worker == "hf"
            else engine_run(args.worker, batches, args.new_tokens))
    print(json.dumps(rows))
    return
  rows = []
  for worker in ([args.old] if args.old else []) + [HERE, "hf"]:
    res = subprocess.run([sys.executable, __file__, "--worker", worker, "--batches",
                          args.batches, "--new_tokens", str(args.new_tokens)],
                         capture_output=True, text=True)
    if res.returncode:
      sys.exit(f"bench/hotpath.py: worker {worker} failed:\n{res.stderr[-3000:]}")
    rows += json.loads(res.stdout.strip().splitlines()[-1])
    print(rows[-len(batches):], flush=True)
  sys.path.insert(0, HERE)
  from bench import common
  hf = {r["batch"]: r for r in rows if r["code"].startswith("trans")}
  rate = lambda r, key: r["tokens"] / r[key]
  table = common.markdown_table(
      ["code", "batch", "tokens", "tok/s", "x transformers.generate", "tok per CPU-s",
       "x transformers.generate (CPU-s)", "blocking host waits / token"],
      [[r["code"], r["batch"], r["tokens"], f"{rate(r, 'seconds'):.1f}",
        f"{rate(r, 'seconds') / rate(hf[r['batch']], 'seconds'):.2f}",
        f"{rate(r, 'cpu_seconds'):.1f}",
        f"{rate(r, 'cpu_seconds') / rate(hf[r['batch']], 'cpu_seconds'):.2f}",
        "-" if r["waits_per_token"] != r["waits_per_token"] else f"{r['waits_per_token']:.3f}"]
       for r in rows])
  print(table)
  if not args.no_append:
    common.append_results(
        "Plain decoding on CPU: engine before/after the hot path vs transformers.generate", table,
        notes=["SmolLM2-135M-Instruct (GGUF dequantized), float32, greedy, "
               f"{args.new_tokens} forced new tokens after {PROMPT_LEN}-token prompts; best of 2",
               "before = the --old checkout (main before the hot-path merge), after = this tree "
               "(plain steps pipelined: step n+1 dispatched before step n is read)",
               "tok per CPU-s: tokens over the process's CPU time (all threads), less sensitive "
               "than wall time to other jobs on a shared machine",
               "machine shared with other jobs (2 cores): compare ratios within this run only"])


if __name__ == "__main__":
  main()
