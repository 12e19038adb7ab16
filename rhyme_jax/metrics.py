"""Per-step metrics: a JSON-lines log, TensorBoard scalars and a progress line.

`MetricsWriter` appends one JSON object per step to `RUN_DIR/metrics.jsonl`
(`{"step": 12, "reward/mean": 0.4, ...}`) and writes the numeric values as
TensorBoard scalars under `RUN_DIR/tb/`. On resume it drops records past the
restored step, so the log of a resumed run equals that of an uninterrupted
one: the jsonl file is rewritten without them, and a TensorBoard "session
start" event at `resume_step + 1` makes TensorBoard discard the stale points.

Metric names used by `plot.py` (others are logged and plotted as lines if they
match a panel's prefix):
  reward/*, accuracy*          reward and accuracy curves
  response_length/*            response lengths (tokens)
  rollout/mean_accepted_length mean accepted length per verify step
  time/rollout, time/reward, time/logprob, time/train   step-time split (s)
Also logged: time/draft_ms_per_step and time/lookahead_ms_per_step (host drafting per decode
step, on the critical path and in the background), rollout/ahead_hit_rate,
rollout/spec_step_frac and rollout/draft_accept_rate (share of decode steps that verified drafts,
and of drafted nodes accepted), and
time/rollout_makespan, time/rollout_tail (the rollout's start to its last response, and the
time its last 10% of responses took: what --schedule acts on), rollout/yields and
rollout/yield_passes (divided rollout), rollout/bucket_moves and rollout/moves_held (the tail's
moves into smaller buckets, and passes the cost model kept the rows where they were).

`Progress` prints `step 12/100 | reward/mean 0.412 | 3.21 s/step | ETA 4m42s`,
redrawn in place on a terminal and one line per step otherwise (log files).

The run directory may be a local path or a URI such as `gs://bucket/run` (`etils.epath`). A
local metrics.jsonl is appended to line by line; an object store cannot append, so there the
whole file is rewritten at each step (a few kB per step).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence, TextIO

from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

METRICS_FILE = "metrics.jsonl"
TB_SUBDIR = "tb"


def _scalar(name: str, value: Any) -> Any:
  """Converts numpy/jax scalars to Python values; rejects non-scalars."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  size = getattr(value, "size", None)
  if size == 1 and hasattr(value, "item"):
    return _scalar(name, value.item())
  raise TypeError(f"metric {name!r}: expected a scalar, got "
                  f"{type(value).__name__}" +
                  (f" of shape {getattr(value, 'shape')}" if size else ""))


class MetricsFileError(ValueError):
  """A metrics.jsonl that cannot be read back (a resumed run keeps its records)."""


def read_metrics(path: str | os.PathLike,
                 *, drop_partial_last_line: bool = True) -> list[dict]:
  """Parses a metrics.jsonl file into a list of records.

  A last line without its newline (a writer killed mid-line) is dropped; any
  other malformed line raises MetricsFileError naming `path:line`.
  """
  path = epath.Path(path)
  raw = path.read_bytes()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise MetricsFileError(f"{path}:{line}: not UTF-8") from e
  lines = text.split("\n")
  records = []
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    is_partial_tail = lineno == len(lines) and not text.endswith("\n")
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if is_partial_tail and drop_partial_last_line:
        break
      raise MetricsFileError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
      raise MetricsFileError(f"{path}:{lineno}: expected an object with an integer "
                             "'step' field")
    records.append(record)
  return records


