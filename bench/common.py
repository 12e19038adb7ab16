"""Small helpers shared by the benchmark scripts: device description, dates, timing, and
appending a result section (table + device + date + exact command) to bench/RESULTS.md."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def device_description() -> str:
  """E.g. 'cpu: 1 x cpu (AMD EPYC, 2 cores), jax 0.10.2' or 'gpu: 1 x NVIDIA H100 80GB HBM3'."""
  import jax
  devices = jax.devices()
  kind = devices[0].device_kind
  text = f"{jax.default_backend()}: {len(devices)} x {kind}"
  if jax.default_backend() == "cpu":
    text += f" ({_cpu_model()}, {os.cpu_count()} cores)"
  return f"{text}, jax {jax.__version__}"


def today() -> str:
  return datetime.date.today().isoformat()


def command_line() -> str:
  """The command that is running, as one could paste it into a shell."""
  return "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def median_time(fn: Callable[[], object], reps: int) -> float:
  """Median wall seconds of `fn()` over `reps` runs; `fn` must block on its own results."""
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def int_list(parser, flag: str, text: str) -> tuple[int, ...]:
  """--flag's comma-separated positive integers, or the parser's one-line error naming it."""
  try:
    out = tuple(int(x) for x in text.split(","))
  except ValueError:
    parser.error(f"--{flag}={text!r}: expected comma-separated integers")
  if not out or any(x <= 0 for x in out):
    parser.error(f"--{flag}={text!r}: every entry must be > 0")
  return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def add_results_args(parser, note: bool = True) -> None:
  """The flags every bench that appends to RESULTS.md reads: --no_append, and --note (a line
  of its own for the section, repeatable) where the bench passes notes on."""
  parser.add_argument("--no_append", action="store_true", help="do not append to bench/RESULTS.md")
  if note:
    parser.add_argument("--note", action="append", default=[],
                        help="a line for the RESULTS.md section (repeatable)")


def append_results(title: str, table: str, notes: Sequence[str] = (), command: str | None = None,
                   path: str = RESULTS_PATH) -> str:
  """Appends one section to RESULTS.md (never rewrites earlier ones); returns the text."""
  parts = [f"\n## {title}\n",
           f"- date: {today()}",
           f"- device: {device_description()}",
           f"- command: `{command or command_line()}`"]
  parts += [f"- {n}" for n in notes]
  text = "\n".join(parts) + "\n\n" + table + "\n"
  with open(path, "a") as f:
    f.write(text)
  return text


def profiled(fn: Callable[[], object], title: str, top: int = 40,
             keys: Sequence[str] = ("tottime", "cumulative")) -> str:
  """Runs `fn` under cProfile: `title`, then the `top` functions by each of `keys` (own time,
  cumulative time), as text: where the host's time goes, blocking calls included."""
  import cProfile
  import pstats
  prof = cProfile.Profile()
  prof.runcall(fn)
  out = io.StringIO()
  out.write(f"{title}\n")
  for key in keys:
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
  return out.getvalue()


def host_to_device_transfers(run: Callable[[], object]) -> int:
  """Host-to-device transfers `run()` makes, as jax's transfer guard logs them (to fd 2, one
  line each; a log level that hides warnings would hide them). Hardware-independent: the
  count, not its cost, which is far higher per transfer on a GPU than on the CPU."""
  import jax
  with tempfile.TemporaryFile(mode="w+") as log:
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
      with jax.transfer_guard_host_to_device("log"):
        run()
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    log.seek(0)
    return sum("host-to-device transfer" in line for line in log)


def add_checkout_args(parser) -> None:
  """--old (another checkout to compare with this tree) and the internal --worker."""
  parser.add_argument("--old", default="", help="another checkout to compare (a git worktree)")
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)


def per_checkout(script: str, args, measure: Callable[[str], object],
                 here: str, argv: Sequence[str] = ()) -> list | None:
  """With --worker CODE: prints measure(CODE) as JSON and returns None (the caller stops).
  Else runs `script --worker CODE *argv` for --old (if given) and `here`, each in its own
  process so each imports its own rhyme_jax, and returns what each printed."""
  if args.worker:
    print(json.dumps(measure(args.worker)))
    return None
  out = []
  for code in ([args.old] if args.old else []) + [here]:
    res = subprocess.run([sys.executable, script, "--worker", code, *argv],
                         capture_output=True, text=True, check=True)
    out.append(json.loads(res.stdout.strip().splitlines()[-1]))
  return out
