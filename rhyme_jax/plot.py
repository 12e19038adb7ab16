"""PNG training curves from a run's metrics.jsonl.

  python -m rhyme_jax.plot RUN_DIR [--out DIR]

Writes into `RUN_DIR/plots/` (or `--out`) one PNG per panel that has data:
  reward.png           reward/* and accuracy* metrics
  response_length.png  response_length/* metrics
  accepted_length.png  metrics whose name contains 'accepted_length'
  step_time.png        time/rollout, time/reward, time/logprob, time/train
                       stacked (plus time/step as a line when logged)
Panels without data are skipped; a missing or empty metrics file is an error. RUN_DIR and
--out may be local paths or URIs such as gs://bucket/run (`etils.epath`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be set first)
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402

from rhyme_jax.metrics import METRICS_FILE, read_metrics  # noqa: E402

STEP_TIME_PHASES = ("time/rollout", "time/reward", "time/logprob", "time/train")
STEP_TIME_TOTAL = "time/step"


@dataclasses.dataclass(frozen=True)
class Series:
  steps: np.ndarray
  values: np.ndarray


def load_series(path: str | os.PathLike) -> dict[str, Series]:
  """Reads metrics.jsonl into {metric name: Series} (numeric values only)."""
  path = epath.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"metrics file not found: {path}")
  records = read_metrics(path)
  if not records:
    raise ValueError(f"metrics file has no records: {path}")
  points: dict[str, tuple[list[int], list[float]]] = {}
  for record in records:
    for name, value in record.items():
      if name == "step" or isinstance(value, bool):
        continue
      if isinstance(value, (int, float)):
        steps, values = points.setdefault(name, ([], []))
        steps.append(record["step"])
        values.append(float(value))
  return {name: Series(np.asarray(s), np.asarray(v, np.float64))
          for name, (s, v) in points.items()}


def _line_panel(ax, series: dict[str, Series], names: Sequence[str],
                ylabel: str) -> None:
  for name in names:
    s = series[name]
    ax.plot(s.steps, s.values, label=name, marker="." if len(s.steps) < 50 else None)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize="small")


def _step_time_panel(ax, series: dict[str, Series], names: Sequence[str],
                     ylabel: str) -> None:
  phases = [n for n in STEP_TIME_PHASES if n in names]
  if phases:
    steps = np.unique(np.concatenate([series[n].steps for n in phases]))
    stacked = []
    for name in phases:  # Align on the union of steps; absent points are 0.
      row = np.zeros(len(steps))
      idx = np.searchsorted(steps, series[name].steps)
      row[idx] = np.nan_to_num(series[name].values)
      stacked.append(row)
    ax.stackplot(steps, *stacked, labels=[n.split("/", 1)[1] for n in phases],
                 alpha=0.8)
  if STEP_TIME_TOTAL in names:
    s = series[STEP_TIME_TOTAL]
    ax.plot(s.steps, s.values, color="black", linewidth=1, label="step total")
  ax.set_ylabel(ylabel)
  ax.legend(fontsize="small", loc="upper left")


@dataclasses.dataclass(frozen=True)
class Panel:
  name: str
  title: str
  ylabel: str
  select: Callable[[str], bool]
  draw: Callable = _line_panel


PANELS = (
    Panel("reward", "Reward and accuracy", "value",
          lambda n: n.startswith(("reward", "accuracy"))),
    Panel("response_length", "Response length", "tokens",
          lambda n: n.startswith("response_length")),
    Panel("accepted_length", "Mean accepted length per verify step", "tokens",
          lambda n: "accepted_length" in n),
    Panel("step_time", "Step time split", "seconds",
          lambda n: n in STEP_TIME_PHASES or n == STEP_TIME_TOTAL,
          _step_time_panel),
)


def plot_run(run_dir: str | os.PathLike,
             out_dir: str | os.PathLike | None = None) -> list[epath.Path]:
  """Renders every panel with data; returns the PNG paths written."""
  run_dir = epath.Path(run_dir)
  series = load_series(run_dir / METRICS_FILE)
  out_dir = epath.Path(out_dir) if out_dir is not None else run_dir / "plots"
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for panel in PANELS:
    names = sorted(n for n in series if panel.select(n)
                   and np.isfinite(series[n].values).any())
    if not names:
      continue
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
      panel.draw(ax, series, names, panel.ylabel)
      ax.set_title(f"{panel.title} ({run_dir.name})")
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      fig.tight_layout()
      path = out_dir / f"{panel.name}.png"
      with path.open("wb") as f:
        fig.savefig(f, format="png")
    finally:
      plt.close(fig)
    written.append(path)
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m rhyme_jax.plot",
      description="Render PNG training curves from RUN_DIR/metrics.jsonl.")
  parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None,
                      help="output directory (default: RUN_DIR/plots)")
  args = parser.parse_args(argv)
  try:
    written = plot_run(args.run_dir, args.out)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if not written:
    print(f"error: no plottable metrics in {epath.Path(args.run_dir) / METRICS_FILE} "
          "(looked for reward*, accuracy*, response_length*, *accepted_length*, "
          f"{', '.join(STEP_TIME_PHASES)})", file=sys.stderr)
    return 1
  for path in written:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
