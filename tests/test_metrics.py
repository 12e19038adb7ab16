"""Tests for rhyme_jax.metrics: jsonl log, TensorBoard readback, resume, progress."""

import io
import os
import math

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from rhyme_jax import metrics as metrics_lib


def _step_metrics(step):
  return {
      "reward/mean": 0.1 * step,
      "response_length/mean": np.float32(100 + step),
      "rollout/mean_accepted_length": jnp.asarray(1.5 + step / 10),
      "num_prompts": np.int64(8),
      "phase": "train",
  }


def _tb_scalars(run_dir, tag):
  acc = event_accumulator.EventAccumulator(
      str(run_dir / "tb"), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_jsonl_and_tensorboard_readback(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path) as w:
    for step in range(1, 6):
      w.write(step, _step_metrics(step))

  records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert records[2] == {"step": 3, "reward/mean": pytest.approx(0.3),
                        "response_length/mean": 103.0,
                        "rollout/mean_accepted_length": pytest.approx(1.8),
                        "num_prompts": 8, "phase": "train"}
  assert isinstance(records[0]["num_prompts"], int)

  rewards = _tb_scalars(tmp_path, "reward/mean")
  assert [s for s, _ in rewards] == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([v for _, v in rewards],
                             [0.1, 0.2, 0.3, 0.4, 0.5], rtol=1e-6)
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert "phase" not in acc.Tags()["scalars"]
  assert "num_prompts" in acc.Tags()["scalars"]


def _run(run_dir, steps, resume_step=None):
  with metrics_lib.MetricsWriter(run_dir, resume_step=resume_step) as w:
    for step in steps:
      w.write(step, {"loss": float(step) ** 2, "other": -step})


def test_resume_truncates_to_match_uninterrupted_run(tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _run(straight, range(1, 11))
  _run(resumed, range(1, 8))              # Crashed after logging step 7 ...
  with open(resumed / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "loss": 6')      # ... in the middle of step 8's line.
  _run(resumed, range(5, 11), resume_step=4)  # Last checkpoint was step 4.

  assert ((resumed / "metrics.jsonl").read_text() ==
          (straight / "metrics.jsonl").read_text())
  # TensorBoard drops the orphaned points 5..7 of the first attempt.
  assert _tb_scalars(resumed, "loss") == _tb_scalars(straight, "loss")
  assert [s for s, _ in _tb_scalars(resumed, "loss")] == list(range(1, 11))


def test_fresh_run_clears_stale_records(tmp_path):
  _run(tmp_path, range(1, 4))
  _run(tmp_path, range(1, 3), resume_step=None)
  assert [r["step"] for r in metrics_lib.read_metrics(
      tmp_path / "metrics.jsonl")] == [1, 2]


def test_corrupt_line_error_names_file_and_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(metrics_lib.MetricsFileError, match=f"{path}:2: invalid JSON"):
    metrics_lib.MetricsWriter(tmp_path, resume_step=3)
  assert path.read_text() == '{"step": 1}\nnot json\n{"step": 3}\n'
  path.write_text('{"loss": 1}\n')
  with pytest.raises(metrics_lib.MetricsFileError, match=f"{path}:1: .*'step'"):
    metrics_lib.read_metrics(path)
  path.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n')
  with pytest.raises(metrics_lib.MetricsFileError, match=f"{path}:2: not UTF-8"):
    metrics_lib.read_metrics(path)


def test_non_scalar_metric_and_reserved_name(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as w:
    with pytest.raises(TypeError, match="'hist'.*shape \\(3,\\)"):
      w.write(1, {"hist": np.ones(3)})
    with pytest.raises(ValueError, match="'step'"):
      w.write(1, {"step": 2})
    w.write(1, {"nan": math.nan})
  assert math.isnan(metrics_lib.read_metrics(tmp_path / "metrics.jsonl")[0]["nan"])
  assert not (tmp_path / "tb").exists()


def test_disabled_writer_writes_nothing(tmp_path):
  with metrics_lib.MetricsWriter(tmp_path / "r", enabled=False) as w:
    w.write(1, {"loss": 1.0})
  assert not (tmp_path / "r").exists()


class _FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


class _TtyStream(io.StringIO):
  def isatty(self):
    return True


def test_progress_lines_and_eta():
  clock, out = _FakeClock(), io.StringIO()
  prog = metrics_lib.Progress(100, start_step=10, keys=("reward/mean", "missing"),
                              stream=out, smoothing=0.5, clock=clock)
  clock.t = 4.0
  line = prog.update(11, {"reward/mean": np.float32(0.4123456)})
  assert line == "step 11/100 | reward/mean 0.4123 | 4 s/step | ETA 5m56s"
  clock.t = 10.0  # Two steps in 6 s -> 3 s/step; EMA 0.5*3 + 0.5*4 = 3.5.
  line = prog.update(13, {})
  assert line == "step 13/100 | 3.5 s/step | ETA 5m04s"
  assert out.getvalue().splitlines() == [
      "step 11/100 | reward/mean 0.4123 | 4 s/step | ETA 5m56s",
      "step 13/100 | 3.5 s/step | ETA 5m04s"]


def test_progress_redraws_in_place_on_tty():
  clock, out = _FakeClock(), _TtyStream()
  prog = metrics_lib.Progress(5, stream=out, clock=clock)
  clock.t = 1.0
  prog.update(1, {})
  clock.t = 2.0
  prog.update(2, {})
  prog.close()
  text = out.getvalue()
  assert text.count("\n") == 1 and text.endswith("\n")
  assert text.startswith("\rstep 1/5 | 1 s/step | ETA 4s\rstep 2/5")


def test_object_store_mode_rewrites_and_matches_append_mode(tmp_path):
  """A gs:// run directory cannot be appended to: the writer rewrites the file at each step.
  Run here on a local path through etils.epath, crash and resume included."""
  from etils import epath

  def run(run_dir, steps, resume_step=None):
    with metrics_lib.MetricsWriter(epath.Path(run_dir), resume_step=resume_step, append=False,
                                   tensorboard=False) as w:
      assert w._file is None  # nothing held open
      for step in steps:
        w.write(step, {"loss": float(step) ** 2, "other": -step})

  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _run(straight, range(1, 11))  # append mode
  run(resumed, range(1, 8))
  with open(resumed / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "loss": 6')
  run(resumed, range(5, 11), resume_step=4)
  assert (resumed / "metrics.jsonl").read_text() == (straight / "metrics.jsonl").read_text()

  uri = metrics_lib.MetricsWriter("gs://bucket/run", enabled=False)  # touches nothing
  assert os.fspath(uri.path) == "gs://bucket/run/metrics.jsonl" and uri.append is False
  assert metrics_lib.MetricsWriter(tmp_path / "x", enabled=False).append is True
