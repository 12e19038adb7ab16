"""Host time of packing one verify step's draft trees (`rollout.accept.pack`), per checkout.

Every speculative step packs each live row's root and draft nodes onto the packed token axis
(tokens, parents, depths, ancestor bits) before it is dispatched: host work on the critical
path of the step's launch, once per step. This bench times `pack` alone at engine shapes
(rows x draft nodes per row) on deterministic random trees shaped like history drafts (a long
chain, side branches from it), in this tree and in `--old` (another checkout, in its own
process), and checks both lay the trees out identically (CRC32 of the packed arrays). Timing
is timeit's: the best of 5 blocks of `--reps` calls, per process, and the best over
`--rounds` processes per checkout, run alternately (a shared machine's noise only adds time).

  python bench/pack_host.py --old /tmp/old_checkout
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
import zlib

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from bench import common  # noqa: E402  (imports no rhyme_jax: a worker picks its own)

SHAPES = ((8, 8), (32, 16), (64, 16), (64, 31), (128, 8))  # (rows, draft nodes per row)


def history_like_trees(rows: int, nodes: int, seed: int = 0) -> list:
  """Per row (tokens, parents): a chain of about two thirds of the nodes, the rest branching
  off random chain nodes (what a suffix-tree drafter's top paths look like)."""
  rng = np.random.default_rng(seed)
  trees = []
  for _ in range(rows):
    chain = max(1, (2 * nodes) // 3)
    pars = [j - 1 for j in range(chain)]
    pars += [int(rng.integers(-1, chain - 1)) for _ in range(nodes - chain)]
    trees.append((rng.integers(0, 49152, nodes).astype(np.int32), np.asarray(pars, np.int32)))
  return trees


def measure(code: str, reps: int) -> dict:
  """{'rows x nodes': [us per pack (the best of 5 blocks of `reps` calls), CRC32 of the packed
  arrays]} with `code`'s pack."""
  sys.path.insert(0, code)
  from rhyme_jax.rollout import accept  # pylint: disable=import-outside-toplevel
  out = {}
  for rows, nodes in SHAPES:
    trees, live = history_like_trees(rows, nodes), [True] * rows
    p = rows * (nodes + 1)
    packed = accept.pack(trees, live, p)
    crc = zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in packed))
    call = lambda trees=trees, live=live, p=p: accept.pack(trees, live, p)
    secs = min(timeit.repeat(call, number=reps, repeat=5)) / reps
    out[f"{rows}x{nodes}"] = [1e6 * secs, f"{crc:08x}"]
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_checkout_args(ap)
  ap.add_argument("--reps", type=int, default=200, help="calls per timed block")
  ap.add_argument("--rounds", type=int, default=3, help="processes per checkout (best kept)")
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  if args.reps < 1 or args.rounds < 1:
    ap.error(f"--reps={args.reps}, --rounds={args.rounds}: must be >= 1")
  res = None
  for _ in range(args.rounds):
    got = common.per_checkout(__file__, args, lambda code: measure(code, args.reps), HERE,
                              ["--reps", str(args.reps)])
    if got is None:  # a worker: it printed its figures
      return
    res = got if res is None else [{k: [min(a[k][0], b[k][0]), b[k][1]] for k in b}
                                   for a, b in zip(res, got)]
  names = (["--old"] if args.old else []) + ["this tree"]
  rows = []
  for shape in res[-1]:
    (rows_, nodes) = shape.split("x")
    cells = [rows_, nodes]
    for r in res:
      cells += [f"{r[shape][0]:.0f}", f"{r[shape][0] / int(rows_):.2f}"]
    if args.old:
      cells += [f"{res[-1][shape][0] / res[0][shape][0]:.2f}",
                "yes" if res[0][shape][1] == res[-1][shape][1] else "NO"]
    cells.append(res[-1][shape][1])
    rows.append(cells)
  header = ["rows", "draft nodes / row"]
  for n in names:
    header += [f"{n}: us / pack", f"{n}: us / row"]
  if args.old:
    header += ["this tree / --old", "same layout"]
  header.append("layout CRC32")
  table = common.markdown_table(header, rows)
  print(table)
  if not args.no_append:
    notes = [(f"us per call of rollout.accept.pack: the best of 5 blocks of {args.reps} calls "
              f"per process, the best of {args.rounds} processes per checkout (run "
              "alternately); trees: a chain of 2/3 of the nodes, the rest branching off it "
              "(bench/pack_host.py history_like_trees, seed 0); P = rows x (nodes + 1)")]
    common.append_results("Host time of packing a verify step's trees (bench/pack_host.py)",
                          table, [*notes, *args.note])


if __name__ == "__main__":
  main()
