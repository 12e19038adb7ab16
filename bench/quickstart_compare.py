"""Compares two training runs of the same config, with and without speculation.

Reads `metrics.jsonl` of both runs and reports, per step, reward / accuracy / rollout time, and
whether the two runs trained on the same samples (same seed: identical sampled tokens give
bit-identical losses and gradient norms, so any divergence shows up there); then the rollout
time ratio, mean accepted length per data epoch, and the evaluations. Appends to RESULTS.md.

  python bench/quickstart_compare.py runs/quickstart runs/quickstart_nospec
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from rhyme_jax.metrics import read_metrics  # noqa: E402

# What the sampled tokens determine. Runs from before the token fingerprint existed are compared
# on rewards and lengths only. Losses are not compared: the importance weight uses the engine's
# log-probs, which differ in the last bits between verify- and decode-shaped steps.
SAME_KEYS = ("rollout/tokens_crc32", "reward/mean", "reward/std", "response_length/mean",
             "response_length/max", "accuracy")


def load(run_dir):
  return {int(r["step"]): r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))}


def fmt(x, nd=3):
  return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("spec_run")
  p.add_argument("plain_run", nargs="?", help="omit to report the curves of one run")
  p.add_argument("--no_record", action="store_true")
  args = p.parse_args(argv)
  if args.plain_run is None:
    return report_one(args)
  spec, plain = load(args.spec_run), load(args.plain_run)
  steps = sorted(set(spec) & set(plain))
  rows, first_diff = [], None
  for s in steps:
    a, b = spec[s], plain[s]
    same = all(a.get(k) == b.get(k) for k in SAME_KEYS)
    if not same and first_diff is None:
      first_diff = s
    rows.append([s, a.get("data/epoch", "-"), fmt(a.get("reward/mean")), fmt(b.get("reward/mean")),
                 fmt(a.get("eval/accuracy")), fmt(b.get("eval/accuracy")),
                 fmt(a.get("time/rollout"), 1), fmt(b.get("time/rollout"), 1),
                 fmt(a.get("time/train"), 1), fmt(a.get("rollout/mean_accepted_length"), 2),
                 "yes" if same else "NO",
                 f"{abs(a.get('train/loss', 0.0) - b.get('train/loss', 0.0)):.1e}"])
  headers = ["step", "epoch", "reward spec", "reward plain", "eval acc spec", "eval acc plain",
             "rollout s spec", "rollout s plain", "train s", "accepted len", "same samples", "|loss diff|"]
  table = common.markdown_table(headers, rows)

  by_epoch = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
  for s in steps:
    e = spec[s].get("data/epoch", 0)
    by_epoch[e][0] += spec[s]["time/rollout"]
    by_epoch[e][1] += plain[s]["time/rollout"]
    by_epoch[e][2] += spec[s]["rollout/mean_accepted_length"]
    by_epoch[e][3] += 1
  epoch_rows = [[e, fmt(v[2] / v[3], 3), fmt(v[0], 1), fmt(v[1], 1), fmt(v[0] / v[1], 2)]
                for e, v in sorted(by_epoch.items())]
  epoch_table = common.markdown_table(
      ["epoch", "mean accepted len", "rollout s spec", "rollout s plain", "ratio spec/plain"],
      epoch_rows)
  t_spec = sum(spec[s]["time/rollout"] for s in steps)
  t_plain = sum(plain[s]["time/rollout"] for s in steps)
  first = [spec[s]["reward/mean"] for s in steps[:10]]
  last = [spec[s]["reward/mean"] for s in steps[-10:]]
  evals = [(s, spec[s]["eval/accuracy"], plain[s].get("eval/accuracy")) for s in steps
           if "eval/accuracy" in spec[s]]
  split = {k: sum(spec[s].get(f"time/{k}", 0.0) for s in steps) / len(steps)
           for k in ("rollout", "reward", "logprob", "train", "step")}
  notes = [
      f"runs: `{args.spec_run}` (--spec=histospec) vs `{args.plain_run}` (--spec=none), "
      f"{len(steps)} steps each, same seed",
      f"rollout time over all steps: spec {t_spec:.0f} s, plain {t_plain:.0f} s, "
      f"ratio {t_spec / t_plain:.2f}",
      "mean step time split (spec run): " + ", ".join(f"{k} {v:.1f} s" for k, v in split.items()),
      f"reward mean over the first 10 steps {sum(first) / len(first):.3f}, over the last 10 "
      f"{sum(last) / len(last):.3f}",
      "greedy eval accuracy (spec / plain): " + ", ".join(
          f"step {s}: {a:.3f} / {fmt(b)}" for s, a, b in evals),
      ("same samples at every step: " + ", ".join(SAME_KEYS) + " equal where logged"
       if first_diff is None else f"runs first differ at step {first_diff}"),
      "|loss diff|: the runs' losses differ only in the last bits: the importance weight "
      "exp(logp_old - logp_rollout) uses the engine's log-probs, computed by verify-shaped "
      "(speculative) vs decode-shaped (plain) forward passes, which round differently",
  ]
  text = "\n\n".join([table, epoch_table])
  print("\n".join(notes))
  print(text)
  if not args.no_record:
    common.append_results("Quickstart GRPO: --spec=histospec vs --spec=none "
                          "(bench/quickstart_compare.py)", text, notes=notes)


def report_one(args):
  """Reward, accuracy, evaluation, length, acceptance and step-time split of a single run."""
  run = load(args.spec_run)
  steps = sorted(run)
  rows = [[s, run[s].get("data/epoch", "-"), fmt(run[s].get("reward/mean")),
           fmt(run[s].get("accuracy")), fmt(run[s].get("eval/accuracy")),
           fmt(run[s].get("response_length/mean"), 1),
           fmt(run[s].get("rollout/mean_accepted_length"), 3), fmt(run[s].get("time/rollout"), 1),
           fmt(run[s].get("time/train"), 1), fmt(run[s].get("time/step"), 1)] for s in steps]
  table = common.markdown_table(["step", "epoch", "reward", "accuracy", "eval accuracy",
                                 "length", "accepted len", "rollout s", "train s", "step s"], rows)
  mean = lambda k, ss: sum(run[s][k] for s in ss) / len(ss)
  notes = [f"run: `{args.spec_run}`, {len(steps)} steps",
           "reward mean, steps 1-10 / 11-20 / 21-30: " + " / ".join(
               f"{mean('reward/mean', steps[i:i + 10]):.3f}" for i in range(0, len(steps), 10)),
           "sampled accuracy mean, same windows: " + " / ".join(
               f"{mean('accuracy', steps[i:i + 10]):.3f}" for i in range(0, len(steps), 10))]
  print("\n".join(notes))
  print(table)
  if not args.no_record:
    common.append_results("Quickstart GRPO curves (bench/quickstart_compare.py)", table,
                          notes=notes)


if __name__ == "__main__":
  main()
