"""End-to-end GRPO on a tiny random Llama (SmolLM2's tokenizer and vocabulary, 1 layer, d=16).

* two steps in process: rollout -> reward -> update; parameters move, the engine gets them,
  the history store fills, a checkpoint is written;
* the same on an 8-device CPU mesh (data x fsdp x tensor = 2 x 2 x 2) with dynamic sampling,
  two optimisation epochs, micro-batches and a KL reference (subprocess: the device count must
  be set before JAX starts);
* SIGKILL mid-run, restart with the same command: the data seen and the metrics logged equal an
  uninterrupted run's (subprocesses).

The last two take minutes on 2 cores (several fresh JAX processes) and are marked slow:
`python -m pytest -q -m slow tests/rl/test_trainer.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import train_entry

from rhyme_jax.config import parse_flags
from rhyme_jax.rollout.engine import TRACE_COUNTS
from rhyme_jax.metrics import read_metrics
from rhyme_jax.rl.rollouts import without_timing

ENTRY = os.path.join(os.path.dirname(__file__), "train_entry.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return train_entry.write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def tiny_flags(model_dir, run_dir, *extra):
  return [f"--model={model_dir}", "--tokenizer=smollm2-135m-instruct", f"--run_dir={run_dir}",
          "--task=arithmetic", "--train_size=6", "--reward=test_parity", "--group_size=4",
          "--prompts_per_step=2", "--max_new_tokens=6", "--max_prompt_len=128",
          "--learning_rate=0.01", "--temperature=1.0", "--seed=3", *extra]


def entry_env(**extra):
  """The child imports this checkout's package (not an installed copy) and train_entry."""
  path = [REPO, os.path.dirname(ENTRY)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)


def run_entry(args, env_extra=None, **kw):
  env = entry_env(**(env_extra or {}))
  return subprocess.run([sys.executable, ENTRY, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, **kw)


def test_children_import_this_checkout():
  proc = subprocess.run([sys.executable, "-c", "import rhyme_jax; print(rhyme_jax.__file__)"],
                        cwd="/", env=entry_env(), capture_output=True, text=True, timeout=60)
  assert proc.stdout.strip() == os.path.join(REPO, "rhyme_jax", "__init__.py"), proc.stderr


def test_two_grpo_steps_update_the_policy(tiny_model, tmp_path, monkeypatch):
  train_entry.register_test_reward()
  from flax import nnx
  from rhyme_jax.rl import trainer
  config = parse_flags(tiny_flags(tiny_model, tmp_path / "run", "--num_steps=2",
                                  "--checkpoint_every=1", "--eval_every=2", "--eval_size=3"))
  t = trainer.Trainer(config)
  before = jax.tree.map(np.array, t.learner.params)
  traces = dict(TRACE_COUNTS)  # the engine was warmed up in the constructor
  history = t.run()
  assert dict(TRACE_COUNTS) == traces, "the rollouts or the greedy eval compiled"

  assert [len(h) > 0 for h in history] == [True, True]
  records = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert r["response_length/max"] <= 6
    assert 0.0 <= r["reward/mean"] <= 1.0
    assert np.isfinite(r["train/loss"]) and r["grad_norm"] > 0  # rewards differ in groups
    # Tokens per useful slot-step: 1 without accepted drafts (epoch 0 has no history; a
    # random model's siblings almost never agree), never below 1.
    assert 1.0 <= r["rollout/mean_accepted_length"] <= 1.1
    assert r["seq_len"] == 128
  assert "eval/accuracy" in records[1] and "eval/accuracy" not in records[0]
  # Both steps are data epoch 0: step 2 reports the epoch so far (equal sample counts).
  assert [r["epoch/index"] for r in records] == [0, 0]
  assert records[0]["epoch/reward"] == pytest.approx(records[0]["reward/mean"])
  assert records[1]["epoch/reward"] == pytest.approx(
      (records[0]["reward/mean"] + records[1]["reward/mean"]) / 2)
  assert records[1]["epoch/response_length"] == pytest.approx(
      (records[0]["response_length/mean"] + records[1]["response_length/mean"]) / 2)
  lo, hi = sorted(r["rollout/mean_accepted_length"] for r in records)
  assert lo - 1e-9 <= records[1]["epoch/accepted_length"] <= hi + 1e-9
  # Steps 1 and 2 are different prompts (train_size 6 = 3 steps per epoch).
  assert records[0]["data/batch_hash"] != records[1]["data/batch_hash"]

  after = jax.tree.map(np.array, t.learner.params)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before, after))
  assert max(moved) > 1e-4
  engine_params = jax.tree.map(np.array, nnx.split(nnx.merge(t.learner.graphdef, t.rollouts.engine.params))[1])
  for a, b in zip(jax.tree.leaves(engine_params), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)  # the engine samples from the updated policy
  assert len(t.rollouts.store) == 4  # 2 steps x 2 prompts recorded for the next epoch
  assert t.checkpointer.all_steps() == [1, 2]
  cfg = json.loads((tmp_path / "run" / "run_config.json").read_text())["config"]
  assert cfg["rollout"]["spec"] == "histospec"

  # Resumed for a third step, a SIGTERM during start-up (here in the engine's warm-up, where
  # jax.distributed's own handler would only log it) stops the run before that step: the
  # restored checkpoint stands, nothing is added, the handler before the run is back.
  warmup = trainer.Rollouts.warmup
  def warmup_then_sigterm(rollouts):
    warmup(rollouts)
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(trainer.Rollouts, "warmup", warmup_then_sigterm)
  handler = signal.getsignal(signal.SIGTERM)
  t = trainer.Trainer(parse_flags(tiny_flags(tiny_model, tmp_path / "run", "--num_steps=3",
                                             "--checkpoint_every=1", "--eval_every=2",
                                             "--eval_size=3")))
  assert t.step == 2 and t.run() == []
  assert t.checkpointer.all_steps() == [1, 2]
  assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
  assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.slow
