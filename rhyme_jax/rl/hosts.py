"""What hosts tell each other at a step boundary (the design: `rhyme_jax.multihost`).

Each process samples its own prompts on its own engine and scores its own groups (without
--balance_hosts a group never leaves the host that sampled it before its advantages are
computed, and the learner trains on each host's kept groups as that host's rows of the global
batch). At the end of a
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

With --balance_hosts every host reads the whole round and samples the prompts a `HostPlan`
gives it: longest-processing-time first over their predicted work (HistoPipe's balancing of
data-parallel rollout, `scheduling.assignment.plan_hosts`), computed alike on every host from
the identical history stores, so no host waits on another for the plan. A prompt keeps the
request ids of its place in the round (`Rollouts.sample_round`'s positions), so it samples the
same tokens on whichever host; the groups, exchanged after each round with their log-probs,
are put back in data order (`in_data_order`) and each host trains on its own slice of the kept
groups (`balanced_rounds`). Without dynamic sampling that is the unbalanced run's data,
samples and per-host groups, with the hosts' rollout times evened. A prompt is decoded in
another batch shape, though, so its rollout log-probs (the loss's importance weight) may differ
in their last bits, and a token at a near-tie could too, as under any admission order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rhyme_jax import multihost
from rhyme_jax.rl.rollouts import combine_stats
from rhyme_jax.rl.samples import GroupRecord, Prompt, Sample
from rhyme_jax.scheduling.assignment import plan_hosts
from rhyme_jax.scheduling.predictor import LengthPredictor


@dataclasses.dataclass(frozen=True)
class HostPlan:
  """Which prompts of a round (all hosts', data order) each host samples (--balance_hosts)."""

  hosts: list[list[int]]  # per host, the round positions of the prompts it samples, ascending
  work: np.ndarray  # int64 predicted tokens per prompt (G x predicted length)

  @classmethod
  def make(cls, prompts: Sequence[Prompt], predictor: LengthPredictor, group_size: int,
           num_hosts: int) -> "HostPlan":
    if len(prompts) % num_hosts:
      raise ValueError(f"HostPlan: {len(prompts)} prompts do not split over {num_hosts} hosts")
    return cls(*plan_hosts([p.key for p in prompts], group_size, predictor, num_hosts))

  @property
  def per_host(self) -> int:
    """Prompts in each host's slice of the round (what it samples without balancing)."""
    return len(self.work) // len(self.hosts)

  def sampled_order(self) -> list[int]:
    """Round positions in the order the exchange returns their groups (host by host)."""
    return [q for mine in self.hosts for q in mine]

  def slices(self) -> list[list[int]]:
    """What each host samples without balancing: its own slice of the round."""
    b = self.per_host
    return [list(range(h * b, (h + 1) * b)) for h in range(len(self.hosts))]

  def metrics(self, records: Sequence[GroupRecord]) -> dict[str, float]:
    """Groups sampled off their slice's host; the busiest host's predicted work and its true
    tokens (`records`: the round's groups in data order) over the hosts' mean, with this plan
    and with the slices (1 = even). A prompt samples the same tokens on any host, so the
    slices' true figure is exact, not an estimate."""
    tokens = np.array([sum(len(r) for r in g.responses) for g in records], np.int64)
    ratio = lambda per, hosts: (max(int(per[m].sum()) for m in hosts)
                                / max(float(per.sum()) / len(hosts), 1e-9))
    return {"schedule/host_groups_moved": sum(q // self.per_host != h
                                              for h, mine in enumerate(self.hosts) for q in mine),
            "schedule/host_work_ratio": ratio(self.work, self.hosts),
            "schedule/host_work_ratio_slices": ratio(self.work, self.slices()),
            "schedule/host_tokens_ratio": ratio(tokens, self.hosts),
            "schedule/host_tokens_ratio_slices": ratio(tokens, self.slices())}


def in_data_order(records: Sequence[GroupRecord], plan: HostPlan,
                  prompts: Sequence[Prompt]) -> list[GroupRecord]:
  """Every host's exchanged groups (process order: `plan.sampled_order()`) in round order,
  each checked against the round's prompt at its place: a host whose plan differed (its
  history store or data order not the others') sampled other prompts, and its groups would
  otherwise be trained on as the wrong prompts' answers."""
  order = plan.sampled_order()
  if len(records) != len(order):
    raise ValueError(f"in_data_order: {len(records)} groups for a plan of {len(order)}")
  out: list[Any] = [None] * len(order)
  for record, q in zip(records, order):
    want = prompts[q]
    if (record.uid, record.key, record.epoch) != (want.example.uid, want.key, want.epoch):
      raise ValueError(
          f"--balance_hosts: the hosts derived different plans: round position {q} came back "
          f"as prompt {record.uid!r} (epoch {record.epoch}) where this host's plan has "
          f"{want.example.uid!r} (epoch {want.epoch}); every host must hold the same history "
          f"store and read the same data")
    out[q] = record
  return out


def informative(record: GroupRecord) -> bool:
  """Whether dynamic sampling keeps a group: its rewards are not all equal."""
  return len(set(record.rewards)) > 1


def _round_rule(config) -> tuple[int, Callable[[GroupRecord], bool]]:
  """(rollout rounds a step may read, whether a sampled group is kept): with
  --dynamic_sampling up to its most rounds, keeping `informative` groups; else one, all kept."""
  if config.rl.dynamic_sampling:
    return config.rl.dynamic_sampling_max_rounds, informative
  return 1, lambda record: True


@dataclasses.dataclass
class StepRounds:
  """A step's rollout rounds on this host (`local_rounds`, `balanced_rounds`)."""

  mine: list[list[Sample]]  # the groups this host trains on
  to_send: list[GroupRecord]  # local_rounds: this host's sampled groups, for `share_step`
  # balanced_rounds: every host's groups, exchanged round by round, in data order (else None)
  held: list[GroupRecord] | None
  metrics: dict[str, float]  # schedule/host_* figures of balanced rounds (none otherwise)

  def share(self, stats: dict[str, Any]) -> "SharedStep":
    """The step as every host sees it (`share_step` with what these rounds hold or send)."""
    return share_step(self.to_send, stats, len(self.mine), held=self.held)


def local_rounds(next_round: Callable[[], Sequence[Prompt]], rollouts, config, step: int,
                 stats: dict[str, Any]) -> StepRounds:
  """Without --balance_hosts: a step's rollout rounds over this host's own slice of prompts.

  With --dynamic_sampling, only groups whose rewards differ (`informative`) are kept and the
  host reads further rounds of its slice until it kept prompts_per_step or ran the most rounds;
  hosts may read different numbers of rounds. Every sampled group is recorded, kept or not."""
  per_host = config.rl.prompts_per_step
  rounds, keeps = _round_rule(config)
  kept, records = [], []
  for r in range(rounds):
    groups = rollouts.sample_round(next_round(), step, r, stats)
    new = [GroupRecord.of(g) for g in groups]
    records += new
    kept += [g for g, rec in zip(groups, new) if keeps(rec)]
    if len(kept) >= per_host:
      break
  return StepRounds(kept[:per_host], records, None, {})


def balanced_rounds(next_round: Callable[[], Sequence[Prompt]], rollouts, config, step: int,
                    process_index: int, process_count: int, stats: dict[str, Any]
                    ) -> StepRounds:
  """--balance_hosts: a step's rollout rounds, each the whole batch of every host's prompts.

  Per round every host derives the same `HostPlan`, samples its share (request ids by round
  position), and the hosts exchange the round's groups with their log-probs, which every host
  then holds in data order. The kept groups are the rounds' in data order (with
  --dynamic_sampling only those whose rewards differ); rounds go on, on every host alike, until
  the hosts together kept prompts_per_step x hosts groups or ran the most rounds, and host p
  trains on the p-th slice of them. Without dynamic sampling (one round) that slice is its
  own slice of the batch, as in the unbalanced run. With it the refill is
  global, a round read by all hosts or none, where unbalanced hosts refill their own slices
  and may read different numbers of rounds."""
  c = config
  per_host = c.rl.prompts_per_step
  rounds, keeps = _round_rule(c)
  records, kept, mets = [], [], []
  for r in range(rounds):
    prompts = next_round()
    plan = HostPlan.make(prompts, rollouts.predictor, c.rl.group_size, process_count)
    mine = plan.hosts[process_index]
    groups = rollouts.sample_round([prompts[q] for q in mine], step, r, stats, positions=mine)
    sent = [GroupRecord.of(g, logprobs=True).to_json() for g in groups]
    got = [GroupRecord.from_json(x) for host in multihost.allgather_json(sent) for x in host]
    in_order = in_data_order(got, plan, prompts)
    records += in_order
    mets.append(plan.metrics(in_order))
    kept += [(prompts[q], g) for q, g in enumerate(in_order) if keeps(g)]
    if len(kept) >= per_host * process_count:
      break
  kept = kept[:per_host * process_count]
  mine = [g.samples(p) for p, g in kept[process_index * per_host:(process_index + 1) * per_host]]
  metrics = {k: float(sum(m[k] for m in mets) if k.endswith("moved")
                      else np.mean([m[k] for m in mets])) for k in mets[0]}
  return StepRounds(mine, [], records, metrics)


@dataclasses.dataclass
class SharedStep:
  """A step's rollout as every host sees it after the exchange."""

  records: list[GroupRecord]  # every host's groups, process by process
  stats: dict[str, Any]  # counters summed over hosts, wall times the longest
  kept: int  # groups kept for training, all hosts


def share_step(records: Sequence[GroupRecord], stats: dict[str, Any], kept: int,
               held: Sequence[GroupRecord] | None = None) -> SharedStep:
  """Exchanges this host's sampled groups, counters and kept count with every other host.
  `held`: the step's groups as every host already holds them (`balanced_rounds` exchanged
  them round by round), so none are sent; `records` is then empty."""
  if held is not None and records:
    raise ValueError("share_step: groups both held by every host and to be sent")
  if jax.process_count() == 1:
    return SharedStep(list(records if held is None else held), dict(stats), kept)
  plain = {k: v.item() if hasattr(v, "item") else v for k, v in stats.items()}
  mine = {"records": [r.to_json() for r in records], "stats": plain, "kept": kept}
  hosts = multihost.allgather_json(mine)
  got = [GroupRecord.from_json(r) for h in hosts for r in h["records"]]
  return SharedStep(got if held is None else list(held),
                    combine_stats([h["stats"] for h in hosts]), sum(h["kept"] for h in hosts))


def data_states(state: dict) -> list[dict]:
  """Every process's data-iterator state, in process order (a collective)."""
  return multihost.allgather_json(state)


def my_data_state(saved: Any, process_index: int, process_count: int, where: str, *,
                  balanced: bool = False) -> dict:
  """This process's data-iterator state from a checkpoint's host state.

  `saved` is the list `data_states` gathered (or, from a checkpoint older than per-process
  states, one process's dict). A checkpoint written by a different number of processes
  cannot be resumed: each process's place in the prompt stream depends on the count.
  `balanced` (--balance_hosts) reads whole rounds, so every host must resume at one round:
  a run with --dynamic_sampling but without --balance_hosts leaves hosts at different rounds,
  and no whole round resumes it without skipping one host's prompts or repeating another's.
  """
  states = [saved] if isinstance(saved, dict) else list(saved)
  if len(states) != process_count:
    raise ValueError(f"{where}: written by {len(states)} process(es), this run has "
                     f"{process_count}; resume with {len(states)} (each process's place in the "
                     "prompt stream depends on the count) or use a new --run_dir")
  if balanced and any(s != states[0] for s in states):
    places = ", ".join(str(s.get("next_index", s)) for s in states)
    raise ValueError(f"{where}: the hosts stopped at different rounds of the prompt stream "
                     f"({places}), as --dynamic_sampling without --balance_hosts leaves them; "
                     "--balance_hosts reads whole rounds and cannot resume them without "
                     "skipping or repeating prompts: resume without --balance_hosts or use a "
                     "new --run_dir")
  return states[process_index]
