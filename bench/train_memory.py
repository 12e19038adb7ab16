"""What one training update holds in device memory, by XLA's own count, per checkout.

The --dry_run memory estimate (rl/memory.py) decides whether a run starts, and --remat is what
the pod configs count on to fit. This bench compiles the learner's update step (one
micro-batch of `--rows` rows at each sequence length, SmolLM2-135M's real shapes, random
weights: memory does not depend on the values) with and without --remat, and reports XLA's
memory analysis of it (arguments: parameters and Adam moments; temporaries: everything the
step allocates besides) beside the estimate, in this tree and in `--old` (another checkout, in
its own process). Nothing runs: compiling is enough, so the figures are the same on any CPU.

  python bench/train_memory.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)

MIB = 2**20


def measure(code: str, rows: int, seqs: list[int], model: str) -> dict:
  """{'seq remat': [argument MiB, temporary MiB, estimate MiB]} with `code`'s learner."""
  sys.path.insert(0, code)
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from rhyme_jax import parallel
  from rhyme_jax.config import parse_flags
  from rhyme_jax.models.loading import read_model_config
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rl import memory
  from rhyme_jax.rl.learner import Learner
  from rhyme_jax.rl.samples import length_buckets
  cfg = read_model_config(model, param_dtype="float32")
  weights = init_model(cfg, 0)
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  out = {}
  for seq in seqs:
    for remat in (False, True):
      flags = ["--run_dir=unused", "--group_size=2", f"--prompts_per_step={rows // 2}",
               "--max_prompt_len=64", f"--max_new_tokens={seq - 64}", "--spec=none",
               *(["--remat"] if remat else [])]
      config = parse_flags(flags)
      t = length_buckets(seq)[-1]
      learner = Learner(config, weights, mesh, cfg)
      batch = parallel.shard_batch(dict(tokens=np.zeros((rows, t), np.int32),
                                        targets=np.zeros((rows, t), np.int32),
                                        adv=np.zeros((rows,), np.float32),
                                        mask=np.ones((rows, t), np.float32)), mesh)
      update = learner._update  # pylint: disable=protected-access
      ma = update.lower(learner.params, learner.opt_state, batch).compile().memory_analysis()
      est = memory.estimate(config, cfg, mesh)
      out[f"{t} {remat}"] = [ma.argument_size_in_bytes / MIB, ma.temp_size_in_bytes / MIB,
                             (est.params + est.opt_state + est.grads + est.activations) / MIB]
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(ap)
  ap.add_argument("--rows", type=int, default=8, help="rows of the one micro-batch")
  ap.add_argument("--seqs", default="512,1024", help="comma list of sequence lengths")
  ap.add_argument("--model", default="smollm2-135m-instruct",
                  help="whose config (shapes) to compile; weights are random")
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  seqs = common.int_list(ap, "seqs", args.seqs)
  if args.rows < 2 or args.rows % 2 or any(s <= 64 for s in seqs):
    ap.error(f"--rows={args.rows}, --seqs={args.seqs}: need an even number of rows (groups "
             "of 2) and lengths > 64")
  res = common.per_checkout(__file__, args, lambda code: measure(code, args.rows, seqs,
                                                                 args.model), HERE,
                            ["--rows", str(args.rows), "--seqs", args.seqs,
                             "--model", args.model])
  if res is None:
    return
  names = (["--old"] if args.old else []) + ["this tree"]
  header = ["tokens", "--remat"]
  for n in names:
    header += [f"{n}: arguments MiB", f"{n}: temporaries MiB", f"{n}: estimate MiB",
               f"{n}: estimate / compiled"]
  if args.old:
    header.append("temporaries, this tree / --old")
  rows = []
  for key in res[-1]:
    t, remat = key.split()
    cells = [t, "yes" if remat == "True" else "no"]
    for r in res:
      arg, temp, est = r[key]
      cells += [f"{arg:.0f}", f"{temp:.0f}", f"{est:.0f}", f"{est / (arg + temp):.2f}"]
    if args.old:
      cells.append(f"{res[-1][key][1] / res[0][key][1]:.2f}")
    rows.append(cells)
  table = common.markdown_table(header, rows)
  print(table)
  if not args.no_append:
    notes = [(f"{args.model}'s shapes, float32, random weights; one micro-batch of "
              f"{args.rows} rows; XLA's memory analysis of the compiled learner update on the "
              "CPU backend (arguments = parameters + Adam moments, donated; temporaries = "
              "everything else it allocates); estimate = rl/memory.py's parameters + "
              "optimiser state + gradients + activations for the same step")]
    common.append_results("Training update memory, compiled (bench/train_memory.py)", table,
                          [*notes, *args.note])


if __name__ == "__main__":
  main()
