"""Replays recorded SmolLM2 GSM8K rollouts through `HistoryDrafter`: acceptance with no model.

With position-keyed sampling a speculative rollout emits the recorded plain tokens, so each
verify step's accepted length is 1 + the longest drafted tree path matching the recorded
continuation (`rhyme_jax.history.replay`). Per setting (a target epoch and the history it
drafts from) and drafter mode (history only, siblings only, both), `--live_rows` requests run
together as in the engine's continuous batching; reported: mean accepted length per verify
(bonus included), drafted nodes per step, hit rate (accepted / drafted), share of steps without
a draft, host microseconds per query in `propose` (all queries of a step drafted in one call)
and in `observe`.

Settings (files from bench/record.py under --dir, prompt ranges merged):
  T=0.6:   target gsm8k_T0.6_e1, history gsm8k_T0.6_e0 (previous epoch, fresh seed)
  T=1.0:   target gsm8k_T1_e1,   history gsm8k_T1_e0
  greedy:  target gsm8k_T0_e0 (one response per prompt), history gsm8k_T0.6_e1 (e0 if absent)

  python bench/replay.py --dir /work/recordings --budget 16 --live_rows 64

A real GRPO run's epochs (`--record_rollouts`: the policy changes between them) replay with
`--grpo_dir RUN_DIR/rollouts`: data epoch e as the target, the epochs before it as history
(kept as the trainer keeps them), e.g. the quickstart task with its engine's 16 live rows:

  python bench/replay.py --grpo_dir runs/grpo_rec/rollouts --settings= --live_rows 16
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.history import fast_draft  # noqa: E402
from rhyme_jax.history.drafter import HistoryDrafter  # noqa: E402
from rhyme_jax.history.recording import Recording, merge, split_groups  # noqa: E402
from rhyme_jax.history.replay import replay_epochs  # noqa: E402
from rhyme_jax.history.store import HistoryStore  # noqa: E402

MODES = ("history", "siblings", "both")
SETTINGS = {  # name: (target (T, epoch), history [(T, epoch)])
    "T=0.6": ((0.6, 1), [(0.6, 0)]),
    "T=1.0": ((1.0, 1), [(1.0, 0)]),
    "greedy": ((0.0, 0), [(0.6, 1)]),
}


def load(directory: str, temp: float, epoch: int) -> Recording | None:
  paths = sorted(glob.glob(os.path.join(directory, f"gsm8k_T{temp:g}_e{epoch}_*.npz")),
                 key=lambda p: int(p.rsplit("_p", 1)[1].split("-")[0]))
  return merge([Recording.load(p) for p in paths]) if paths else None


def load_grpo(directory: str) -> dict[int, Recording]:
  """A run's `--record_rollouts` files merged per data epoch (rounds in step order)."""
  paths = glob.glob(os.path.join(directory, "e*_s*_r*_p*.npz"))
  by_epoch: dict[int, list] = {}
  for path in sorted(paths, key=lambda p: os.path.basename(p).split("_", 1)[1]):
    rec = Recording.load(path)
    by_epoch.setdefault(int(rec.meta["epoch"]), []).append(rec)
  return {e: merge(recs) for e, recs in sorted(by_epoch.items())}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", default="/work/recordings", help="recordings from bench/record.py")
  p.add_argument("--settings", default=",".join(SETTINGS), help=f"from {tuple(SETTINGS)}")
  p.add_argument("--grpo_dir", default="",
                 help="also replay a GRPO run's epochs (its RUN_DIR/rollouts from --record_rollouts)")
  p.add_argument("--modes", default=",".join(MODES), help=f"from {MODES}")
  p.add_argument("--budget", type=int, default=16, help="draft nodes per request per step")
  p.add_argument("--live_rows", type=int, default=64, help="requests drafted together")
  p.add_argument("--min_prob", type=float, default=0.02)
  p.add_argument("--max_match", type=int, default=8)
  p.add_argument("--reference", action="store_true",
                 help="also replay the readable Python reference drafter (mode 'both'): same "
                      "statistics required, its time reported")
  p.add_argument("--threads", action="store_true",
                 help="also replay mode 'both' with the kernel split across numba's threads "
                      "(HistoryDrafter(parallel=True); same trees)")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed replays per row after a warm-up one; the median us/query is reported")
  p.add_argument("--epochs_kept", type=int, default=1,
                 help="past epochs the store keeps per prompt (the trainer's --history_epochs)")
  common.add_results_args(p)
  args = p.parse_args(argv)
  args.settings = [s for s in args.settings.split(",") if s]
  args.modes = [m for m in args.modes.split(",") if m]
  for flag, got, known in (("settings", args.settings, SETTINGS), ("modes", args.modes, MODES)):
    bad = [x for x in got if x not in known]
    if bad or (not got and (flag == "modes" or not args.grpo_dir)):
      p.error(f"--{flag}: unknown {bad or 'empty list'}; choose from {tuple(known)}")
  if min(args.budget, args.live_rows, args.repeats, args.epochs_kept) < 1:
    p.error("--budget, --live_rows, --repeats and --epochs_kept must be >= 1")
  return args


