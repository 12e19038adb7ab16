"""Flags -> Config: defaults, every shipped flag file parses, bad values name the flag."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from rhyme_jax.config import Config, ConfigError, ids_per_step, parse_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.flags")))


def test_defaults_are_valid_and_frozen():
  c = parse_flags(["--run_dir=/tmp/r"])
  assert isinstance(c, Config)
  assert c.rollout.spec == "histospec" and c.data.task == "arithmetic"
  assert c.reward_name == "arithmetic"
  assert c.rl.samples_per_step == c.rl.group_size * c.rl.prompts_per_step
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.rl.group_size = 3  # type: ignore[misc]


def test_task_default_reward_and_override():
  assert parse_flags(["--run_dir=r", "--task=gsm8k"]).reward_name == "gsm8k+0.1*format"
  assert parse_flags(["--run_dir=r", "--reward=math_verify"]).reward_name == "math_verify"


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_parse_and_document_their_command(path):
  c = parse_flags([f"--flagfile={path}"])
  first = open(path).read().splitlines()[:8]
  assert first[0].startswith("#")
  assert any("python -m rhyme_jax.main --flagfile=configs/" + os.path.basename(path) in line
             for line in first)
  assert c.run.run_dir


def test_quickstart_is_small():
  c = parse_flags([f"--flagfile={os.path.join(REPO, 'configs', 'quickstart.flags')}"])
  assert c.model.model == "smollm2-135m-instruct" and c.data.task == "arithmetic"
  assert c.rl.samples_per_step <= 32 and c.rollout.max_new_tokens <= 128
  assert c.rollout.spec == "histospec" and c.run.num_steps >= 30
  # Prompts are revisited: history exists for later epochs.
  assert c.run.num_steps * c.rl.prompts_per_step > c.data.train_size


@pytest.mark.parametrize("flag, message", [
    ("--spec=foo", "--spec=foo: expected one of histospec, none"),
    ("--draft_mode=fast", "--draft_mode=fast: expected one of sync, ahead, ahead_only"),
    ("--attention=cuda", "--attention=cuda: expected one of xla, pallas, pallas_interpret"),
    ("--schedule=lifo", "--schedule=lifo: expected one of fifo, history, alternate, probe"),
    ("--task=mnist", "--task=mnist: expected one of arithmetic, gsm8k"),
    ("--group_size=1", "--group_size=1: expected an integer >= 2"),
    ("--temperature=0", "--temperature=0.0: expected a finite number > 0"),
    ("--top_p=1.5", "--top_p=1.5: expected a number in (0, 1]"),
    ("--clip_eps_low=1.0", "--clip_eps_low=1.0: expected a number in [0, 1)"),
    ("--kl_estimator=k9", "--kl_estimator=k9: expected one of k1, k2, k3"),
    ("--loss_aggregation=sum", "--loss_aggregation=sum: expected one of token-mean, "
     "seq-mean-token-mean"),
    ("--advantage=ppo", "--advantage=ppo: expected one of grpo, rloo"),
    ("--micro_batch_size=3", "--micro_batch_size=3: expected 0 or a divisor of group_size * "
     "prompts_per_step = 16"),
    ("--overlong_buffer=1000", "--overlong_buffer=1000: expected 0 or at most "
     "--max_new_tokens=96"),
    ("--param_dtype=float8", "--param_dtype=float8: expected one of float32, bfloat16"),
    ("--dataset=data.csv", "--dataset=data.csv: expected empty (the task's own data) or a "
     ".jsonl / .parquet file path"),
    ("--mesh_fsdp=0", "--mesh_fsdp=0: expected an integer >= 1, or -1"),
    ("--num_steps=0", "--num_steps=0: expected an integer >= 1"),
    ("--learning_rate=-1", "--learning_rate=-1.0: expected a finite number > 0"),
    ("--coordinator_address=10.0.0.1", "--coordinator_address=10.0.0.1: expected host:port"),
    ("--coordinator_address=h:99999", "--coordinator_address=h:99999: expected host:port"),
    ("--num_processes=2", "--num_processes=2 --process_id=-1: expected both"),
    ("--process_id=0", "--num_processes=0 --process_id=0: expected both"),
    ("--num_processes=-1", "--num_processes=-1: expected an integer >= 0"),
    ("--compile_threads=-2", "--compile_threads=-2: expected an integer >= 0"),
    ("--multi_step=0", "--multi_step=0: expected in [1, 64]"),
    ("--multi_step=65", "--multi_step=65: expected in [1, 64]"),
    ("--drain_steps=some", "--drain_steps=some: expected one of multi, cost, single"),
    ("--history_epochs=0", "--history_epochs=0: expected an integer >= 1"),
    ("--draft_budget=32", "--draft_budget=32: expected an integer in [1, 32)"),
    ("--draft_budget=0", "--draft_budget=0: expected an integer in [1, 32)"),
    ("--seed=4294967296", "--seed=4294967296: expected an integer in [0, 2^32)"),
    ("--seed=-1", "--seed=-1: expected an integer in [0, 2^32)"),
])
def test_bad_values_name_the_flag(flag, message):
  with pytest.raises(ConfigError) as e:
    parse_flags(["--run_dir=/tmp/r", flag])
  assert message in str(e.value)


def test_divided_rollout_flags():
  """--divide_every needs park rows and an order that re-ranks running requests."""
  ok = parse_flags(["--run_dir=/tmp/r", "--schedule=residual", "--divide_every=32",
                    "--park_rows=16"]).rollout
  assert (ok.divide_every, ok.park_rows) == (32, 16)
  with pytest.raises(ConfigError, match=r"^--park_rows=0: expected >= 1 with --divide_every"):
    parse_flags(["--run_dir=/tmp/r", "--schedule=residual", "--divide_every=32"])
  with pytest.raises(ConfigError, match=r"^--divide_every=32: expected 0 unless --schedule is"):
    parse_flags(["--run_dir=/tmp/r", "--schedule=history", "--divide_every=32",
                 "--park_rows=4"])


def test_distributed_flags():
  c = parse_flags(["--run_dir=/tmp/r", "--coordinator_address=10.0.0.1:1234",
                   "--num_processes=4", "--process_id=3"]).distributed
  assert (c.coordinator_address, c.num_processes, c.process_id) == ("10.0.0.1:1234", 4, 3)
  with pytest.raises(ConfigError, match=r"^--process_id=4: expected an index in \[0, "
                     r"--num_processes=4\)$"):
    parse_flags(["--run_dir=/tmp/r", "--num_processes=4", "--process_id=4"])
  default = parse_flags(["--run_dir=/tmp/r"]).distributed
  assert (default.coordinator_address, default.num_processes, default.process_id) == ("", 0, -1)


def test_unparsable_and_unknown_flags():
  with pytest.raises(ConfigError, match="group_size"):
    parse_flags(["--run_dir=r", "--group_size=four"])
  with pytest.raises(ConfigError, match="no_such_flag"):
    parse_flags(["--run_dir=r", "--no_such_flag=1"])


def test_missing_run_dir_and_two_free_mesh_axes():
  with pytest.raises(ConfigError, match="--run_dir"):
    parse_flags([])
  with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
    parse_flags(["--run_dir=r", "--mesh_data=-1", "--mesh_tensor=-1"])


def test_request_ids_fit_int32():
  c = parse_flags(["--run_dir=r", "--dynamic_sampling", "--dynamic_sampling_max_rounds=4"])
  assert ids_per_step(c) == 4 * c.rl.samples_per_step
  with pytest.raises(ConfigError, match="--num_steps=1000000000"):
    parse_flags(["--run_dir=r", "--num_steps=1000000000"])


def test_draft_modes_match_the_engine():
  from rhyme_jax import config as config_lib
  from rhyme_jax.rollout import engine
  assert config_lib.DRAFT_MODES == engine.DRAFT_MODES
  assert config_lib.DRAIN_STEPS == engine.DRAIN_STEPS
  assert set(config_lib.SPECULATE) == set(engine.SPECULATE) - {"never"}


def test_attention_flag_reaches_the_engine_config():
  """--attention defaults to the XLA path; its choice list is the one the engine and the model
  check against (one object), and the rollouts pass it to the engine."""
  from rhyme_jax import config as config_lib
  from rhyme_jax.models import attention
  from rhyme_jax.rl.rollouts import engine_config
  from rhyme_jax.rollout import interface
  assert parse_flags(["--run_dir=r"]).rollout.attention == "xla"
  assert attention.ATTENTIONS is config_lib.ATTENTIONS is interface.ATTENTIONS
  c = parse_flags(["--run_dir=r", "--attention=pallas"])
  assert engine_config(c, eos_ids=(2,), drafting=True).attention == "pallas"
  assert "rollout.attention" in config_lib.RESUMABLE_CHANGES  # same math, another kernel


def test_speculate_flag_reaches_the_engine_config():
  """--speculate=always forces speculative steps (acceptance at every step); --spec=none means
  plain steps whatever --speculate says; switching it on resume changes no sampled token."""
  from rhyme_jax import config as config_lib
  from rhyme_jax.rl.rollouts import engine_config
  assert parse_flags(["--run_dir=r"]).rollout.speculate == "auto"
  c = parse_flags(["--run_dir=r", "--speculate=always"])
  assert engine_config(c, eos_ids=(2,), drafting=True).speculate == "always"
  assert engine_config(c, eos_ids=(2,), drafting=False).speculate == "never"
  with pytest.raises(ConfigError, match="--speculate"):
    parse_flags(["--run_dir=r", "--speculate=never"])
  assert "rollout.speculate" in config_lib.RESUMABLE_CHANGES


def test_choice_lists_match_their_sources():
  """config.py imports nothing from the package, so each mirrored list is checked here."""
  from rhyme_jax import config as config_lib
  from rhyme_jax.data.prompts import PROMPT_TEMPLATES
  from rhyme_jax.rl import advantages, losses
  from rhyme_jax.rl.rewards import available_rewards
  from rhyme_jax.scheduling.plan import SCHEDULES
  assert set(config_lib.LOSSES) == set(losses.available_losses())
  assert set(config_lib.ADVANTAGES) == set(advantages.available_advantages())
  assert set(config_lib.TASKS) <= set(PROMPT_TEMPLATES)  # every task has its template
  assert losses.AGGREGATIONS is config_lib.AGGREGATIONS  # one object: the losses import it
  assert losses.KL_ESTIMATORS is config_lib.KL_ESTIMATORS
  assert tuple(SCHEDULES) == config_lib.SCHEDULES
  for task, reward in config_lib.TASK_REWARDS.items():
    assert task in config_lib.TASKS
    for term in reward.split("+"):
      assert term.split("*")[-1] in available_rewards(), (task, reward)


def test_loss_flag_selects_a_registered_loss():
  assert parse_flags(["--run_dir=r"]).rl.loss == "ppo_clip"
  with pytest.raises(ConfigError, match=r"--loss=sft: expected one of ppo_clip"):
    parse_flags(["--run_dir=r", "--loss=sft"])
