"""Real rollouts under each admission order, divided rollout included: makespan, tail, slot use.

SmolLM2-135M-Instruct (real weights, chat template) answers `--num_prompts` GSM8K train
prompts, G = `--group_size` samples each, through the rollout engine with `--slots` rows, fewer
than the requests, so they queue and the admission order matters. Epoch 0 runs in data order
and gives each prompt a history of response lengths. Epoch 1 (new request ids, so new samples
from the same policy) then runs once per policy (`--policies`, one engine, compiled once):

  fifo              data order
  history           longest predicted first (the prompt's epoch-0 lengths)
  probe             Seer: each group's first sample first, then the longest sibling so far
  residual          longest remaining work first: the upper quartile of L - n given L > n
                    over history, ties by its mean (ResidualPolicy's default quantile;
                    `--residual_quantile` sets another for every residual policy but +mean)
  residual+divided  the same, and every `--divide_every` tokens a running request is offered
                    to yield its slot; it yields to a margin more expected remaining work that
                    the engine's measured yield cost sets (ResidualPolicy.yield_margin)
                    (divided rollout; KV parked in `--park_rows` rows)
  residual+divided+lrpt  the same with no margin: pure LRPT, yields taken as free (the rule
                    before the yield cost was weighed)
  residual+divided+waited  the same with the yield cost timed as each yield waited for (the
                    measure before the engine timed copies queued as a rollout makes them)
  residual+divided+mean  the same ranked by the mean, E[L - n | L > n] (the rule before the
                    upper quartile)
  oracle            epoch 1's true lengths, longest first (known from the fifo run: every
                    order samples the same tokens), without division

Reports per policy: makespan (rollout start to its last response), tail (the time to finish the
last 10% of responses; also on the modelled clock, `modelled_finish`), slot utilisation (live
rows / rows over decode steps), makespan and tail against the oracle's, tail cut vs FIFO,
yields and the passes that made them (one copy call each way per pass), most requests parked at
once, host time per decode step outside blocking reads and the number of those reads, wall time
beyond the modelled step times split by what came before each step (`excess_by_event`), and the
CRC32 of all sampled tokens, equal across policies (the order never changes what is sampled).
Policies run in the order given, one after another on an idle machine; `--repeats` runs the
whole list again and keeps each policy's fastest run; with several, the notes also give each
policy's makespan / oracle and tail cut vs FIFO within each repeat, and their median.

  python bench/schedule_engine.py                      # CPU: 8 prompts x G=8, 8 slots (~15 min)
  python bench/schedule_engine.py --num_prompts 2 --group_size 4 --slots 2 --max_new_tokens 32 \\
      --no_append                                      # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
# bench/divided_host.py reads host_by_event and host_parts_ms from this module (older
# checkouts define them here)
from bench.engine_timeline import (  # noqa: E402
    HOST_PARTS, excess_by_event, host_by_event, host_parts_ms, modelled_finish)
from bench.histospec import MODEL_NAME, gsm8k_prompts  # noqa: E402
from bench.schedsim import quantile_arg  # noqa: E402
from bench.schedsim_traces import Trace, write_trace  # noqa: E402
from rhyme_jax.history.store import prompt_key  # noqa: E402
from rhyme_jax.models.loading import load_model  # noqa: E402
from rhyme_jax.models.tokenizer import load_tokenizer  # noqa: E402
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402
from rhyme_jax.rollout.interface import DRAIN_STEPS  # noqa: E402
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402
from rhyme_jax.scheduling.admission import RESIDUAL_QUANTILE, make_policy  # noqa: E402
from rhyme_jax.scheduling.engine_order import EngineOrder  # noqa: E402
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable  # noqa: E402
from rhyme_jax.scheduling.simulate import tail_time  # noqa: E402

POLICIES = ("fifo", "history", "probe", "residual", "residual+divided", "residual+divided+lrpt",
            "residual+divided+waited", "residual+divided+mean", "oracle")


def add_engine_flags(p: argparse.ArgumentParser, *, num_prompts: int,
                     max_new_tokens: int) -> None:
  """The flags the real-rollout benches share (this one and bench/bucket_moves.py): the model,
  the GSM8K prompts and samples, the engine's rows and launches, and what is recorded."""
  p.add_argument("--model", default=MODEL_NAME, help="model name or path (GGUF / HF directory)")
  p.add_argument("--num_prompts", type=int, default=num_prompts, help="GSM8K train prompts")
  p.add_argument("--prompt_offset", type=int, default=0, help="index of the first prompt")
  p.add_argument("--group_size", type=int, default=8, help="samples per prompt (G)")
  p.add_argument("--slots", type=int, default=8, help="engine rows (its largest bucket)")
  p.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--compile_threads", type=int, default=0,
                 help="warm-up compiles the buckets in this many threads (EngineConfig."
                      "compile_threads; 0 = its default: threads on a CPU backend only)")
  p.add_argument("--multi_step", type=int, default=1,
                 help="plain decode steps per engine launch (EngineConfig.multi_step)")
  p.add_argument("--drain_steps", default="multi", choices=DRAIN_STEPS,
                 help="launches once no request waits (EngineConfig.drain_steps)")
  p.add_argument("--seed", type=int, default=0)
  common.add_results_args(p)


