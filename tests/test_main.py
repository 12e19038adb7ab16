"""`python -m rhyme_jax.main`: bad input ends with a one-line error and writes nothing.

Bad flags, a malformed / incomplete / empty dataset and a run directory written by another
config each stop the program before the run directory is created or changed. (The training
path itself is covered by tests/rl/test_trainer.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rhyme_jax.run_config import write_run_config
from rhyme_jax.config import parse_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(*args):
  return subprocess.run([sys.executable, "-m", "rhyme_jax.main", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def base_flags(run_dir):
  return [f"--run_dir={run_dir}", "--model=smollm2-135m-instruct", "--num_steps=1"]


def last_line(proc):
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  return lines[-1] if lines else ""


def test_bad_flag_value(tmp_path):
  proc = run_main(*base_flags(tmp_path / "run"), "--spec=foo")
  assert proc.returncode == 2
  assert last_line(proc) == "error: --spec=foo: expected one of histospec, none"
  assert not (tmp_path / "run").exists()


def test_bad_reward_name(tmp_path):
  proc = run_main(*base_flags(tmp_path / "run"), "--reward=nope")
  assert proc.returncode == 2
  assert "--reward=nope: unknown reward 'nope'" in last_line(proc)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content, message", [
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n',
     "data.jsonl:2: malformed JSON"),
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n',
     "data.jsonl:2: missing required field 'answer'"),
    ("", "data.jsonl: dataset is empty"),
], ids=["malformed", "missing_answer", "empty"])
def test_dataset_errors_surface_cleanly(tmp_path, content, message):
  data = tmp_path / "data.jsonl"
  data.write_text(content)
  proc = run_main(*base_flags(tmp_path / "run"), f"--dataset={data}")
  assert proc.returncode == 1, proc.stderr[-2000:]
  line = last_line(proc)
  assert line.startswith("error: ") and message in line
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


def test_run_dir_of_another_config_is_refused_and_untouched(tmp_path):
  run_dir = tmp_path / "run"
  other = parse_flags(base_flags(run_dir) + ["--group_size=8"])
  write_run_config(run_dir, other)
  (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
  before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

  proc = run_main(*base_flags(run_dir), "--group_size=4")
  assert proc.returncode == 1
  assert "was written by a different config" in proc.stderr
  assert "rl.group_size: run dir has 8, new config has 4" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
  assert json.loads((run_dir / "run_config.json").read_text())["config"]["rl"]["group_size"] == 8
