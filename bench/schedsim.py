"""Rollout scheduling simulator: admission orders and shard plans on recorded length traces.

Replays one GRPO step's requests (the last epoch of a trace) through `scheduling.simulate` (the
engine's slots, shrinking buckets, measured step times, optional speculation and divided
rollout) under each admission policy; history-based policies predict from the trace's earlier
epochs only. Reports makespan, tail time (last 10% of requests), slot utilisation, ratios to the
oracle order (true lengths, longest first) and the tail cut vs FIFO; prints the table and
appends it to bench/RESULTS.md.

Traces (`--trace`, repeatable):
  synthetic[:SEED]   a generated trace (log-normal prompt difficulty, per-sample noise, epoch
                     drift; 32 prompts x 8 samples x 2 epochs by default), clearly labelled;
  PATH.jsonl         one JSON object per line: {"prompt_key", "epoch", "lengths": [...],
                     optional "prompt_len"} (the format `--write_trace` emits), or per-sample
                     lines (see `load_trace`);
  GLOB.npz           recorded rollouts (the drafts helper's `history.recording` format: one
                     file per epoch and prompt range; `lengths`, `prompt_index`,
                     `prompt_keys`, `prompt_lengths`, `meta_json` with the epoch), all files
                     the glob matches forming one trace.

  python bench/schedsim.py --trace synthetic:0 --trace '/work/recordings/gsm8k_T0.6_e*.npz'
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from rhyme_jax.scheduling.admission import RequestMeta, StaticPolicy, make_policy  # noqa: E402
from rhyme_jax.scheduling.assignment import group_work, lpt_assign, plan_shards  # noqa: E402
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable  # noqa: E402
from rhyme_jax.scheduling.simulate import (DividedRollout, SimConfig,  # noqa: E402
                                           simulate)
from rhyme_jax.scheduling.step_time import PREFILL_MS_PER_TOKEN, StepTimeTable  # noqa: E402

POLICIES = ("fifo", "random", "history", "history_alt", "probe", "history_probe",
            "oracle_group", "oracle")


@dataclasses.dataclass
class Trace:
  """Per-prompt response lengths by epoch, prompts in data order."""

  name: str
  keys: list
  prompt_len: list[int]
  lengths: list[dict[int, np.ndarray]]  # per prompt: {epoch: int64[G]}

  @property
  def epochs(self) -> list[int]:
    return sorted({e for per in self.lengths for e in per})

  def rank_correlation(self, a: int, b: int) -> float:
    """Spearman correlation of per-prompt mean length between epochs a and b."""
    both = [(p[a].mean(), p[b].mean()) for p in self.lengths if a in p and b in p]
    x, y = np.array(both).T
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def synthetic_trace(seed: int = 0, num_prompts: int = 32, group_size: int = 8, epochs: int = 2,
                    max_new_tokens: int = 512) -> Trace:
  """Lengths = difficulty (log-normal per prompt, drifting a little per epoch) x per-sample
  noise, capped at max_new_tokens; tuned to a between-epoch Spearman of about 0.8."""
  rng = np.random.default_rng(seed)
  difficulty = rng.lognormal(np.log(150), 0.55, num_prompts)
  lengths = [dict() for _ in range(num_prompts)]
  for e in range(epochs):
    drift = difficulty * rng.lognormal(0.0, 0.1, num_prompts)
    sample = drift[:, None] * rng.lognormal(0.0, 0.45, (num_prompts, group_size))
    for i in range(num_prompts):
      lengths[i][e] = np.clip(np.rint(sample[i]), 8, max_new_tokens).astype(np.int64)
  return Trace(f"synthetic:{seed}", [f"synthetic-{i}" for i in range(num_prompts)],
               [int(n) for n in rng.integers(90, 200, num_prompts)], lengths)


def load_trace(path: str) -> Trace:
  """A JSONL trace: per-group lines {prompt_key, epoch, lengths} or per-sample lines with
  {prompt_key, epoch, length} (or a "tokens"/"response" list whose length is taken)."""
  per: dict = collections.OrderedDict()
  prompt_len: dict = {}
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        key, epoch = row["prompt_key"], int(row["epoch"])
        if "lengths" in row:
          lens = [int(n) for n in row["lengths"]]
        elif "length" in row:
          lens = [int(row["length"])]
        else:
          lens = [len(row.get("tokens", row.get("response")))]
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{lineno}: not a length-trace line ({e!r})") from e
      if isinstance(key, list):
        key = tuple(key)
      per.setdefault(key, collections.defaultdict(list))[epoch].extend(lens)
      if "prompt_len" in row:
        prompt_len[key] = int(row["prompt_len"])
      elif "prompt" in row and isinstance(row["prompt"], list):
        prompt_len[key] = len(row["prompt"])
  if not per:
    raise ValueError(f"{path}: no trace lines")
  keys = list(per)
  return Trace(os.path.basename(path), keys, [prompt_len.get(k, 128) for k in keys],
               [{e: np.asarray(v, np.int64) for e, v in per[k].items()} for k in keys])


def load_npz_trace(pattern: str) -> Trace:
  """Recorded rollouts (`.npz`, see the module docstring) matching `pattern`, as one trace."""
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise ValueError(f"--trace {pattern}: no files match")
  per: dict = collections.OrderedDict()
  prompt_len: dict = {}
  for path in paths:
    try:
      with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta_json"]))
        keys = [str(k) for k in z["prompt_keys"]]
        plens = z["prompt_lengths"].astype(np.int64)
        for i, n in zip(z["prompt_index"].astype(np.int64), z["lengths"].astype(np.int64)):
          per.setdefault(keys[i], collections.defaultdict(list))[int(meta["epoch"])].append(
              int(n))
          prompt_len[keys[i]] = int(plens[i])
    except (KeyError, ValueError, OSError) as e:
      raise ValueError(f"{path}: not a recorded rollout ({e!r})") from e
  keys = list(per)
  name = os.path.basename(pattern) + f" ({len(paths)} files)"
  return Trace(name, keys, [prompt_len[k] for k in keys],
               [{e: np.asarray(v, np.int64) for e, v in per[k].items()} for k in keys])


def split_groups(trace: Trace) -> Trace:
  """A one-epoch trace as two: each prompt's first half of samples becomes the history
  (epoch 0), the second half the step (epoch 1); both halves come from the same policy, as
  consecutive epochs do when no training step runs between them."""
  (epoch,) = trace.epochs
  halves = []
  for per in trace.lengths:
    n = len(per[epoch]) // 2
    halves.append({0: per[epoch][:n], 1: per[epoch][n:]})
  return Trace(trace.name + " split in halves", trace.keys, trace.prompt_len, halves)


def write_trace(trace: Trace, path: str) -> None:
  with open(path, "w") as f:
    for key, plen, per in zip(trace.keys, trace.prompt_len, trace.lengths):
      for e in sorted(per):
        f.write(json.dumps({"prompt_key": key, "epoch": e, "lengths": per[e].tolist(),
                            "prompt_len": plen}) + "\n")


def step_jobs(trace: Trace, epoch: int, max_new_tokens: int):
  """The step's requests (prompts in data order, G samples each) with their true lengths."""
  jobs = []
  for i, (key, plen, per) in enumerate(zip(trace.keys, trace.prompt_len, trace.lengths)):
    for n in per.get(epoch, ()):
      rid = len(jobs)
      jobs.append((RequestMeta(rid, i, key, rid, max_new_tokens, plen), max(int(n), 1)))
  return jobs


