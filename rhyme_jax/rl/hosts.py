"""What hosts tell each other at a step boundary (the design: `rhyme_jax.multihost`).

Each process samples its own prompts on its own engine and scores its own groups (a group
never leaves the host that sampled it before its advantages are computed, and the learner
trains on each host's kept groups as that host's rows of the global batch). At the end of a
step's rollout the hosts exchange:

  * the groups each sampled (`GroupRecord`s), so that every host records all of them in the
    history store, in process order: the stores stay identical (the checkpoint written by
    process 0 holds every host's) and a prompt's next visit drafts from its last responses
    whichever host it lands on; and so that the logged metrics cover every sample;
  * their rollout counters and how many groups each kept (the update runs when any host
    kept one: every process must enter the same collective program);
  * at a checkpoint, their data-iterator states (`data_states`): each host reads its own
    slice of the prompt stream, and only process 0 writes the checkpoint's host state.

With one process every exchange is the identity: nothing is serialised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from rhyme_jax import multihost
from rhyme_jax.rl.rollouts import combine_stats
from rhyme_jax.rl.samples import GroupRecord


@dataclasses.dataclass
class SharedStep:
  """A step's rollout as every host sees it after the exchange."""

  records: list[GroupRecord]  # every host's groups, process by process
  stats: dict[str, Any]  # counters summed over hosts, wall times the longest
  kept: int  # groups kept for training, all hosts


def share_step(records: Sequence[GroupRecord], stats: dict[str, Any], kept: int) -> SharedStep:
  """Exchanges this host's sampled groups, counters and kept count with every other host."""
  if jax.process_count() == 1:
    return SharedStep(list(records), dict(stats), kept)
  plain = {k: v.item() if hasattr(v, "item") else v for k, v in stats.items()}
  mine = {"records": [r.to_json() for r in records], "stats": plain, "kept": kept}
  hosts = multihost.allgather_json(mine)
  return SharedStep([GroupRecord.from_json(r) for h in hosts for r in h["records"]],
                    combine_stats([h["stats"] for h in hosts]), sum(h["kept"] for h in hosts))


def data_states(state: dict) -> list[dict]:
  """Every process's data-iterator state, in process order (a collective)."""
  return multihost.allgather_json(state)


def my_data_state(saved: Any, process_index: int, process_count: int, where: str) -> dict:
  """This process's data-iterator state from a checkpoint's host state.

  `saved` is the list `data_states` gathered (or, from a checkpoint older than per-process
  states, one process's dict). A checkpoint written by a different number of processes
  cannot be resumed: each process's place in the prompt stream depends on the count.
  """
  states = [saved] if isinstance(saved, dict) else list(saved)
  if len(states) != process_count:
    raise ValueError(f"{where}: written by {len(states)} process(es), this run has "
                     f"{process_count}; resume with {len(states)} (each process's place in the "
                     "prompt stream depends on the count) or use a new --run_dir")
  return states[process_index]