def check_counts(p: argparse.ArgumentParser, args, positive: Sequence[str],
                 non_negative: Sequence[str] = ()) -> None:
  """One-line parser errors for count flags below their floor (>= 1, or >= 0)."""
  for flags, floor in ((positive, 1), (non_negative, 0)):
    for flag in flags:
      if getattr(args, flag) < floor:
        p.error(f"--{flag}={getattr(args, flag)}: must be >= {floor}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_engine_flags(p, num_prompts=8, max_new_tokens=256)
  p.add_argument("--divide_every", type=int, default=16,
                 help="residual+divided: tokens between a request's offers to yield its slot")
  p.add_argument("--park_rows", type=int, default=0,
                 help="residual+divided: parked KV rows (0: every request can park)")
  p.add_argument("--residual_quantile", type=quantile_arg, default=RESIDUAL_QUANTILE,
                 help="the quantile of remaining work the residual policies rank by, or "
                      "'mean' (ResidualPolicy; default: its default; +mean ranks by the mean "
                      "whatever this says)")
  p.add_argument("--policies", default=",".join(POLICIES), help=f"from {POLICIES}")
  p.add_argument("--repeats", type=int, default=1, help="runs of the policy list; fastest kept")
  p.add_argument("--profile", default="",
                 help="a directory: after the timed runs, one more run per policy under "
                      "cProfile, its busiest host functions written to profile_<policy>.txt "
                      "there, '+' spelled '_' (the table keeps the unprofiled runs)")
  p.add_argument("--write_trace", default="",
                 help="a .jsonl path: epoch 0's and epoch 1's response lengths per prompt in "
                      "bench/schedsim.py's trace format, so the simulator replays what this "
                      "run sampled (written after the runs)")
  p.add_argument("--write_step_times", default="",
                 help="a .json path: the engine's plain-step warm-up time per bucket at the "
                      "longest cache length, as a step-time table for bench/schedsim.py "
                      "--table (written after the warm-up)")
  args = p.parse_args(argv)
  for flag in ("write_trace", "write_step_times"):
    path = getattr(args, flag)
    if path and not os.path.isdir(os.path.dirname(path) or "."):
      p.error(f"--{flag}={path}: its directory does not exist")
  if args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
    p.error(f"--profile={args.profile}: exists and is not a directory")
  policies = args.policies.split(",")
  bad = [x for x in policies if x not in POLICIES]
  if bad:
    p.error(f"--policies: {bad[0]!r} is not one of {', '.join(POLICIES)}")
  if "fifo" not in policies and "oracle" in policies:
    p.error("--policies: oracle needs fifo (it learns the true lengths from the fifo run)")
  check_counts(p, args, ("num_prompts", "group_size", "slots", "max_new_tokens", "divide_every",
                         "repeats", "multi_step"), ("park_rows", "compile_threads"))
  args.policies = policies
  return args


def buckets_for(slots: int) -> tuple[int, ...]:
  return tuple(sorted({slots} | {2**k for k in range(slots.bit_length()) if 2**k < slots},
                      reverse=True))


def by_repeat(reps: list[dict], policies) -> dict[str, dict[str, list[float]]]:
  """Each policy's makespan / oracle and tail cut vs FIFO within each repeat (`reps`: per repeat,
  policy -> its row), for the repeats that ran the reference; the fastest-run table pairs
  runs from different repeats, and where a tail is a few launches long one late request moves
  it, so these say how much of a figure is the draw of the run."""
  out = {}
  for name in policies:
    got = out[name] = {"makespan / oracle": [], "tail cut vs fifo": [],
                       "modelled tail cut vs fifo": []}
    for rep in reps:
      r, ref, fifo = rep[name], rep.get("oracle"), rep.get("fifo")
      if ref:
        got["makespan / oracle"].append(r["makespan"] / ref["makespan"])
      if fifo and fifo["tail"] > 0:
        got["tail cut vs fifo"].append(1 - r["tail"] / fifo["tail"])
      if fifo and fifo["modelled_tail"] > 0:
        got["modelled tail cut vs fifo"].append(1 - r["modelled_tail"] / fifo["modelled_tail"])
  return out


def describe_repeats(stats: dict[str, dict[str, list[float]]]) -> list[str]:
  """One line per policy and figure over two or more repeats: each repeat's value, then their
  median (not the reference's own: the oracle's makespan / oracle, FIFO's tail cut)."""
  lines = []
  for name, figures in stats.items():
    for figure, values in figures.items():
      own = "oracle" if figure.startswith("makespan") else "fifo"
      if len(values) < 2 or name == own:
        continue
      show = (lambda v: f"{100 * v:.0f}%") if "tail" in figure else "{:.3f}".format
      lines.append(f"{name}, {figure} by repeat (same repeat's runs): "
                   f"{', '.join(map(show, values))}; median {show(float(np.median(values)))}")
  return lines


def lengths_trace(name, keys, prompt_lens, epochs, group_size) -> Trace:
  """The response lengths of `epochs` (epoch -> results, prompt-major: each prompt's
  `group_size` samples together, as `requests` makes them) as a simulator trace."""
  g = group_size
  return Trace(name, list(keys), list(prompt_lens),
               [{e: np.array([len(r.tokens) for r in out[i * g:(i + 1) * g]], np.int64)
                 for e, out in epochs.items()} for i in range(len(keys))])


def step_times(warm, buckets, kv_len) -> list[dict]:
  """The plain steps' warm-up seconds (`CostModel.warm`, keyed (bucket, packed, tokens per
  row, cache length)) at cache length `kv_len`, as a step-time table file's rows (ms)."""
  return [{"bucket": b, "budget": 0, "ms": 1e3 * warm[(b, b, 1, kv_len)]} for b in buckets]


def tokens_crc(results) -> int:
  crc = 0
  for r in sorted(results, key=lambda r: r.request_id):
    crc = zlib.crc32(np.asarray(r.tokens, np.int32).tobytes(), crc)
  return crc


def main(argv=None):
  args = parse_args(argv)
  print(f"[schedule_engine] device: {common.device_description()}", flush=True)
  model, _ = load_model(args.model)
  tok = load_tokenizer(args.model)
  _, prompt_ids = gsm8k_prompts(tok, args.num_prompts, args.prompt_offset)
  keys = [prompt_key(p) for p in prompt_ids]
  n = args.num_prompts * args.group_size
  park = args.park_rows or n
  longest = max(len(p) for p in prompt_ids)
  cfg = EngineConfig(max_len=longest + args.max_new_tokens, buckets=buckets_for(args.slots),
                     max_draft=0, speculate="never", eos_ids=tuple(tok.stop_ids),
                     seed=args.seed, divide_every=args.divide_every, park_rows=park,
                     compile_threads=args.compile_threads, multi_step=args.multi_step,
                     drain_steps=args.drain_steps)
  engine = RolloutEngine(model, cfg)
  t0 = time.perf_counter()
  engine.warmup()
  # Printed at once, so a run cut off by a time limit still shows where its time went.
  print(f"[schedule_engine] warm-up (every step shape and yield copy compiled, then timed) "
        f"in {time.perf_counter() - t0:.1f} s", flush=True)
  warm = dict(engine.costs.warm)  # warm-up time of every step shape: one cost set for all
  cost = engine.yield_cost  # passes of copies timed at warm-up (queued): fixed + per row
  long_kv = max(cfg.kv_lengths())
  if args.write_step_times:
    with open(args.write_step_times, "w") as f:
      json.dump(step_times(warm, cfg.buckets, long_kv), f, indent=1)
  params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)

  def requests(epoch):
    return [Request(epoch * n + i * args.group_size + j, p, params, group_id=i,
                    prompt_key=keys[i])
            for i, p in enumerate(prompt_ids) for j in range(args.group_size)]

  first = engine.generate(requests(0))
  table = LengthTable()
  for i, k in enumerate(keys):
    table.add(k, 0, [len(r.tokens) for r in first[i * args.group_size:(i + 1) *
                                                    args.group_size]])
  predictor = LengthPredictor(table)
  print(f"[schedule_engine] epoch 0: {n} responses, mean length "
        f"{np.mean([len(r.tokens) for r in first]):.1f}, {engine.stats.total_time_s:.1f} s",
        flush=True)
  true_lengths: dict[int, int] = {}
  best: dict[str, dict] = {}
  reps: list[dict[str, dict]] = []  # per repeat: policy -> its row
  margins: dict[str, tuple[float, float]] = {}  # divided policies: (yield cost, margin)

  def run(name):
    """(the policy, epoch 1's results) under policy `name`."""
    base = name.split("+")[0]
    if name == "oracle":
      policy = make_policy("oracle", true_lengths=true_lengths)
    else:
      policy = make_policy({"residual": "history_residual"}.get(base, base),
                           predictor=predictor if base != "fifo" else None,
                           residual_quantile=(None if name.endswith("+mean")
                                              else args.residual_quantile))
    if name.endswith("+lrpt"):  # the engine's measured yield cost is not handed on
      policy.set_yield_cost = lambda steps: None
    if name.endswith("+waited"):  # the cost of a yield waited for, in the same step units
      scale = engine.yield_seconds_waited / engine.yield_seconds
      policy.set_yield_cost = (lambda steps, set_cost=policy.set_yield_cost:
                               set_cost(steps * scale))
    engine.config = cfg if "+divided" in name else dataclasses.replace(cfg, divide_every=0)
    return policy, engine.generate(requests(1), admission=EngineOrder(policy))

  for rep in range(args.repeats):
    reps.append({})
    for name in args.policies:
      divided = "+divided" in name
      policy, results = run(name)
      st = engine.stats
      finish = np.array([r.finish_time for r in results])
      if name == "fifo":
        true_lengths.update({r.request_id: len(r.tokens) for r in results})
      if rep == 0 and name == args.policies[0]:
        second = results  # every policy samples the same tokens (the CRC column checks it)
      modelled = (sum(n * warm[shape] for shape, n in st.steps_by_shape.items()) +
                  st.yield_passes * cost.fixed + st.yields * cost.per_row)
      row = dict(makespan=float(finish.max()), tail=tail_time(finish), modelled=modelled,
                 modelled_tail=tail_time(modelled_finish(st.timeline, warm, cost, finish)),
                 util=st.slot_utilisation, yields=st.yields, passes=st.yield_passes,
                 parked=st.parked_peak,
                 steps=st.steps, launches=st.launches, crc=tokens_crc(results),
                 waits=st.host_waits,
                 host_ms=1e3 * st.host_s_per_step,
                 parts=host_parts_ms(st),
                 excess=excess_by_event(st.timeline, warm),
                 pass_ms={k: 1e3 * v for k, v in host_by_event(st.timeline).items()},
                 long_kv=sum(n for shape, n in st.steps_by_shape.items()
                             if shape[-1] == long_kv) / max(st.steps, 1))
      print(f"[schedule_engine] rep {rep} {name:>16}: makespan {row['makespan']:.1f} s, tail "
            f"{row['tail']:.1f} s, util {row['util']:.3f}, yields {row['yields']}, "
            f"crc {row['crc']:08x}", flush=True)
      if divided:
        margins[name] = (policy.yield_cost, policy.yield_margin(args.divide_every))
      reps[-1][name] = row
      if name not in best or row["makespan"] < best[name]["makespan"]:
        best[name] = row
  if args.profile:
    os.makedirs(args.profile, exist_ok=True)
    for name in args.policies:
      # "+" spelled "_": a file name of letters, digits, "_", "-" and "." travels anywhere
      path = os.path.join(args.profile, f"profile_{name.replace('+', '_')}.txt")
      with open(path, "w") as f:
        f.write(common.profiled(lambda: run(name), f"{name}: one epoch-1 rollout under cProfile"))
      print(f"[schedule_engine] host profile of {name}: {path}", flush=True)
  engine.config = cfg
  ref = best.get("oracle")
  fifo = best.get("fifo")
  rows = []
  for name in args.policies:
    r = best[name]
    rows.append([name, f"{r['makespan']:.1f}", f"{r['tail']:.1f}", f"{r['util']:.3f}", r["steps"],
                 r["launches"],
                 f"{100 * r['long_kv']:.0f}%", f"{r['modelled']:.1f}",
                 f"{r['modelled'] / ref['modelled']:.3f}" if ref else "-",
                 f"{r['makespan'] / ref['makespan']:.3f}" if ref else "-",
                 f"{r['tail'] / max(ref['tail'], 1e-9):.2f}" if ref else "-",
                 f"{100 * (1 - r['tail'] / fifo['tail']):.0f}%" if fifo and fifo["tail"] > 0
                 else "-",
                 f"{r['modelled_tail']:.2f}",
                 f"{100 * (1 - r['modelled_tail'] / fifo['modelled_tail']):.0f}%"
                 if fifo and fifo["modelled_tail"] > 0 else "-",
                 r["yields"], r["passes"], r["parked"], f"{r['host_ms']:.2f}",
                 f"{r['pass_ms']['plain']:.2f}", f"{r['pass_ms']['yields']:.2f}", r["waits"],
                 *(f"{r['excess'][k]:.2f}" for k in ("plain", "prefill", "yields")),
                 f"{r['crc']:08x}"])
  same = len({row["crc"] for rep in reps for row in rep.values()}) == 1  # every run
  table_md = common.markdown_table(
      ["policy", "makespan s", "tail s", "slot util", "decode steps", "launches", "long-kv steps",
       "modelled decode s",
       "modelled / oracle", "makespan / oracle",
       "tail / oracle", "tail cut vs fifo", "modelled tail s", "modelled tail cut vs fifo",
       "yields", "yield passes", "parked peak",
       "host ms / step", "host ms / plain pass", "host ms / yield pass", "blocking reads",
       "excess s: plain steps", "after prefill", "after yields only", "tokens CRC32"], rows)
  table_md += "\n\n" + common.markdown_table(
      ["policy", "host ms / step", *(f"{k} ms / step" for k in HOST_PARTS)],
      [[name, f"{best[name]['host_ms']:.2f}",
        *(f"{best[name]['parts'][k]:.2f}" for k in HOST_PARTS)] for name in args.policies])
  print(table_md)
  print(f"sampled tokens identical across policies and runs: {'yes' if same else 'NO'}")
  per_repeat = describe_repeats(by_repeat(reps, args.policies))
  for line in per_repeat:
    print(line)
  notes = [f"{args.num_prompts} GSM8K train prompts (from {args.prompt_offset}) x G="
           f"{args.group_size} = {n} requests, {args.slots} slots (buckets {cfg.buckets}), "
           f"T={args.temperature}, max_new_tokens {args.max_new_tokens}, plain decoding "
           f"(no speculation, {args.multi_step} step(s) per launch where token caps allow: "
           f"EngineConfig.multi_step"
           + (f"; drain_steps {args.drain_steps!r} once no request waits"
              * (args.drain_steps != "multi"))
           + f"), seed {args.seed}; epoch 0 (fifo) is the history, epoch 1 is "
           f"timed per policy with {args.repeats} run(s) each (fastest kept)"
           + ("; the table's ratio columns divide each policy's fastest run by FIFO's or the "
              "oracle's fastest, which may come from another repeat: the by-repeat lines below "
              "compare runs of one repeat" if args.repeats > 1 else ""),
           f"residual+divided: a request is offered to yield every {args.divide_every} tokens, "
           f"{park} park rows; the others run undivided",
           "makespan = rollout start to last response; tail = time to finish the last 10%; "
           "slot util = live rows / rows over decode steps",
           "host ms / step = the rollout's time outside blocking reads of step outputs (the "
           "engine loop: admission, yields, dispatch, bookkeeping) per decode step; where it "
           "nears a step's device time the host, not the device, sets the pace; host ms / plain "
           "pass and / yield pass = the same from one step's dispatch to the next's, averaged "
           "over passes that dispatched nothing else and over passes that parked or resumed "
           "requests but prefilled none (nan: none such); blocking reads = reads with no later "
           "step queued (the device idles meanwhile)",
           "second table: the host ms / step by part: the decode steps' dispatch calls, "
           "admissions (prefill chunks, resume copies, slot loading), divided rollout's yield "
           "checks and parks, reading step outputs (per-row bookkeeping), the rest (planning, "
           "packing, the loop); CPU = the Python thread's CPU time per step (time.thread_time), "
           "which blocking reads do not count: host wall time well above it means the host "
           "thread was blocked (in a dispatch, a transfer) rather than busy",
           "modelled decode s = the policy's decode steps, each at its shape's warm-up time "
           f"(one set of times for every policy, so machine noise between runs drops out), plus "
           f"the yields' KV row copies: {1e3 * cost.fixed:.3f} ms per pass that yields and "
           f"{1e3 * cost.per_row:.3f} ms per yield (the engine parks a pass's yields in one copy "
           "call and resumes them in one more; fitted from warm-up passes of 1 and "
           f"{cost.rows} yields, queued as a rollout dispatches them: {1e3 * cost.one:.3f} and "
           f"{1e3 * cost.many:.3f} ms; a pass of one waited for: "
           f"{1e3 * cost.one_waited:.3f} ms); prefill is the same for every policy (each prompt "
           "once: a resumption copies, never prefills)",
           "modelled tail s = the tail on the same clock: each response's finish is the "
           "modelled decode time up to the step it finished in (`modelled_finish`), so the "
           "tail cut vs FIFO carries no machine noise either",
           "excess s = wall time between consecutive steps' outputs beyond the step's warm-up "
           "time, summed over steps by what the engine dispatched since the step before "
           "(where the host sets the pace, a pass's host time delays the read of the step "
           "before it, so it lands in that step's bin): "
           "nothing but the step (plain steps), new requests' prefill, yields or not (after "
           "prefill; the first step too), parked or resumed requests and no prefill (after "
           "yields only): where a policy's wall time goes that the modelled decode time does "
           "not hold",
           f"long-kv steps = decode steps whose attention read the full cache ({long_kv} "
           f"positions; the XLA path's other bucket is {min(cfg.kv_lengths())}): one row past the "
           "shorter bucket puts the whole step there",
           f"sampled tokens identical across policies and runs: {'yes' if same else 'NO'}",
           *[f"{name}: yield cost {c:.3f} decode steps (the engine's warm-up: a pass of one "
             f"yield / a plain {max(cfg.buckets)}-row step), yield margin {m:.1f} tokens at the "
             "opening (it shrinks with the work left)"
             for name, (c, m) in margins.items()],
           *per_repeat,
           *(["residual policies rank by the "
              + ("mean" if args.residual_quantile is None
                 else f"{args.residual_quantile:g} quantile")
              + " of remaining work (--residual_quantile; ResidualPolicy's default is the "
              f"{RESIDUAL_QUANTILE:g} quantile)"]
             if args.residual_quantile != RESIDUAL_QUANTILE else []),
           *args.note]
  if args.write_trace:
    write_trace(lengths_trace(args.write_trace, keys, [len(p) for p in prompt_ids],
                              {0: first, 1: second}, args.group_size), args.write_trace)
    print(f"[schedule_engine] lengths of epochs 0 and 1: {args.write_trace}", flush=True)
  if not args.no_append:
    common.append_results("Rollout engine: admission orders and divided rollout "
                          "(bench/schedule_engine.py)", table_md, notes)
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