def history_predictor(trace: Trace, epoch: int, epochs_kept: int, stat: str) -> LengthPredictor:
  table = LengthTable(epochs_kept)
  for key, per in zip(trace.keys, trace.lengths):
    for e in sorted(per):
      if e < epoch:
        table.add(key, e, per[e])
  return LengthPredictor(table, stat)


def shard_plan(kind: str, jobs, predictor, shards: int):
  groups = sorted({m.group_id for m, _ in jobs})
  if kind == "data_order":
    return {g: i % shards for i, g in enumerate(groups)}
  if kind == "lpt_history":
    return plan_shards([m for m, _ in jobs], predictor, shards)
  if kind == "lpt_oracle":
    true = collections.Counter()
    for m, n in jobs:
      true[m.group_id] += n
    shard = lpt_assign(np.array([true[g] for g in groups], np.int64), shards)
    return dict(zip(groups, shard.tolist()))
  raise ValueError(f"--plans: unknown plan {kind!r}")


@dataclasses.dataclass(frozen=True)
class Scenario:
  table: str
  slots: int
  shards: int = 1
  shrink: bool = True
  accepted: float = 1.0  # mean accepted length at `budget` (1.0: no speculation)
  budget: int = 16
  plan: str = "-"
  chunk: int = 0

  def label(self) -> str:
    spec = f"a={self.accepted:g}@T{self.budget}" if self.accepted > 1 else "off"
    return (f"{self.table} | {self.shards}x{self.slots} | {'yes' if self.shrink else 'no'} | "
            f"{spec} | {self.plan} | {self.chunk or '-'}")


