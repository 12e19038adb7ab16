"""The run's inputs, read and checked before anything is written: `check_inputs`.

Everything the user points a run at (flags that need the data or the model to judge, the
datasets, the model's header and tokenizer, every prompt's length, a resumed run directory's
run_config.json and metrics.jsonl) is read here, cheapest first, so that a bad one ends in one
line naming the flag, file, line or example before the run directory is created or changed
(`rhyme_jax.main` maps these errors to exit statuses).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import jinja2
from etils import epath

from rhyme_jax import metrics as metrics_lib
from rhyme_jax import parallel, run_config
from rhyme_jax.config import RESUMABLE_CHANGES, Config, ConfigError
from rhyme_jax.data.datasets import DatasetError, Example, load_examples
from rhyme_jax.data.example import examples_fingerprint
from rhyme_jax.data.prompts import PromptTemplate, get_prompt_template
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.loading import ModelError, read_model_config
from rhyme_jax.models.tokenizer import load_tokenizer
from rhyme_jax.rl.rewards import get_reward_fn
from rhyme_jax.rl.rewards.registry import RewardFn
from rhyme_jax.rl.samples import longest_prompt


@dataclasses.dataclass
class Inputs:
  """Everything the user points the run at, read and checked; nothing written yet."""

  reward_fn: RewardFn
  train_examples: list[Example]
  eval_examples: list[Example]
  tokenizer: Any
  template: PromptTemplate
  model_config: ModelConfig
  distributed: dict[str, Any] | None  # jax.distributed.initialize arguments; None: one process
  train_fingerprint: dict[str, Any]  # examples_fingerprint(train_examples): run_config's "data"


def check_inputs(config: Config) -> Inputs:
  """Reads every input's header, cheapest first; errors name the flag, file or line.

  Raises ConfigError (a flag), DatasetError, ModelError, RunConfigError or MetricsFileError.
  Writes nothing and touches no device.
  """
  c = config
  d = c.distributed
  try:
    distributed = parallel.distributed_settings(d.coordinator_address, d.num_processes,
                                                d.process_id)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  try:
    reward_fn = get_reward_fn(c.reward_name)
  except ValueError as e:
    raise ConfigError(f"--reward={c.reward_name}: {e}") from e
  train = load_examples(c.data.dataset or c.data.task, "train", data_dir=c.data.data_dir or None,
                        train_size=c.data.train_size)
  evals = (load_examples(c.data.eval_dataset or c.data.task, "test",
                         data_dir=c.data.data_dir or None)[:c.run.eval_size]
           if c.run.eval_every else [])
  for split, examples in (("train", train), ("eval", evals)):
    _check_references(reward_fn, examples, split, c.reward_name)
  data = examples_fingerprint(train)
  run_dir = epath.Path(c.run.run_dir)
  if run_dir.exists() and not run_dir.is_dir():
    raise ConfigError(f"--run_dir={c.run.run_dir}: exists and is not a directory")
  _check_local_dir_writable(c.run.run_dir)
  if (run_dir / run_config.RUN_CONFIG_FILE).exists():
    run_config.check_run_config(run_dir, c, data=data, allow_changed=RESUMABLE_CHANGES)
  if (run_dir / metrics_lib.METRICS_FILE).exists():  # a resume keeps its records: readable?
    metrics_lib.read_metrics(run_dir / metrics_lib.METRICS_FILE)
  model_config = read_model_config(c.model.model, param_dtype=param_dtype(c))
  flag = "tokenizer" if c.model.tokenizer else "model"
  try:
    tokenizer = load_tokenizer(c.model.tokenizer or c.model.model)
  except (ValueError, OSError) as e:
    raise ModelError(f"--{flag}={c.model.tokenizer or c.model.model}: {e}") from e
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(f"--{flag}: vocabulary of {tokenizer.vocab_size} tokens is larger than "
                      f"the model's ({model_config.vocab_size})")
  template = get_prompt_template(c.data.task)
  for split, examples in (("train", train), ("eval", evals)):  # before anything is written
    try:
      longest, uid = longest_prompt(examples, tokenizer, template)
    except (ValueError, jinja2.TemplateError) as e:  # no template, or one that cannot render
      why = str(e) if str(e).startswith("chat template") else f"chat template: {e}"
      raise ModelError(f"--{flag}={c.model.tokenizer or c.model.model}: {why}") from e
    if longest > c.rollout.max_prompt_len:
      raise ConfigError(f"--max_prompt_len={c.rollout.max_prompt_len}: the prompt of {split} "
                        f"example {uid} has {longest} tokens, the most of the "
                        f"{len(examples)} {split} prompts; raise it to at least {longest}")
  return Inputs(reward_fn, train, evals, tokenizer, template, model_config, distributed, data)


# A final answer in each form the rewards read (boxed, '####'), so that scoring it parses the
# example's reference: an answer the reward cannot read fails here, not steps into the run.
_PROBE_COMPLETION = "The answer is \\boxed{0}.\n#### 0"


def _check_local_dir_writable(run_dir: str) -> None:
  """A local --run_dir must be a directory this process can write, or creatable in one: the
  nearest existing ancestor is checked (nothing is created here). A URI (gs://) is left to its
  file system."""
  if "://" in run_dir:
    return
  probe = os.path.abspath(run_dir)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
    why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
    raise ConfigError(f"--run_dir={run_dir}: cannot be written ({probe} {why})")


def _check_references(reward_fn: RewardFn, examples, split: str, name: str) -> None:
  """Every example's reference answer, as the reward reads it (math_verify: ~1 ms each)."""
  for e in examples:
    try:
      reward_fn.score(_PROBE_COMPLETION, e)
    except ValueError as err:
      meta = e.meta or {}
      where = (f"{meta['source']}:{meta['line']}" if "source" in meta and "line" in meta
               else f"{split} example {e.uid}")
      raise DatasetError(f"{where}: --reward={name}: {err}") from err


def param_dtype(c: Config):
  """The parameters' dtype for the model loaders: None keeps the checkpoint's float32."""
  return None if c.model.param_dtype == "float32" else jnp.bfloat16