def recorded_cases(args, notes: list) -> list:
  """(name, target, history) of each --settings entry whose recordings exist under --dir."""
  cases = []
  for name in args.settings:
    (tt, te), hist = SETTINGS[name]
    target = load(args.dir, tt, te)
    history = [load(args.dir, t, e) for t, e in hist]
    if name == "greedy" and history[0] is None and load(args.dir, 0.6, 0) is not None:
      history = [load(args.dir, 0.6, 0)]  # the other T=0.6 epoch
      name = "greedy (history T=0.6 e0)"
    if target is None and len(hist) == 1 and hist[0][0] == tt and history[0] is not None:
      # Only the history epoch is recorded: its groups split in halves stand in for two
      # epochs (same weights, independent draws), G/2 responses each.
      history[0], target = split_groups(history[0])
      name = f"{name} (e{hist[0][1]} split G/2)"
      notes.append(f"{name}: epoch {te} not recorded in time; each group of epoch {hist[0][1]} "
                   "split in two halves (history / target, same weights, independent draws)")
    if target is None or any(h is None for h in history):
      print(f"[replay] {name}: recordings missing under {args.dir}, skipped", flush=True)
      continue
    cases.append((name, target, history))
  return cases


def grpo_cases(args, notes: list) -> list:
  """(name, target, history) per data epoch >= 1 of the --grpo_dir run."""
  epochs = load_grpo(args.grpo_dir)
  if len(epochs) < 2:
    raise SystemExit(f"--grpo_dir={args.grpo_dir}: fewer than two data epochs recorded")
  first = next(iter(epochs.values())).meta
  notes.append(f"GRPO run: {args.grpo_dir} ({first.get('task')}, {first.get('model')}, T="
               f"{first.get('temperature')}, G={first.get('group_size')}, max "
               f"{first.get('max_new_tokens')} new tokens); target = data epoch e, history = "
               f"the epochs before it as the trainer keeps them (the last {args.epochs_kept} "
               "per prompt: --epochs_kept, the trainer's --history_epochs)")
  return [(f"GRPO e{e}", rec, [epochs[k] for k in epochs if k < e])
          for e, rec in epochs.items() if e > min(epochs)]


def main(argv=None):
  args = parse_args(argv)
  if args.settings and not os.path.isdir(args.dir):
    raise SystemExit(f"--dir={args.dir}: no such directory")
  rows, notes = [], []
  cases = recorded_cases(args, notes) + (grpo_cases(args, notes) if args.grpo_dir else [])
  for name, target, history in cases:
    size = (f"{len(target.prompts)} prompts x G={target.meta.get('group_size')}, "
            f"{target.num_tokens} tokens")
    extra = ((["both (threads)"] if args.threads else [])
             + (["both (Python reference)"] if args.reference else []))
    for mode in args.modes + extra:
      make = lambda: HistoryDrafter(
          HistoryStore(args.epochs_kept), use_history=mode != "siblings",
          use_siblings=mode != "history", max_budget=args.budget, min_prob=args.min_prob,
          max_match=args.max_match, compiled="reference" not in mode, parallel="threads" in mode)
      if "reference" not in mode:  # compile / warm up first
        replay_epochs(make, history, target, budget=args.budget, live_rows=args.live_rows)
      t0 = time.perf_counter()
      runs = [replay_epochs(make, history, target, budget=args.budget, live_rows=args.live_rows)
              for _ in range(1 if "reference" in mode else args.repeats)]
      r = runs[0].row()  # the same trees every run: only the times differ
      for k in ("us_per_query", "cpu_us_per_query", "observe_us"):
        r[k] = float(np.median([run.row()[k] for run in runs]))
      rows.append([name, size, mode, f"{r['accepted_length']:.2f}",
                   f"{r['drafted_per_step']:.1f}", f"{r['hit_rate']:.2f}",
                   f"{r['no_draft_frac']:.2f}", f"{r['us_per_query']:.1f}",
                   f"{r['cpu_us_per_query']:.1f}",
                   f"{r['observe_us']:.1f}", r["steps"]])
      print(f"[replay] {name} {mode}: accepted length {r['accepted_length']:.2f}, drafted/step "
            f"{r['drafted_per_step']:.1f}, hit {r['hit_rate']:.2f}, no draft "
            f"{r['no_draft_frac']:.2f}, {r['us_per_query']:.1f} us/query propose "
            f"({r['cpu_us_per_query']:.1f} CPU), "
            f"{r['observe_us']:.1f} us observe ({time.perf_counter() - t0:.1f}s)", flush=True)
  if not rows:
    raise SystemExit(f"[replay] no complete setting under {args.dir}")
  headers = ["setting", "target", "drafts", "accepted len/verify", "drafted/step", "hit rate",
             "no-draft steps", "propose us/query (wall)", "propose us/query (CPU)",
             "observe us/query", "verify steps"]
  table = common.markdown_table(headers, rows)
  print(table)
  if not args.no_append:
    common.append_results(
        f"Drafter replay on recorded SmolLM2 rollouts (budget {args.budget}, "
        f"{args.live_rows} live rows)", table,
        [f"HistoryDrafter (compiled: numba={fast_draft.HAVE_NUMBA}), min_prob {args.min_prob}, "
         f"max_match {args.max_match}; settings T=*/greedy: GSM8K, history = previous epoch "
         "(fresh seed, same weights)",
         "us/query = host time of propose per request per step, all live rows in one call, "
         f"median of {args.repeats} replays after a warm-up one (compiled), wall and this "
         "thread's CPU (the threaded kernel's other threads not counted); numba threads: "
         f"{fast_draft.num_threads()}"]
        + notes + args.note)


if __name__ == "__main__":
  main()