def scenarios(args) -> list[Scenario]:
  out = [Scenario("h100", 64), Scenario("h100", 64, shrink=False),
         Scenario("h100", 64, accepted=args.accepted, budget=args.budget),
         Scenario("cpu", 32), Scenario("cpu", 32, shrink=False)]
  for plan in args.plans.split(","):
    out.append(Scenario("h100", 16, shards=4, plan=plan))
  out.append(Scenario("h100", 16, shards=4, plan="lpt_history", chunk=args.chunk))
  out.append(Scenario("cpu", 8, shards=4, plan="lpt_history"))
  out.append(Scenario("cpu", 8, shards=4, plan="lpt_history", chunk=args.chunk))
  return out


class _TwoSteps:
  """Step A's requests in policy_a's order, then step B's in policy_b's: B's requests take the
  slots A's tail frees (rollout of the next step overlapping this one's tail)."""

  online = False

  def __init__(self, policy_a, policy_b, step_b_groups):
    self.a, self.b, self.step_b = policy_a, policy_b, step_b_groups

  def order(self, queue):
    return (self.a.order([m for m in queue if m.group_id not in self.step_b])
            + self.b.order([m for m in queue if m.group_id in self.step_b]))

  def next_to_admit(self, queue, finished, live):
    return 0


def overlap_rows(trace, jobs, predictor, truth, args) -> list[list]:
  """Cross-step alternation: the step's prompts split into two consecutive steps A (even) and
  B (odd); total time with a barrier between them vs with B admitted into A's tail."""
  groups = sorted({m.group_id for m, _ in jobs})
  step_b = set(groups[len(groups) // 2:])
  rows = []
  for table_name, slots in (("h100", 64), ("cpu", 32)):
    table = StepTimeTable.builtin(table_name)
    cfg = SimConfig(slots=slots, buckets=tuple(b for b in (64, 32, 16, 8, 4, 2, 1) if b <= slots),
                    prefill_ms_per_token=PREFILL_MS_PER_TOKEN[table_name])
    pick = lambda name, step: make_policy(name, predictor=predictor, step=step,
                                          true_lengths=truth)
    for label, (pa, pb) in {"fifo": ("fifo", "fifo"), "history": ("history", "history"),
                            "history_alt": ("history_alt", "history_alt"),
                            "oracle": ("oracle", "oracle")}.items():
      a_jobs = [(m, n) for m, n in jobs if m.group_id not in step_b]
      b_jobs = [(m, n) for m, n in jobs if m.group_id in step_b]
      barrier = (simulate(a_jobs, lambda: pick(pa, 0), table, cfg).makespan_ms
                 + simulate(b_jobs, lambda: pick(pb, 1), table, cfg).makespan_ms)
      both = simulate(jobs, lambda: _TwoSteps(pick(pa, 0), pick(pb, 1), step_b), table, cfg)
      rows.append([trace.name, f"{table_name} 1x{slots}", label, f"{barrier / 1e3:.2f}",
                   f"{both.makespan_ms / 1e3:.2f}", f"{both.makespan_ms / barrier:.3f}"])
  return rows


def blind_draws(jobs, group_score, table, cfg, draws: int, seed: int) -> np.ndarray:
  """What an order that cannot tell one prompt's samples apart can reach on this trace.

  A prompt's G samples are exchangeable before they run, so any per-prompt order (history,
  probe-free) sees the same trace with each group's true lengths shuffled among its samples.
  Per draw: (makespan / oracle, tail cut vs FIFO, decode steps of the per-prompt order),
  for the order `group_score` (higher first; the step's true group means = the best per-prompt
  knowledge). float64[draws, 3].
  """
  rng = np.random.default_rng(seed)
  by_group = collections.defaultdict(list)
  for i, (m, _) in enumerate(jobs):
    by_group[m.group_id].append(i)
  out = np.zeros((draws, 3))
  for d in range(draws):
    lengths = [n for _, n in jobs]
    for idx in by_group.values():
      for i, n in zip(idx, rng.permutation([lengths[i] for i in idx])):
        lengths[i] = int(n)
    shuffled = [(m, n) for (m, _), n in zip(jobs, lengths)]
    truth = {m.request_id: n for m, n in shuffled}
    oracle = simulate(shuffled, lambda: make_policy("oracle", true_lengths=truth), table, cfg)
    fifo = simulate(shuffled, lambda: make_policy("fifo"), table, cfg)
    grp = simulate(shuffled, lambda: StaticPolicy("group", lambda m: group_score[m.group_id]),
                   table, cfg)
    out[d] = (grp.makespan_ms / oracle.makespan_ms,
              1 - grp.tail_ms / fifo.tail_ms if fifo.tail_ms > 0 else 0.0, grp.steps)
  return out


def run(args) -> tuple[list[list], list[list], list[list], list[str]]:
  """(detail rows, summary rows, cross-step rows, notes) for every trace."""
  traces = []
  for spec in args.trace:
    if spec.startswith("synthetic"):
      seed = int(spec.split(":")[1]) if ":" in spec else 0
      traces.append(synthetic_trace(seed, max_new_tokens=args.max_new_tokens))
    elif spec.endswith(".npz"):
      traces.append(load_npz_trace(spec))
    else:
      traces.append(load_trace(spec))
  detail, summary, overlap, notes = [], [], [], []
  args.blind_rows = []
  for trace in traces:
    if len(trace.epochs) == 1 and args.split_groups:
      trace = split_groups(trace)
    epochs = trace.epochs
    if len(epochs) < 2:
      raise ValueError(f"--trace {trace.name}: needs >= 2 epochs (history, then the step), "
                       f"or --split_groups")
    target = epochs[-1]
    jobs = step_jobs(trace, target, args.max_new_tokens)
    lengths = np.array([n for _, n in jobs])
    notes.append(f"trace {trace.name}: {len(trace.keys)} prompts, {len(jobs)} requests in "
                 f"epoch {target} (predicted from epochs {epochs[:-1]}), length mean "
                 f"{lengths.mean():.0f} / max {lengths.max()}, Spearman of prompt mean length "
                 f"between epochs {epochs[-2]} and {target}: "
                 f"{trace.rank_correlation(epochs[-2], target):.2f}")
    predictor = history_predictor(trace, target, args.epochs_kept, args.stat)
    truth = {m.request_id: n for m, n in jobs}
    group_mean = collections.defaultdict(list)
    for m, n in jobs:
      group_mean[m.group_id].append(n)
    group_mean = {g: float(np.mean(v)) for g, v in group_mean.items()}
    overlap += overlap_rows(trace, jobs, predictor, truth, args)
    for sc in scenarios(args):
      table = StepTimeTable.builtin(sc.table)
      cfg = SimConfig(slots=sc.slots, buckets=tuple(b for b in (64, 32, 16, 8, 4, 2, 1)
                                                    if b <= sc.slots),
                      shrink=sc.shrink, shards=sc.shards,
                      accepted=((sc.budget, sc.accepted),) if sc.accepted > 1 else (),
                      prefill_ms_per_token=PREFILL_MS_PER_TOKEN[sc.table],
                      divided=DividedRollout(sc.chunk))
      plan = shard_plan(sc.plan, jobs, predictor, sc.shards) if sc.shards > 1 else None
      results = {}
      for name in POLICIES:
        def factory(name=name):
          if name == "oracle_group":  # the best any per-prompt predictor could do
            return StaticPolicy(name, lambda m: group_mean[m.group_id])
          # history_alt is shown on an odd step: short-to-long, HistoPipe's other half.
          return make_policy(name, predictor=predictor, step=1, seed=args.seed,
                             true_lengths=truth)
        res = simulate(jobs, factory, table, cfg, plan)
        assert abs(res.tokens - lengths.sum()) < 1e-6, "simulator lost or invented tokens"
        results[name] = res
      oracle, fifo = results["oracle"], results["fifo"]
      cut = lambda r: (f"{100 * (1 - r.tail_ms / fifo.tail_ms):.0f}%" if fifo.tail_ms > 0
                       else "-")
      summary.append([trace.name, *sc.label().split(" | ")]
                     + [f"{results['history'].makespan_ms / 1e3:.2f}"]
                     + [f"{results[p].makespan_ms / oracle.makespan_ms:.3f}" for p in POLICIES[:-1]]
                     + [cut(results["history"]), cut(results["probe"]), cut(oracle)])
      if sc.shards == 1 and sc.shrink and sc.accepted == 1:  # the main scenarios in full
        for name, res in results.items():
          detail.append([trace.name, sc.label().split(" | ")[0], sc.label().split(" | ")[1],
                         name, f"{res.makespan_ms / 1e3:.2f}", f"{res.tail_ms / 1e3:.2f}",
                         f"{res.utilisation:.3f}", f"{res.makespan_ms / oracle.makespan_ms:.3f}",
                         (f"{res.tail_ms / oracle.tail_ms:.2f}" if oracle.tail_ms > 0 else "-"),
                         cut(res)])
        h = results["history"]
        if args.blind_draws:
          b = blind_draws(jobs, group_mean, table, cfg, args.blind_draws, args.seed)
          args.blind_rows.append([
              trace.name, sc.table, f"1x{sc.slots}", lengths.max(),
              int(np.ceil(lengths.sum() / sc.slots)), oracle.steps, results["history"].steps,
              f"{b[:, 2].mean():.0f} ({b[:, 2].min():.0f}-{b[:, 2].max():.0f})",
              f"{b[:, 0].mean():.3f}", f"{b[:, 0].min():.3f}", f"{100 * b[:, 1].mean():.0f}%",
              f"{100 * b[:, 1].max():.0f}%"])
        notes.append(f"targets, {trace.name} [{sc.table} 1x{sc.slots}]: history makespan / "
                     f"oracle {h.makespan_ms / oracle.makespan_ms:.3f} (target <= 1.02; "
                     f"/ oracle_group {h.makespan_ms / results['oracle_group'].makespan_ms:.3f}),"
                     f" tail cut vs FIFO {cut(h)} (target >= 75%)")
  return detail, summary, overlap, notes


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--trace", action="append", default=None,
                  help="synthetic[:SEED] or a JSONL trace file (repeatable)")
  ap.add_argument("--max_new_tokens", type=int, default=512)
  ap.add_argument("--stat", default="mean", help="group statistic the predictor ranks")
  ap.add_argument("--epochs_kept", type=int, default=1)
  ap.add_argument("--accepted", type=float, default=1.7,
                  help="mean accepted length at --budget for the speculation scenario")
  ap.add_argument("--budget", type=int, default=16)
  ap.add_argument("--plans", default="data_order,lpt_history,lpt_oracle")
  ap.add_argument("--chunk", type=int, default=64, help="divided-rollout chunk (tokens)")
  ap.add_argument("--seed", type=int, default=0, help="seed of the random order")
  ap.add_argument("--blind_draws", type=int, default=200,
                  help="draws of the per-prompt bound (lengths shuffled within groups); 0 = off")
  ap.add_argument("--split_groups", action="store_true",
                  help="a one-epoch trace: first half of each group = history, second = step")
  ap.add_argument("--write_trace", default=None, help="write the first trace as JSONL and exit")
  ap.add_argument("--note", action="append", default=[])
  ap.add_argument("--no_append", action="store_true")
  args = ap.parse_args(argv)
  args.trace = args.trace or ["synthetic"]
  if args.write_trace:
    write_trace(synthetic_trace(max_new_tokens=args.max_new_tokens), args.write_trace)
    return
  detail, summary, overlap, notes = run(args)
  table = common.markdown_table(
      ["trace", "table", "shards x slots", "policy", "makespan s", "tail s", "slot util",
       "makespan / oracle", "tail / oracle", "tail cut vs fifo"], detail)
  table += ("\n\nEvery scenario: the history order's makespan (compare plans by it), makespan / "
            "oracle per policy (same trace, plan and step times in a row), tail cut vs FIFO\n\n")
  table += common.markdown_table(
      ["trace", "table", "shards x slots", "shrink", "spec", "plan", "chunk", "history s"]
      + [p for p in POLICIES[:-1]] + ["tail cut: history", "probe", "oracle"], summary)
  if args.blind_rows:
    table += (f"\n\nWhat any per-prompt order can reach: the step's true per-prompt mean "
              f"lengths, longest first, over {args.blind_draws} draws of each prompt's lengths "
              "shuffled among its samples (samples of one prompt are indistinguishable before "
              "they run); decode steps of the makespan\n\n")
    table += common.markdown_table(
        ["trace", "table", "shards x slots", "longest response", "tokens / slots",
         "oracle steps", "history steps", "per-prompt steps: mean (range)",
         "per-prompt makespan / oracle: mean", "best draw", "tail cut vs fifo: mean",
         "best draw"],
        args.blind_rows)
  table += ("\n\nCross-step alternation: the step's prompts as two consecutive steps A, B "
            "(first and second half); history_alt = A long-first, B short-first\n\n")
  table += common.markdown_table(
      ["trace", "table", "policy", "A then B, barrier s", "B into A's tail s", "ratio"], overlap)
  print(table)
  for n in notes:
    print("-", n)
  if not args.no_append:
    notes = [
        "simulated, not run: bench/schedsim.py replays recorded/synthetic response lengths "
        "through rhyme_jax/scheduling/simulate.py; step times from the built-in tables of "
        "rhyme_jax/scheduling/step_time.py (h100: bench/engine_overhead.py H100 engine ms/step; "
        "cpu: bench/forward.py 2-core CPU decode ms/step), made non-decreasing in bucket and "
        "budget; prefill per prompt token from the same sources' forward.py runs",
        "tail = time to finish the last 10% of requests; slot util = live row-time / "
        "(shards x slots x makespan); oracle = true lengths, longest first; history = the "
        f"previous epoch's group {args.stat} (rank-mapped), longest first; history_alt = the "
        "odd-step half of the cross-step alternation (short first); probe = Seer probe-first "
        "(no history); history_probe = probes ordered by history, then max sibling so far; "
        "oracle_group = the step's true per-prompt mean length, longest first (the best any "
        "per-prompt predictor can do: samples of one prompt are indistinguishable before they "
        "run)",
        "the device line names the machine that ran the simulation, not the one the step "
        "times were measured on; simulated times are deterministic (no wall clock), so the "
        "shared CPU does not affect them",
        "the h100 table is flat at budget 0 once made non-decreasing (3.63 ms at 1..64 rows: the "
        "135M model's step is launch-bound), so bucket shrinking changes nothing there (shrink "
        "yes/no rows equal); the cpu table grows with rows, where shrinking matters",
    ] + notes + args.note
    common.append_results("Rollout scheduling simulator (bench/schedsim.py)", table, notes)


if __name__ == "__main__":
  main()
