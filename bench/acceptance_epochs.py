"""HistoSpec acceptance along a GRPO run: how it moves, data epoch by data epoch, as the policy
sharpens (the trainer's `epoch/*` metrics, rhyme_jax.rl.epoch_stats).

Runs the quickstart task (configs/quickstart.flags: SmolLM2-135M-Instruct, arithmetic word
problems) on a smaller train set so that one run visits every prompt `--epochs` times, with
`--speculate=always` (every decode step verifies a draft tree: acceptance is measured at every
step, not only where the cost model chose to speculate), then tabulates per data epoch: mean
accepted length per slot-verify (bonus included), draft hit rate, drafted nodes per step, mean
reward and response length. Epoch 0 has no history (siblings only); from epoch 1 on, each
prompt drafts from its previous visit. A rerun of the same command resumes the run (or only
reports, if it finished).

  python bench/acceptance_epochs.py                      # 16 prompts, 4 per step, 6 epochs
  python bench/acceptance_epochs.py --plain_run_dir runs/acc_plain   # + the same run, plain
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.metrics import read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--run_dir", default="runs/acceptance_epochs")
  p.add_argument("--plain_run_dir", default="",
                 help="also run --spec=none with the same seed: tokens must match (CRC32)")
  p.add_argument("--train_size", type=int, default=16)
  p.add_argument("--prompts_per_step", type=int, default=4)
  p.add_argument("--epochs", type=int, default=6)
  p.add_argument("--extra", action="append", default=[], help="more trainer flags")
  common.add_results_args(p)
  args = p.parse_args(argv)
  if args.epochs < 2 or args.train_size % args.prompts_per_step:
    p.error("--epochs must be >= 2 and --train_size a multiple of --prompts_per_step")
  return args


def train(args, run_dir: str, spec: str) -> list[dict]:
  steps = args.epochs * args.train_size // args.prompts_per_step
  cmd = [sys.executable, "-m", "rhyme_jax.main", "--flagfile=configs/quickstart.flags",
         f"--train_size={args.train_size}", f"--prompts_per_step={args.prompts_per_step}",
         f"--num_steps={steps}", "--eval_every=0", f"--checkpoint_every={steps}",
         f"--spec={spec}", f"--run_dir={run_dir}", *args.extra]
  if spec != "none":
    cmd.append("--speculate=always")
  metrics = os.path.join(run_dir, "metrics.jsonl")
  done = os.path.exists(metrics) and any(r["step"] == steps for r in read_metrics(metrics))
  if not done:
    print("[acceptance_epochs] " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
  return [r for r in read_metrics(metrics) if r["step"] <= steps]


def by_epoch(records: list[dict]) -> dict[int, dict]:
  """The last step of each data epoch (its `epoch/*` cover the whole epoch), plus the epoch's
  rollout seconds and token fingerprints summed / listed over its steps."""
  out: dict[int, dict] = {}
  for r in records:
    e = int(r["epoch/index"])
    prev = out.get(e, {"rollout_s": 0.0, "crc": []})
    out[e] = dict(r, rollout_s=prev["rollout_s"] + r["time/rollout"],
                  crc=prev["crc"] + [r["rollout/tokens_crc32"]])
  return out


def main(argv=None):
  args = parse_args(argv)
  spec = by_epoch(train(args, args.run_dir, "histospec"))
  plain = by_epoch(train(args, args.plain_run_dir, "none")) if args.plain_run_dir else {}
  headers = ["epoch", "accepted len/verify", "hit rate", "drafted/step", "reward",
             "response length", "rollout s"]
  if plain:
    headers += ["rollout s plain", "same tokens (CRC32)"]
  rows = []
  for e, r in sorted(spec.items()):
    row = [e, f"{r['epoch/accepted_length']:.2f}", f"{r['epoch/hit_rate']:.2f}",
           f"{r['epoch/drafted_per_step']:.1f}", f"{r['epoch/reward']:.3f}",
           f"{r['epoch/response_length']:.1f}", f"{r['rollout_s']:.1f}"]
    if plain:
      p = plain.get(e)
      row += ["-", "-"] if p is None else [f"{p['rollout_s']:.1f}",
                                           "yes" if p["crc"] == r["crc"] else "NO"]
    rows.append(row)
  table = common.markdown_table(headers, rows)
  print(table)
  if not args.no_append:
    steps_per_epoch = args.train_size // args.prompts_per_step
    common.append_results(
        "HistoSpec acceptance per data epoch along a GRPO run (bench/acceptance_epochs.py)",
        table,
        [f"configs/quickstart.flags with --train_size={args.train_size} --prompts_per_step="
         f"{args.prompts_per_step} ({steps_per_epoch} steps per data epoch), {args.epochs} "
         "epochs, --speculate=always (a draft tree verified at every decode step), no eval"
         + (f", extra flags {args.extra}" if args.extra else ""),
         "per epoch: the trainer's epoch/* metrics at the epoch's last step (accepted length = "
         "tokens per slot-verify, bonus included; hit rate = accepted / verified draft nodes); "
         "reward and response length are the epoch's sample means; rollout s summed over its "
         "steps",
         "epoch 0 drafts from live siblings only; later epochs also from the prompt's previous "
         "visit (HistoryDrafter defaults)"] + args.note)


if __name__ == "__main__":
  main()