class MetricsWriter:
  """Writes per-step metrics to `run_dir/metrics.jsonl` and TensorBoard.

  Args:
    run_dir: run directory (created if missing).
    resume_step: last step whose metrics belong to the state being resumed
      (records with a larger step are removed); None for a fresh run, which
      clears any records left by an earlier attempt in the same directory.
    tensorboard: also write TensorBoard event files under `run_dir/tb`.
    enabled: False makes every call a no-op (non-primary processes).
    append: append to the file (True) or rewrite it whole at each step (False); default:
      append unless the run directory is a URI (`gs://...`: objects cannot be appended to).
  """

  def __init__(self, run_dir: str | os.PathLike, *,
               resume_step: int | None = None, tensorboard: bool = True,
               enabled: bool = True, append: bool | None = None):
    self.enabled = enabled
    self.run_dir = epath.Path(run_dir)
    self.path = self.run_dir / METRICS_FILE
    self.append = "://" not in os.fspath(self.run_dir) if append is None else append
    self._file = None
    self._lines: list[str] = []  # what the file holds, when it is rewritten at each step
    self._tb = None
    if not enabled:
      return
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self._truncate(resume_step)
    if self.append:
      self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      self._tb = EventFileWriter(str(self.run_dir / TB_SUBDIR), flush_secs=30)
      start = event_pb2.Event(
          wall_time=time.time(),
          step=0 if resume_step is None else resume_step + 1,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
      self._tb.add_event(start)

  def _truncate(self, resume_step: int | None) -> None:
    """Rewrites metrics.jsonl keeping records with step <= resume_step."""
    if not self.path.exists():
      return
    records = read_metrics(self.path)
    keep = [] if resume_step is None else [
        r for r in records if r["step"] <= resume_step]
    self._lines = [json.dumps(r) + "\n" for r in keep]
    tmp = self.path.parent / f".{self.path.name}.tmp.{os.getpid()}"
    tmp.write_text("".join(self._lines))
    tmp.replace(self.path)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Logs one step. Values are scalars (numbers, numpy/jax 0-d, bool, str).

    Non-finite floats are written as JSON NaN/Infinity (Python's json reads
    them back); str and None values go to the jsonl file only.
    """
    if not self.enabled:
      return
    if "step" in metrics:
      raise ValueError("metric name 'step' is reserved")
    record = {"step": int(step)}
    for name, value in metrics.items():
      record[name] = _scalar(name, value)
    line = json.dumps(record) + "\n"
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
    else:
      self._lines.append(line)
      self.path.write_text("".join(self._lines))
    if self._tb is not None:
      values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                for k, v in record.items()
                if k != "step" and isinstance(v, (int, float))]
      if values:
        self._tb.add_event(event_pb2.Event(
            wall_time=time.time(), step=int(step),
            summary=summary_pb2.Summary(value=values)))

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
      os.fsync(self._file.fileno())
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self.flush()
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  if h:
    return f"{h}h{m:02d}m"
  if m:
    return f"{m}m{s:02d}s"
  return f"{s}s"


def _format_value(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


class Progress:
  """A one-line progress display: step/total, chosen metrics, s/step, ETA.

  The step time is an exponential moving average (weight `smoothing` on the
  newest step) of the time between consecutive `update` calls; the ETA is
  that average times the steps left.
  """

  def __init__(self, total_steps: int, *, start_step: int = 0,
               keys: Sequence[str] = (), stream: TextIO | None = None,
               smoothing: float = 0.3,
               clock: Callable[[], float] = time.monotonic):
    if not 0.0 < smoothing <= 1.0:
      raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
    self.total_steps = total_steps
    self.keys = tuple(keys)
    self.stream = sys.stderr if stream is None else stream
    self.smoothing = smoothing
    self._clock = clock
    self._last_time = clock()
    self._last_step = start_step
    self.step_time: float | None = None
    isatty = getattr(self.stream, "isatty", None)
    self._tty = bool(isatty and isatty())
    self._last_len = 0

  def format(self, step: int, metrics: Mapping[str, Any]) -> str:
    parts = [f"step {step}/{self.total_steps}"]
    for key in self.keys:
      if key in metrics:
        parts.append(f"{key} {_format_value(_scalar(key, metrics[key]))}")
    if self.step_time is not None:
      parts.append(f"{self.step_time:.3g} s/step")
      left = max(self.total_steps - step, 0)
      parts.append(f"ETA {_format_duration(left * self.step_time)}")
    return " | ".join(parts)

  def update(self, step: int, metrics: Mapping[str, Any] = {}) -> str:
    """Records that `step` finished and prints the line; returns it."""
    now = self._clock()
    steps_done = step - self._last_step
    if steps_done > 0:
      dt = (now - self._last_time) / steps_done
      self.step_time = dt if self.step_time is None else (
          self.smoothing * dt + (1 - self.smoothing) * self.step_time)
    self._last_time, self._last_step = now, step
    line = self.format(step, metrics)
    if self._tty:
      pad = " " * max(self._last_len - len(line), 0)
      self.stream.write("\r" + line + pad)
      self._last_len = len(line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()
    return line

  def close(self) -> None:
    """Ends the in-place line on a terminal."""
    if self._tty and self._last_len:
      self.stream.write("\n")
      self.stream.flush()
      self._last_len = 0
