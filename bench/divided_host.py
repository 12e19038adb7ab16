"""Host time per engine pass with divided rollout and without, in real rollouts of a tiny model.

On a GPU a 135M model's decode step takes ~4.6 ms for 32 rows, and the engine loop's own host
work per step (reading the step before, planning, dispatching) was 2.4-3.9 ms there
(bench/schedule_engine.py, H100): close enough that host work a policy adds can cost wall time
that no step count shows. This bench isolates that host work: a tiny random model (device work
negligible) runs 128 requests (16 prompts x G = 8) through 32 slots, once per policy, and the
engine's timeline (`EngineStats.timeline`) gives the host time from one step's dispatch to the
next's outside blocking reads, averaged by what the pass dispatched: nothing but the step
(plain), parks or resumes and no prefill (yield), new requests' prefill (prefill). Beside it,
the Python thread's own CPU time per step (`time.thread_time`), which waiting for a core while
XLA's threads run a step does not inflate: the steadier figure on a 2-core machine.

  fifo              data order, undivided
  oracle            true lengths, longest first, undivided (no per-pass order work)
  residual+divided  longest expected remaining work first, asked every `--divide_every`
                    tokens whether to yield (what schedule_engine's GPU runs time)

Each policy runs `--rounds` times, interleaved; the table keeps each one's median. The order
weighs a yield at `--yield_steps` decode steps (not this process's warm-up timing), so the
same yields happen in every process and a checkout (`--old`, in its own process) makes the
same decisions as this tree where it has the same order.

  python bench/divided_host.py
  python bench/divided_host.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)

PROMPTS, GROUP, SLOTS, MAX_NEW = 16, 8, 32, 256
POLICIES = ("fifo", "oracle", "residual+divided")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(p)
  p.add_argument("--rounds", type=int, default=5, help="runs per policy (median kept)")
  p.add_argument("--divide_every", type=int, default=16)
  p.add_argument("--yield_steps", type=float, default=0.08,
                 help="a yield's cost in decode steps, as the order weighs it (the H100's "
                      "warm-up timed 0.065-0.099)")
  p.add_argument("--multi_step", default="1",
                 help="comma list of plain decode steps per launch (EngineConfig.multi_step); "
                      "every policy runs at each, on an engine of its own (this tree only)")
  common.add_results_args(p)
  args = p.parse_args(argv)
  for flag in ("rounds", "divide_every"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag}={getattr(args, flag)}: must be >= 1")
  try:
    args.multi_step = [int(k) for k in args.multi_step.split(",")]
  except ValueError:
    p.error(f"--multi_step={args.multi_step}: expected a comma list of integers")
  # rhyme_jax.config.MAX_MULTI_STEP, not imported: a worker imports its own checkout's code
  if not all(1 <= k <= 64 for k in args.multi_step):
    p.error(f"--multi_step={','.join(map(str, args.multi_step))}: each must be in [1, 64]")
  if args.old and args.multi_step != [1]:
    p.error("--multi_step: only 1 with --old (older checkouts may not have multi-step launches)")
  if not args.yield_steps >= 0:
    p.error(f"--yield_steps={args.yield_steps}: must be >= 0")
  return args


def measure(code: str, args) -> list[dict]:
  """Medians per policy, with the rhyme_jax of checkout `code`."""
  sys.path.insert(0, code)
  from bench import schedule_engine
  host_by_event = schedule_engine.host_by_event
  host_parts_ms = getattr(schedule_engine, "host_parts_ms", None)  # absent in older checkouts
  from rhyme_jax.models.config import ModelConfig
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
  from rhyme_jax.rollout.sampling import SamplingParams
  from rhyme_jax.scheduling.admission import make_policy
  from rhyme_jax.scheduling.engine_order import EngineOrder
  from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable
  # vocab 192 with EOS one of it: at T=1 responses run ~190 tokens, as SmolLM2's GSM8K ones do
  model = init_model(ModelConfig(vocab_size=192, hidden_size=32, intermediate_size=64,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8), seed=1)
  cfg = EngineConfig(max_len=48 + MAX_NEW, buckets=(32, 16, 8, 4, 2, 1), max_draft=0,
                     speculate="never", eos_ids=(3,), divide_every=args.divide_every,
                     park_rows=PROMPTS * GROUP, seed=0)
  engines = {}
  for k in args.multi_step:  # an engine per launch length, each compiled at its warm-up
    engine = engines[k] = RolloutEngine(
        model, dataclasses.replace(cfg, multi_step=k) if k > 1 else cfg)
    engine.warmup()
    # The yield cost the order weighs (engine.yield_steps = one / a plain largest-bucket step)
    plain = engine.costs.warm[(SLOTS, SLOTS, 1, engine.kv_lengths[-1])]
    engine.yield_cost = dataclasses.replace(engine.yield_cost, one=args.yield_steps * plain)
  engine = engines[args.multi_step[0]]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 192, 40).tolist() for _ in range(PROMPTS)]
  params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)

  def requests(epoch):
    return [Request(epoch * 1000 + i * GROUP + j, prompts[i], params, group_id=i,
                    prompt_key=i) for i in range(PROMPTS) for j in range(GROUP)]

  first = engine.generate(requests(0))  # epoch 0: the history
  table = LengthTable()
  for i in range(PROMPTS):
    table.add(i, 0, [len(r.tokens) for r in first[i * GROUP:(i + 1) * GROUP]])
  true_lengths = {r.request_id: len(r.tokens) for r in engine.generate(requests(1))}
  def run(combo):
    name, k = combo
    policy = (make_policy("oracle", true_lengths=true_lengths) if name == "oracle" else
              make_policy("fifo") if name == "fifo" else
              make_policy("history_residual", predictor=LengthPredictor(table)))
    eng = engines[k]
    divided = name.endswith("+divided")
    eng.config = dataclasses.replace(eng.config, divide_every=cfg.divide_every if divided else 0)
    eng.generate(requests(1), admission=EngineOrder(policy))
    return eng.stats

  combos = [(name, k) for k in args.multi_step for name in POLICIES]
  # Transfers, in one untimed run per policy (logging them costs host time)
  moved = {}
  for combo in combos:
    n = common.host_to_device_transfers(lambda: run(combo))
    moved[combo] = n / engines[combo[1]].stats.steps
  runs = {combo: [] for combo in combos}
  for _ in range(args.rounds):
    for combo in combos:
      cpu = time.thread_time()
      st = run(combo)
      cpu = time.thread_time() - cpu
      per_pass = host_by_event(st.timeline)
      runs[combo].append(dict(
          step=st.host_s_per_step, cpu=cpu / st.steps, steps=st.steps,
          launches=getattr(st, "launches", st.steps), waits=st.host_waits / st.steps,
          yields=st.yields, passes=st.yield_passes, h2d=moved[combo],
          **{f"pass_{kind}": v for kind, v in per_pass.items()},
          **({f"part_{k}": v for k, v in host_parts_ms(st).items()} if host_parts_ms else {})))
  return [dict(policy=name if k == 1 else f"{name}, {k} steps/launch",
               **{key: float(np.median([r[key] for r in runs[(name, k)]]))
                  for key in runs[(name, k)][0]}) for name, k in combos]


def main(argv=None):
  args = parse_args(argv)
  worker_argv = [f"--rounds={args.rounds}", f"--divide_every={args.divide_every}",
                 f"--yield_steps={args.yield_steps}",
                 f"--multi_step={','.join(map(str, args.multi_step))}"]
  out = common.per_checkout(__file__, args, lambda code: measure(code, args), HERE,
                            worker_argv)
  if out is None:
    return
  codes = ([args.old] if args.old else []) + ["this tree"]
  rows = []
  for code, meds in zip(codes, out):
    base = {m["policy"]: m for m in meds}["oracle"]
    for med in meds:
      rows.append([code, med["policy"], f"{med['steps']:.0f}", f"{med['launches']:.0f}",
                   f"{1e3 * med['waits']:.1f}", f"{med['yields']:.0f}",
                   f"{med['passes']:.0f}", f"{med['h2d']:.2f}", f"{1e6 * med['step']:.0f}",
                   f"{1e6 * med['cpu']:.0f}", f"{med['cpu'] / base['cpu']:.2f}",
                   f"{1e6 * med['pass_plain']:.0f}",
                   f"{med['pass_plain'] / base['pass_plain']:.2f}",
                   f"{1e6 * med['pass_yields']:.0f}" if med["passes"] else "-",
                   f"{1e6 * med['pass_prefill']:.0f}"])
  table_md = common.markdown_table(
      ["code", "policy", "decode steps", "launches", "blocking reads / 1000 steps", "yields",
       "yield passes",
       "host-to-device transfers / step", "host us / step",
       "host CPU us / step", "CPU / oracle's", "host us / plain pass", "plain pass / oracle's",
       "host us / yield pass", "host us / prefill pass"], rows)
  # host ms per step by part (schedule_engine.host_parts_ms), from the checkouts that have it
  names = next(([k[5:] for k in med if k.startswith("part_")]
                for meds in out for med in meds if "part_CPU" in med), [])
  parts = [[code, med["policy"], f"{1e6 * med['step']:.0f}",
            *(f"{1e3 * med['part_' + k]:.0f}" for k in names)]
           for code, meds in zip(codes, out) for med in meds if "part_CPU" in med]
  if parts:
    table_md += "\n\n" + common.markdown_table(
        ["code", "policy", "host us / step", *(f"{k} us / step" for k in names)], parts)
  print(table_md)
  if not args.no_append:
    common.append_results(
        "Host time per engine pass, divided rollout vs undivided (bench/divided_host.py)",
        table_md,
        [f"tiny random model (host work only; vocab 192, 2 layers, EOS one token of 192), "
         f"{PROMPTS} prompts x G={GROUP} = {PROMPTS * GROUP} requests of 40 tokens, {SLOTS} "
         f"slots, up to {MAX_NEW} new tokens at T=1; epoch 0 in data order gives the history "
         f"and the oracle's lengths; median of {args.rounds} interleaved runs per policy, each "
         "code in its own process",
         "host-to-device transfers / step = arrays the rollout moved to the device (jit "
         "arguments from the host: packed trees, prefill chunks, slot loading, copy indices), "
         "as jax.transfer_guard_host_to_device('log') counts them in one untimed run, per "
         "decode step; the engine reads each step's outputs back in one copy (three before "
         "1b89c0a), which the guard does not log",
         "host us / step = rollout time outside blocking reads per decode step; host CPU us / "
         "step = the Python thread's CPU time (time.thread_time) per decode step, which "
         "waiting for a core while XLA's threads run a step does not inflate; per pass = host "
         "time from one step's dispatch to the next's (EngineStats.timeline), averaged over "
         "passes that dispatched nothing else (plain), parks or resumes and no prefill (yield), "
         "new requests' prefill (prefill)",
         "second table (checkouts that record it): host us / step by part (EngineStats): the "
         "decode steps' dispatch calls, admissions (prefill, resume copies, slot loading), "
         "yield checks and parks, reading step outputs, the rest (planning, packing, the "
         "loop); CPU = the thread's CPU time per step over the whole generate call",
         "launches = compiled decode calls (EngineConfig.multi_step: 'k steps/launch' rows run "
         "up to k plain steps per call, on an engine of their own); blocking reads = reads of "
         "step outputs with no later launch queued (the device idles), per 1000 decode steps",
         f"residual+divided: asked every {args.divide_every} tokens, a yield weighed at "
         f"{args.yield_steps} decode steps (fixed, so every process makes the same yields)",
         *args.note])


if __name__ == "__main__":
  main()
