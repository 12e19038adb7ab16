"""Real GRPO steps: rollout time per step for plain / +HistoSpec / +HistoPipe / both, same seed.

Trains the quickstart task (configs/quickstart.flags: SmolLM2-135M-Instruct, arithmetic) at
small settings, four variants one after the other in this process (their engines share
compilations), each from the same initial weights and seed:

  plain       --spec=none       --schedule=fifo
  +HistoSpec  --spec=histospec  --schedule=fifo
  +HistoPipe  --spec=none       --schedule=SCHEDULE   (--schedule, default history)
  both        --spec=histospec  --schedule=SCHEDULE

`--train_size` is set to `--prompts`, so every step is a new epoch over the same prompts and
from step 2 on both history users have a previous epoch to draft from and predict with.
`--slots` (the trainer's --rollout_slots; default half the step's samples) makes requests
wait for a slot: with every sample in its own slot from the start, no admission order could
change anything.

Per variant and step it prints rollout time, makespan (rollout start to last response), tail
(the last 10% of responses), mean accepted length and the CRC32 of the step's sampled tokens,
and over all steps a CRC32 of the per-step CRC32s: equal across variants when they sampled the
same tokens, which speculation and scheduling must not change. Appends the table to
bench/RESULTS.md unless --no_append.

  nice -n 10 python bench/schedule_grpo.py                       # the real one (minutes)
  python bench/schedule_grpo.py --flag=--model=DIR --flag=--tokenizer=smollm2-135m-instruct \\
      --flag=--reward=format --steps 2 --no_append                # a tiny model, to check it
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from rhyme_jax.config import SCHEDULES, parse_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("plain", "+HistoSpec", "+HistoPipe", "both")


def variant_flags(name: str, schedule: str, divide: tuple[int, int] = (0, 0)) -> list[str]:
  """The trainer flags of a variant; `divide` = (--divide_every, --park_rows) of the
  +HistoPipe variants (divided rollout; 0: off)."""
  spec = "histospec" if name in ("+HistoSpec", "both") else "none"
  pipe = name in ("+HistoPipe", "both")
  flags = [f"--spec={spec}", f"--schedule={schedule if pipe else 'fifo'}"]
  if pipe and divide[0]:
    flags += [f"--divide_every={divide[0]}", f"--park_rows={divide[1]}"]
  return flags


def run_variant(name: str, args, run_root: str) -> tuple[list[dict], int]:
  """Trains one variant for `args.steps` steps: its per-step metrics, and how many engine
  functions compiled after warm-up (inside rollouts: should be 0)."""
  # pylint: disable=import-outside-toplevel
  from rhyme_jax.rl.trainer import Trainer
  from rhyme_jax.rollout.compiled import TRACE_COUNTS
  flags = [f"--flagfile={args.flagfile}", f"--run_dir={os.path.join(run_root, name)}",
           f"--num_steps={args.steps}", f"--prompts_per_step={args.prompts}",
           f"--train_size={args.prompts}", f"--group_size={args.group_size}",
           f"--max_new_tokens={args.max_new_tokens}", f"--micro_batch_size={args.group_size}",
           f"--overlong_buffer={min(args.max_new_tokens // 3, 24)}", "--eval_every=0",
           f"--checkpoint_every={args.steps}", f"--seed={args.seed}",
           f"--rollout_slots={args.slots}", *variant_flags(name, args.schedule, args.divide),
           *args.flag]
  recording = bool(args.record) and name == args.variants.split(",")[0]
  if recording:
    flags.append("--record_rollouts")
  t0 = time.perf_counter()
  trainer = Trainer(parse_flags(flags))  # compiles every rollout shape (engine warm-up)
  # Printed at once, so a run cut off by a time limit still shows where its time went.
  print(f"[schedule_grpo] {name}: trainer built, rollout shapes compiled, in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  try:
    before = sum(TRACE_COUNTS.values())
    history = trainer.run()
    if recording:  # the first variant's sampled rounds: a length trace for schedsim.py grpo:DIR
      shutil.copytree(os.path.join(run_root, name, "rollouts"), args.record, dirs_exist_ok=True)
    return history, sum(TRACE_COUNTS.values()) - before
  finally:
    del trainer
    gc.collect()


def all_steps_crc(history: list[dict]) -> str:
  return f"{zlib.crc32(''.join(m['rollout/tokens_crc32'] for m in history).encode()):08x}"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--flagfile", default=os.path.join(REPO, "configs", "quickstart.flags"))
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--prompts", type=int, default=4, help="prompts per step (= train_size)")
  ap.add_argument("--group_size", type=int, default=4)
  ap.add_argument("--max_new_tokens", type=int, default=48)
  ap.add_argument("--slots", type=int, default=0,
                  help="requests decoded at once (--rollout_slots); 0 = half the step's samples")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--schedule", default="history", choices=[s for s in SCHEDULES if s != "fifo"],
                  help="the +HistoPipe variants' --schedule")
  ap.add_argument("--divide_every", type=int, default=0,
                  help="+HistoPipe variants: divided rollout every this many tokens (needs "
                       "--schedule probe or residual); 0 = off")
  ap.add_argument("--park_rows", type=int, default=0,
                  help="+HistoPipe variants with --divide_every: parked KV rows (0: one per "
                       "sample of a step)")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--flag", action="append", default=[],
                  help="an extra trainer flag for every variant, e.g. --flag=--model=DIR")
  ap.add_argument("--record", default="",
                  help="copy the first variant's recorded rollouts (--record_rollouts) here: a "
                       "GRPO length trace for bench/schedsim.py --trace grpo:DIR")
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  names = args.variants.split(",")
  bad = [n for n in names if n not in VARIANTS]
  if bad or not names:
    ap.error(f"--variants: {bad or names} not in {', '.join(VARIANTS)}")
  if args.steps < 1 or args.prompts < 1 or args.group_size < 2 or args.max_new_tokens < 3:
    ap.error("--steps, --prompts >= 1, --group_size >= 2, --max_new_tokens >= 3")
  args.slots = args.slots or max(args.prompts * args.group_size // 2, 1)
  if args.divide_every < 0 or args.park_rows < 0:
    ap.error("--divide_every, --park_rows: must be >= 0")
  args.divide = (args.divide_every, args.park_rows or args.prompts * args.group_size)
  load = os.getloadavg()[0]
  run_root = tempfile.mkdtemp(prefix="schedule_grpo_")
  histories, compiles = {}, {}
  try:
    for name in names:
      histories[name], compiles[name] = run_variant(name, args, run_root)
  finally:
    shutil.rmtree(run_root, ignore_errors=True)

  rows, summary = [], []
  base = histories[names[0]]
  for name in names:
    h = histories[name]
    for step, m in enumerate(h, 1):
      rows.append([name, step, m["data/epoch"],
                   f"{m['time/rollout']:.1f}", f"{m['time/rollout_makespan']:.1f}",
                   f"{m['time/rollout_tail']:.1f}", f"{m['rollout/mean_accepted_length']:.2f}",
                   f"{m['rollout/spec_step_frac']:.0%}", f"{m['rollout/draft_accept_rate']:.0%}",
                   f"{m['response_length/mean']:.1f}", m["rollout/tokens_crc32"]])
    later = h[1:] or h  # steps with a previous epoch to use
    t_all = sum(m["time/rollout"] for m in h)
    t_later = sum(m["time/rollout"] for m in later)
    b_later = sum(m["time/rollout"] for m in (base[1:] or base))
    summary.append([name, " ".join(variant_flags(name, args.schedule, args.divide)),
                    f"{t_all:.1f}",
                    f"{t_later:.1f}", f"{t_later / b_later:.2f}",
                    f"{sum(m['time/rollout_tail'] for m in later):.1f}", compiles[name],
                    all_steps_crc(h)])
  table = common.markdown_table(
      ["variant", "step", "epoch", "rollout s", "makespan s", "tail s", "accepted len",
       "spec steps", "drafts taken", "length", "tokens CRC32"], rows)
  table += "\n\n" + common.markdown_table(
      ["variant", "flags", "rollout s, all steps", "steps 2+ (with history)",
       f"ratio to {names[0]}", "tail s, steps 2+", "compiles in rollouts",
       "CRC32 of step CRC32s"], summary)
  same = len({r[-1] for r in summary}) == 1
  notes = [
      f"{args.steps} GRPO steps per variant, {args.prompts} prompts x {args.group_size} samples, "
      f"max_new_tokens {args.max_new_tokens}, {args.slots} slots, seed {args.seed}, from "
      f"{os.path.relpath(args.flagfile, REPO)} (train_size = prompts: every step a new epoch "
      "over the same prompts); variants run one after the other in one process (shared "
      "compilations)",
      f"sampled tokens identical across variants: {'yes' if same else 'NO'} (CRC32 per step "
      "and over all steps)",
      "spec steps = share of decode steps that verified drafts (the cost model sizes each step "
      "and may draft nothing); drafts taken = accepted / drafted tree nodes",
      f"1-minute load average at the start: {load:.2f} on {os.cpu_count()} cores (a shared "
      "box: wall times carry other jobs' noise)",
  ] + args.note
  print(table)
  for n in notes:
    print("-", n)
  if not args.no_append:
    common.append_results("GRPO rollout time: plain / +HistoSpec / +HistoPipe / both "
                          "(bench/schedule_grpo.py)", table, notes)
  if not same:
    sys.exit("sampled tokens differ between variants")


if __name__ == "__main__":
  main()
