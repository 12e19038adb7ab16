"""`python -m rhyme_jax.main`: every door a user can walk into ends in one line and writes nothing.

Bad or unparsable flags (exit 2), a missing / truncated / malformed model, a malformed,
incomplete, empty or non-UTF-8 dataset and a run directory written by another config (exit 1)
each stop the program with `error: ...` naming the flag, file, line or tensor, before the run
directory is created or changed; `--help`, `--only_check_args` and `--dry_run` check without
writing. (Training, SIGTERM and checkpoint fallback: tests/rl/test_trainer.py.)
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


# ---------------------------------------------------------------------------------------------
# The doors: each user error is one line, the right exit status, and nothing written.

sys.path.insert(0, os.path.join(REPO, "tests", "rl"))
import train_entry  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return train_entry.write_tiny_llama(str(tmp_path_factory.mktemp("tiny")))


def tiny_flags(model, run_dir, *extra):
  return [f"--model={model}", "--tokenizer=smollm2-135m-instruct", f"--run_dir={run_dir}",
          "--train_size=4", "--group_size=2", "--prompts_per_step=2", "--max_new_tokens=4",
          "--max_prompt_len=128", "--num_steps=1", *extra]


def assert_one_line_error(proc, status, *fragments):
  assert proc.returncode == status, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  line = last_line(proc)
  assert line.startswith("error: "), proc.stderr[-3000:]
  for f in fragments:
    assert f in line, line


def test_missing_model_writes_nothing(tmp_path):
  proc = run_main(*tiny_flags("/nonexistent", tmp_path / "run"))
  assert_one_line_error(proc, 1, "'/nonexistent' is neither an existing file/directory")
  assert not (tmp_path / "run").exists()  # the corrected rerun is not refused


def test_truncated_safetensors_is_one_line(tmp_path, tiny_model):
  import shutil
  broken = tmp_path / "model"
  shutil.copytree(tiny_model, broken)
  st = broken / "model.safetensors"
  os.truncate(st, st.stat().st_size // 2)
  proc = run_main(*tiny_flags(broken, tmp_path / "run"))
  assert_one_line_error(proc, 1, f"{st}: truncated safetensors file: tensor")
  assert not (tmp_path / "run").exists()


def test_bad_config_json_is_one_line(tmp_path, tiny_model):
  import shutil
  broken = tmp_path / "model"
  shutil.copytree(tiny_model, broken)
  (broken / "config.json").write_text('{"hidden_size": 16,,}')
  proc = run_main(*tiny_flags(broken, tmp_path / "run"))
  assert_one_line_error(proc, 1, f"{broken / 'config.json'}: invalid JSON")
  assert not (tmp_path / "run").exists()


def test_non_utf8_dataset_names_file_and_line(tmp_path, tiny_model):
  data = tmp_path / "d.jsonl"
  data.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+\xff?", '
                   b'"answer": "#### 4"}\n')
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), f"--dataset={data}")
  assert_one_line_error(proc, 1, f"{data}:2: not UTF-8 (byte 0xff at column 17)")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, fragment", [
    ("--group_size=abc", "group_size"), ("--no_such_flag=1", "no_such_flag"),
], ids=["unparsable", "unknown"])
def test_flag_parse_errors_are_usage_errors(tmp_path, flag, fragment):
  proc = run_main(*base_flags(tmp_path / "run"), flag)
  assert_one_line_error(proc, 2, fragment)
  assert not (tmp_path / "run").exists()


def test_coordinator_without_process_count_is_one_line(tmp_path, tiny_model):
  """JAX alone would end in `ValueError: Number of processes must be defined` (a traceback)."""
  env = dict(os.environ, JAX_COORDINATOR_ADDRESS="localhost:12345")
  proc = subprocess.run([sys.executable, "-m", "rhyme_jax.main",
                         *tiny_flags(tiny_model, tmp_path / "run")], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert_one_line_error(proc, 2, "JAX_COORDINATOR_ADDRESS=localhost:12345 is set but the "
                        "process count is not: pass --num_processes=N and --process_id=I")
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--num_processes=2",
                  "--process_id=1")
  assert_one_line_error(proc, 2, "--num_processes=2: needs --coordinator_address=HOST:PORT")
  assert not (tmp_path / "run").exists()


def test_help_lists_the_project_flags():
  proc = run_main("--help")
  assert proc.returncode == 0, proc.stderr
  for flag in ("--group_size", "--spec", "--dry_run", "--run_dir", "--loss"):
    assert flag in proc.stdout, flag


def test_only_check_args_validates(tmp_path, tiny_model):
  proc = run_main(*base_flags(tmp_path / "run"), "--only_check_args", "--spec=foo")
  assert_one_line_error(proc, 2, "--spec=foo: expected one of histospec, none")
  proc = run_main(*tiny_flags("/nonexistent", tmp_path / "run"), "--only_check_args")
  assert_one_line_error(proc, 1, "/nonexistent")
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--only_check_args")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "mesh: {'data': 1, 'fsdp': 1, 'tensor': 1}" in proc.stdout  # the plan, as --dry_run
  assert not (tmp_path / "run").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, tiny_model):
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--dry_run")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "mesh: {'data': 1, 'fsdp': 1, 'tensor': 1}" in out
  assert "rollout engine: batch buckets (4, 2, 1)" in out
  assert "sequence buckets (64, 128, 132)" in out
  assert "memory" in out and "GiB" in out
  assert "data: 4 train examples (arithmetic)" in out and "2 steps per epoch" in out
  assert "processes: one" in out
  assert not (tmp_path / "run").exists()
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--dry_run",
                  "--coordinator_address=10.0.0.1:8476", "--num_processes=4", "--process_id=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "processes: 4 meeting at 10.0.0.1:8476" in proc.stdout
  assert "1 steps per epoch" in proc.stdout  # 4 examples, 2 prompts a step on each of 4
  # A run that cannot fit: the plan says so and the dry run fails as the run would (exit 2).
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--dry_run",
                  "--device_memory_gib=0.001", "--remat")
  assert "device memory 0.00 GiB: DOES NOT FIT" in proc.stdout
  assert "each layer recomputed in the backward pass (--remat)" in proc.stdout
  assert_one_line_error(proc, 2, "the run does not fit in --device_memory_gib (0.00 GiB per "
                        "device)")
  assert not (tmp_path / "run").exists()


def test_prompt_longer_than_max_prompt_len_is_refused_before_anything_is_written(
    tmp_path, tiny_model):
  """Every train and eval prompt is measured up front: a too-small --max_prompt_len is a usage
  error naming the longest prompt, not a failure steps into the run (which would have written
  run_config.json with the bad value and refused the corrected rerun)."""
  run_dir = tmp_path / "run"
  proc = run_main(*tiny_flags(tiny_model, run_dir), "--max_prompt_len=16")
  assert_one_line_error(proc, 2, "--max_prompt_len=16: the prompt of train example arith-train-",
                        "raise it to at least")
  assert not run_dir.exists()
  proc = run_main(*tiny_flags(tiny_model, run_dir), "--only_check_args")
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_mesh_that_the_devices_cannot_hold_is_one_line(tmp_path, tiny_model):
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--mesh_data=3", "--dry_run")
  assert_one_line_error(proc, 2, "--mesh_data=3 --mesh_fsdp=1 --mesh_tensor=1: ", "devices")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, content, message", [
    ("run_config.json", '{"fingerprint": "ab", "config": {', "run_config.json: invalid JSON"),
    ("metrics.jsonl", '{"step": 1\n{"step": 2}\n', "metrics.jsonl:1: invalid JSON"),
], ids=["run_config", "metrics"])
def test_unreadable_run_dir_file_is_one_line_and_changes_nothing(tmp_path, tiny_model, name,
                                                                 content, message):
  """A resume reads run_config.json and metrics.jsonl back: either one unreadable stops it
  before anything in the run directory changes."""
  run_dir = tmp_path / "run"
  flags = tiny_flags(tiny_model, run_dir)
  write_run_config(run_dir, parse_flags(flags))
  (run_dir / name).write_text(content)
  before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
  proc = run_main(*flags, "--num_steps=2")  # a resumable change: run_config.json would be
  assert_one_line_error(proc, 1, message)   # rewritten once the inputs pass
  assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_resume_over_changed_data_is_refused(tmp_path, tiny_model):
  """The flags name the data, not its contents: a run directory records a fingerprint of its
  training examples, and a resume over other examples (a dataset file edited in place) stops
  before anything changes."""
  run_dir = tmp_path / "run"
  flags = tiny_flags(tiny_model, run_dir)
  write_run_config(run_dir, parse_flags(flags), data={"examples": 4, "sha256": "0" * 64})
  before = (run_dir / "run_config.json").read_bytes()
  proc = run_main(*flags)
  assert_one_line_error(proc, 1, "run_config.json: the run's data changed",
                        '"examples": 4, "sha256": "000', "use a new run directory")
  assert (run_dir / "run_config.json").read_bytes() == before
  assert sorted(p.name for p in run_dir.iterdir()) == ["run_config.json"]


def test_config_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, tiny_model):
  proc = run_main(*tiny_flags(tiny_model, tmp_path / "run"), "--device_memory_gib=0.000001")
  assert_one_line_error(proc, 2, "does not fit in --device_memory_gib", "parameters",
                        "optimiser state", "KV cache")
  assert not (tmp_path / "run").exists()
