"""Command line entry point: flags -> Config -> `trainer.run(config)`.

  python -m rhyme_jax.main --flagfile=configs/quickstart.flags

A bad flag value, a malformed or empty dataset, or a run directory written by another config
ends the program with a one-line error (exit status 2 for flags, 1 otherwise) before anything
in the run directory is overwritten.
"""

from __future__ import annotations

import sys

from absl import app, flags
from absl import logging as absl_logging

from rhyme_jax.config import ConfigError, config_from_flags, define_flags

define_flags(flags.FLAGS)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # Library INFO chatter (orbax logs every file it writes) off; the progress line reports.
  absl_logging.set_verbosity(absl_logging.WARNING)
  try:
    config = config_from_flags(flags.FLAGS)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  # Imported here so `--help` and flag errors do not pay for importing JAX.
  from rhyme_jax.checkpoint import RunConfigMismatchError
  from rhyme_jax.data.datasets import DatasetError
  from rhyme_jax.rl import trainer
  try:
    trainer.run(config)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except (DatasetError, RunConfigMismatchError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def run_main():
  app.run(main)


if __name__ == "__main__":
  run_main()
