"""Tests for rhyme_jax.plot: PNG panels from metrics.jsonl, graceful skipping."""

import json
import os
import subprocess
import sys

import pytest

from rhyme_jax import plot

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _full_record(step):
  return {
      "step": step, "reward/mean": 0.1 * step, "accuracy": 0.05 * step,
      "response_length/mean": 200 - step, "response_length/max": 400,
      "rollout/mean_accepted_length": 1.0 + 0.2 * step,
      "time/rollout": 2.0, "time/reward": 0.1, "time/logprob": 0.5,
      "time/train": 1.0, "time/step": 3.7, "phase": "train",
  }


def test_all_panels_written_as_png(tmp_path):
  _write(tmp_path / "metrics.jsonl", [_full_record(s) for s in range(1, 21)])
  written = plot.plot_run(tmp_path)
  assert sorted(p.name for p in written) == [
      "accepted_length.png", "response_length.png", "reward.png",
      "step_time.png"]
  for path in written:
    assert path.parent == tmp_path / "plots"
    data = path.read_bytes()
    assert data.startswith(_PNG_MAGIC) and len(data) > 5000


def test_missing_metrics_are_skipped(tmp_path):
  # Only some metrics, and a time phase missing on some steps.
  records = [{"step": s, "reward/mean": 0.5, "time/rollout": 1.0} for s in range(5)]
  records[2]["time/train"] = 0.3
  _write(tmp_path / "metrics.jsonl", records)
  written = plot.plot_run(tmp_path, out_dir=tmp_path / "out")
  assert sorted(p.name for p in written) == ["reward.png", "step_time.png"]
  assert all(p.parent == tmp_path / "out" for p in written)


def test_missing_or_empty_file_errors_name_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
    plot.plot_run(tmp_path)
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(ValueError, match="no records: " + str(tmp_path / "metrics.jsonl")):
    plot.plot_run(tmp_path)
  assert plot.main([str(tmp_path)]) == 1


def test_no_plottable_metrics_returns_error(tmp_path, capsys):
  _write(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 0.3}])
  assert plot.main([str(tmp_path)]) == 1
  assert "no plottable metrics" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
  _write(tmp_path / "metrics.jsonl", [_full_record(s) for s in range(1, 4)])
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # import this checkout
  proc = subprocess.run([sys.executable, "-m", "rhyme_jax.plot", str(tmp_path)], cwd=repo,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.split()
  assert len(lines) == 4 and all(line.endswith(".png") for line in lines)
  missing = subprocess.run(
      [sys.executable, "-m", "rhyme_jax.plot", str(tmp_path / "nope")], cwd=repo,
      capture_output=True, text=True, timeout=120)
  assert missing.returncode == 1
  assert str(tmp_path / "nope" / "metrics.jsonl") in missing.stderr


def test_run_and_out_dirs_through_epath(tmp_path):
  """Run and output directories as etils.epath paths (what a gs:// run directory uses)."""
  from etils import epath
  _write(tmp_path / "metrics.jsonl", [_full_record(s) for s in range(1, 4)])
  out = epath.Path(tmp_path) / "elsewhere"
  written = plot.plot_run(epath.Path(tmp_path), out)
  assert written and all(p.parent == out for p in written)
  assert all(p.read_bytes().startswith(_PNG_MAGIC) for p in written)
