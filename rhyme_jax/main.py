"""Command line entry point: flags -> Config -> checked inputs -> `Trainer(...).run()`.

  python -m rhyme_jax.main --flagfile=configs/quickstart.flags
  python -m rhyme_jax.main --flagfile=configs/quickstart.flags --dry_run   # the plan, no run
  python -m rhyme_jax.main --helpfull                                     # every flag

Every error a user can cause ends in one line naming the flag, file, line or tensor at fault,
with exit status 2 for usage (an unknown or unparsable flag, a bad value) and 1 for the rest
(a missing / truncated / malformed model, dataset or checkpoint, a run directory written by
another config). Nothing is written to the run directory before every input has been read
and checked. SIGTERM (a preempted VM) saves a checkpoint at the next step boundary and exits 0;
rerunning the same command resumes from it. One process of several that fails exits at once,
so the others are stopped by jax.distributed (a heartbeat timeout) rather than wait forever.
"""

from __future__ import annotations

import os
import sys
import traceback

from absl import app, flags
from absl import logging as absl_logging

from rhyme_jax import config as config_lib
from rhyme_jax.config import ConfigError, config_from_flags, define_flags

define_flags(flags.FLAGS)
flags.adopt_module_key_flags(config_lib)  # `--help` lists the project's flags
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the flags, read the model and data "
                             "headers, print the plan (mesh, buckets, memory) and exit; "
                             "writes nothing.")

USAGE_ERROR = 2
INPUT_ERROR = 1


def _fail(status: int, message: str):
  print(f"error: {message}", file=sys.stderr)
  _exit(status)


def _exit(status: int):
  """Exits; one process of several exits at once, skipping jax.distributed's shutdown barrier
  (the others are not coming to it: they wait in the run's next collective), so the
  coordination service fails them within its heartbeat timeout instead of every host hanging."""
  jax = sys.modules.get("jax")
  if jax is not None and jax.distributed.is_initialized():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


def _one_line(e: Exception) -> str:
  return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _input_errors() -> tuple[type[Exception], ...]:
  """Exceptions that mean "bad input" (each message names its file / field), not a bug."""
  from rhyme_jax.checkpoint import CheckpointError
  from rhyme_jax.data.datasets import DatasetError
  from rhyme_jax.metrics import MetricsFileError
  from rhyme_jax.models.loading import ModelError
  from rhyme_jax.run_config import RunConfigError
  return (DatasetError, ModelError, CheckpointError, RunConfigError, MetricsFileError,
          FileNotFoundError)


def _config():
  try:
    return config_from_flags(flags.FLAGS)
  except ConfigError as e:
    _fail(USAGE_ERROR, str(e))


def _checked_inputs(config):
  # Imported here so `--help` and flag errors do not pay for importing JAX.
  from rhyme_jax.rl import inputs
  try:
    return inputs.check_inputs(config)
  except ConfigError as e:
    _fail(USAGE_ERROR, str(e))
  except _input_errors() as e:
    _fail(INPUT_ERROR, _one_line(e))


def parse_flags(argv):
  """absl's parser with this program's exit statuses: 2 for a usage error, 0 for --help."""
  if any(a in ("-h", "-help", "--help", "--helpshort", "-?") for a in argv[1:]):
    app.usage(shorthelp=True, writeto_stdout=True)
    sys.exit(0)
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    _fail(USAGE_ERROR, f"{e} (see --help)")
  if flags.FLAGS["only_check_args"].value:  # absl would exit 0 without looking at the values
    absl_logging.set_verbosity(absl_logging.WARNING)
    config = _config()
    _dry_run(config, _checked_inputs(config))
    sys.exit(0)
  return rest


def _dry_run(config, inputs) -> None:
  """--dry_run (and --only_check_args): the plan, then the memory check a run makes before it
  loads weights; a run that cannot fit exits as a flag error would (2)."""
  from rhyme_jax.rl import trainer
  try:
    print(trainer.describe_plan(config, inputs))
    trainer.check_plan_fits(config, inputs)
  except ConfigError as e:
    _fail(USAGE_ERROR, str(e))
  except _input_errors() as e:
    _fail(INPUT_ERROR, _one_line(e))


def main(argv):
  if len(argv) > 1:
    _fail(USAGE_ERROR, f"unexpected arguments: {' '.join(argv[1:])}")
  # Library INFO chatter (orbax logs every file it writes) off; the progress line reports.
  absl_logging.set_verbosity(absl_logging.WARNING)
  config = _config()
  inputs = _checked_inputs(config)
  if _DRY_RUN.value:
    return _dry_run(config, inputs)
  from rhyme_jax.rl import trainer
  try:
    t = trainer.Trainer(config, inputs)
    t.run()
  except ConfigError as e:
    _fail(USAGE_ERROR, str(e))
  except _input_errors() as e:
    _fail(INPUT_ERROR, _one_line(e))
  except Exception:  # a bug, or a failure of this host: the traceback, then out (see _exit)
    traceback.print_exc()
    _exit(INPUT_ERROR)


def run_main():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run_main()