def test_eight_device_mesh(tiny_model, tmp_path):
  """2x2x2 mesh, dynamic sampling, 2 PPO epochs, 2 micro-batches, KL to the reference,
  --remat (the layers' stacked states and the head's chunks sharded over fsdp and tensor)."""
  args = tiny_flags(tiny_model, tmp_path / "run", "--num_steps=2", "--mesh_data=2",
                    "--mesh_fsdp=2", "--mesh_tensor=2", "--remat", "--dynamic_sampling",
                    "--dynamic_sampling_max_rounds=2", "--ppo_epochs=2", "--micro_batch_size=4",
                    "--kl_beta=0.05", "--loss_aggregation=seq-mean-token-mean",
                    "--overlong_buffer=2")
  code = ("import jax; assert jax.device_count() == 8, jax.devices(); "
          "import runpy, sys; sys.argv = [sys.argv[0]] + sys.argv[1:]; "
          f"runpy.run_path({ENTRY!r}, run_name='__main__')")
  env = entry_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert np.isfinite(r["train/loss"])
    assert r["rollout/groups_kept"] <= 2
    assert 1 <= r["rollout/rounds"] <= 2
    if r["rollout/groups_kept"]:  # trained: the second epoch starts away from the reference
      assert r["kl"] > 0.0
  # The second epoch of step 2 starts from moved parameters: KL to the reference is non-zero.
  assert records[1]["kl"] > 0.0


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(tiny_model, tmp_path):
  steps = ["--num_steps=5", "--checkpoint_every=1", "--keep_checkpoints=2"]
  ref = run_entry(tiny_flags(tiny_model, tmp_path / "ref", *steps), timeout=600)
  assert ref.returncode == 0, ref.stderr[-3000:]

  run_dir = tmp_path / "killed"
  args = tiny_flags(tiny_model, run_dir, *steps)
  proc = subprocess.Popen([sys.executable, ENTRY, *args], cwd=REPO, env=entry_env(),
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline:  # kill once step 3 is logged (checkpoints 1-2 exist or not)
    if metrics.exists() and any(r["step"] >= 3 for r in read_metrics(metrics)):
      break
    assert proc.poll() is None, "the run ended before it could be killed"
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(r["step"] for r in read_metrics(metrics))
  assert killed_at < 5

  resumed = run_entry(args, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stderr
  got = read_metrics(metrics)
  want = read_metrics(tmp_path / "ref" / "metrics.jsonl")
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
  assert [r["data/batch_hash"] for r in got] == [r["data/batch_hash"] for r in want]
  assert without_timing(got) == without_timing(want)


@pytest.mark.slow
def test_dynamic_sampling_resumes_the_prompt_stream_where_its_rounds_stopped(tiny_model,
                                                                             tmp_path):
  """With --dynamic_sampling a step reads as many rounds of prompts as it needs to keep
  prompts_per_step informative groups, so the data iterator's place after a step depends on
  the rewards. A run stopped after 2 steps and resumed to 4 reads the stream where the second
  step's refills left it: the same batches, tokens and metrics as 4 steps uninterrupted."""
  flags = ["--dynamic_sampling", "--dynamic_sampling_max_rounds=3", "--group_size=2",
           "--checkpoint_every=1"]  # G = 2: half the groups all-equal, refills are common
  ref = run_entry(tiny_flags(tiny_model, tmp_path / "ref", "--num_steps=4", *flags),
                  timeout=600)
  assert ref.returncode == 0, ref.stderr[-3000:]
  want = read_metrics(tmp_path / "ref" / "metrics.jsonl")
  assert any(r["rollout/rounds"] > 1 for r in want[:2]), "no refill before the stop: no test"

  run_dir = tmp_path / "split"
  first = run_entry(tiny_flags(tiny_model, run_dir, "--num_steps=2", *flags), timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = run_entry(tiny_flags(tiny_model, run_dir, "--num_steps=4", *flags), timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stderr
  got = read_metrics(run_dir / "metrics.jsonl")
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  assert [r["data/batch_hash"] for r in got] == [r["data/batch_hash"] for r in want]
  assert without_timing(got) == without_timing(want)


@pytest.fixture(scope="module")
def reference_run(tiny_model, tmp_path_factory):
  """An uninterrupted 4-step run: what every interrupted-and-resumed run must reproduce."""
  run_dir = tmp_path_factory.mktemp("reference") / "run"
  proc = run_entry(tiny_flags(tiny_model, run_dir, "--num_steps=4"), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_sigterm_saves_exits_cleanly_and_resume_repeats_nothing(tiny_model, tmp_path,
                                                               reference_run):
  run_dir = tmp_path / "run"
  # No periodic checkpoint before the end: the only one at SIGTERM is the one it makes.
  args = tiny_flags(tiny_model, run_dir, "--num_steps=4", "--checkpoint_every=100")
  proc = subprocess.Popen([sys.executable, ENTRY, *args], cwd=REPO, env=entry_env(),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + 600
  while not (metrics.exists() and read_metrics(metrics)):
    assert proc.poll() is None and time.time() < deadline, "the run ended before SIGTERM"
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  stopped = max(r["step"] for r in read_metrics(metrics))
  assert stopped < 4 and f"stopped at step {stopped} (checkpoint saved)" in err
  assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [stopped]

  resumed = run_entry(args, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"at step {stopped}" in resumed.stderr
  got = read_metrics(metrics)
  assert [r["step"] for r in got] == [1, 2, 3, 4]  # nothing skipped, nothing repeated
  assert without_timing(got) == without_timing(reference_run)


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_to_the_previous(tiny_model, tmp_path,
                                                              reference_run):
  run_dir = tmp_path / "run"
  first = run_entry(tiny_flags(tiny_model, run_dir, "--num_steps=3", "--checkpoint_every=1",
                               "--keep_checkpoints=3"), timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  for p in (run_dir / "checkpoints" / "3").rglob("*"):
    if p.is_file() and p.stat().st_size and "params" in p.parts:
      os.truncate(p, p.stat().st_size // 2)
  resumed = run_entry(tiny_flags(tiny_model, run_dir, "--num_steps=4", "--checkpoint_every=1",
                                 "--keep_checkpoints=3"), timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "warning: checkpoint step 3 is unreadable (moved to " in resumed.stderr
  assert "at step 2" in resumed.stderr
  assert (run_dir / "corrupt_checkpoints" / "3").is_dir()  # kept aside; step 3 saved afresh
  assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 3, 4]
  got = read_metrics(run_dir / "metrics.jsonl")
  assert [r["step"] for r in got] == [1, 2, 3, 4]  # step 3 redone from step 2's state
  assert without_timing(got) == without_timing(reference_run)
