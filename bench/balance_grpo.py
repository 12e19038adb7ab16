"""Two-host GRPO runs with and without --balance_hosts: the same samples, the hosts' times.

  python bench/balance_grpo.py --flagfile configs/quickstart.flags --num_steps 4

Runs the real trainer (`python -m rhyme_jax.main`) as two `jax.distributed` processes on this
machine (gloo), once with each host sampling its slice of the round and once with
--balance_hosts, same flags and seed otherwise, and tabulates each step: the tokens' CRC32
(the two runs must sample the same tokens), the rollout's wall time on the slower and the
faster host (`time/rollout`, `time/rollout_host_min`), and the busiest host's true tokens over
the hosts' mean with the run's assignment and with the slices (`schedule/host_tokens_ratio*`;
exact: a prompt samples the same tokens on any host). Token ratios are hardware-independent;
the wall times are of two processes sharing this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from rhyme_jax.metrics import read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_pair(flags: list[str], run_dir: str, timeout: float) -> list[dict]:
  """Both processes of one run; its metrics records (process 0 writes them)."""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  logs = [open(os.path.join(os.path.dirname(run_dir), f"{os.path.basename(run_dir)}_{i}.log"),
               "w") for i in range(2)]
  procs = [subprocess.Popen([sys.executable, "-m", "rhyme_jax.main", *flags,
                             f"--run_dir={run_dir}", f"--coordinator_address=localhost:{port}",
                             "--num_processes=2", f"--process_id={i}"],
                            cwd=REPO, env=env, stdout=logs[i], stderr=subprocess.STDOUT)
           for i in range(2)]
  try:
    codes = [p.wait(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in logs:
      f.close()
  if codes != [0, 0]:
    raise SystemExit(f"run {run_dir} failed ({codes}); see {logs[0].name}, {logs[1].name}")
  return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--flagfile", default="configs/quickstart.flags")
  ap.add_argument("--num_steps", type=int, default=4)
  ap.add_argument("--flag", action="append", default=[],
                  help="more trainer flags for both runs (repeatable), e.g. --flag=--train_size=8")
  ap.add_argument("--timeout", type=float, default=3600)
  common.add_results_args(ap)
  args = ap.parse_args(argv)
  flags = [f"--flagfile={args.flagfile}", f"--num_steps={args.num_steps}", "--eval_every=0",
           f"--checkpoint_every={args.num_steps}", *args.flag]
  rows, runs = [], {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, extra in (("slices", []), ("balanced", ["--balance_hosts"])):
      runs[name] = run_pair(flags + extra, os.path.join(tmp, name), args.timeout)
  for (a, b) in zip(runs["slices"], runs["balanced"]):
    for name, r in (("slices", a), ("balanced", b)):
      rows.append([r["step"], name, r["rollout/tokens_crc32"],
                   "yes" if a["rollout/tokens_crc32"] == b["rollout/tokens_crc32"] else "NO",
                   f"{r['time/rollout']:.1f}", f"{r['time/rollout_host_min']:.1f}",
                   f"{r['time/rollout'] / max(r['time/rollout_host_min'], 1e-9):.2f}",
                   r.get("schedule/host_groups_moved", 0),
                   f"{r['schedule/host_tokens_ratio']:.3f}" if name == "balanced" else
                   f"{b['schedule/host_tokens_ratio_slices']:.3f}",
                   f"{r['schedule/host_work_ratio']:.3f}" if name == "balanced" else
                   f"{b['schedule/host_work_ratio_slices']:.3f}"])
  total = {n: sum(r["time/rollout"] for r in runs[n][1:]) for n in runs}
  table = common.markdown_table(
      ["step", "hosts sample", "tokens CRC32", "same tokens", "rollout s (slower host)",
       "faster host s", "slower / faster", "groups moved",
       "busiest host tokens / mean (true)", "busiest host work / mean (predicted)"], rows)
  print(table)
  notes = [f"two jax.distributed processes on this machine (gloo), `python -m rhyme_jax.main "
           f"{' '.join(flags)}` with and without --balance_hosts; steps after the first: "
           f"rollout s (slower host) summed {total['slices']:.1f} (slices) vs "
           f"{total['balanced']:.1f} (balanced)",
           "step 1 has no history: the plan deals prompts round-robin (predictions equal)",
           *args.note]
  print("\n".join(notes))
  if not args.no_append:
    common.append_results("Two-host GRPO with and without --balance_hosts "
                          "(bench/balance_grpo.py)", table, notes)


if __name__ == "__main__":
  main()
