"""Rollout orchestration: prompts -> engine requests -> scored sample groups.

`Rollouts` owns the engine, the sampling parameters, the history store (with
`--spec=histospec` or a history-based `--schedule`) and the history drafter (with
`--spec=histospec`). `sample_round` samples G responses for a batch of prompts in the
`--schedule` admission order (`scheduling.plan_step`: lengths predicted from the store);
`record` adds finished groups to the store (every host's, in process order, so the store is
the same on all hosts and a prompt's next visit drafts from it and is scheduled by it wherever
it lands); `evaluate` decodes held-out prompts greedily. With `--record_rollouts` every round's
sampled tokens are also written to RUN_DIR/rollouts/ (`history.recording`), so drafters can be
replayed against this run's epochs offline. Request ids are a function of (step,
round, process, prompt, sample) and the engine's sampling keys of (seed, request id,
position), so a resumed run samples the same tokens as one that never stopped, and no two
hosts share sampling noise.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import numpy as np

from rhyme_jax.config import Config, ids_per_step
from rhyme_jax.history.drafter import HistoryDrafter
from rhyme_jax.history.recording import Recording
from rhyme_jax.history.store import HistoryStore
from rhyme_jax.rl.rewards.scoring import Scorer
from rhyme_jax.rl.samples import (GroupRecord, Prompt, Sample, accuracy, rows_hash,
                                  tokens_crc32)
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams, needs_filtering
from rhyme_jax.scheduling.plan import SCHEDULES, plan_step
from rhyme_jax.scheduling.predictor import LengthPredictor, StoreLengths
from rhyme_jax.scheduling.simulate import tail_time

# Engine counters summed over a step's rollout rounds.
_ENGINE_COUNTERS = ("tokens", "useful_slot_steps", "steps", "spec_steps", "asked_steps",
                    "drafted", "accepted", "draft_time_s", "lookahead_time_s", "ahead_hits",
                    "ahead_misses", "yields", "yield_passes", "bucket_moves", "moves_held",
                    "prefill_chunks", "prefill_shared")

# Metrics (key prefixes) that two runs of the same flags may log differently: wall times, and
# what the engine chose from measured times. With `--speculate=auto` the cost model decides
# from step times whether and how far to draft (so forwards, acceptance and the share of
# speculative or asking steps move), divided rollout weighs a yield by its timed copies
# (so yields move, and with them which siblings' rows a prompt's prefill can be copied from),
# and the tail's bucket moves weigh timed moves against timed steps. What is
# sampled does not move (rollout/tokens_crc32), nor rewards, lengths or data: a resumed run is
# compared with an uninterrupted one on everything else. The updates can move in their last
# bits: a row decoded in another batch shape gets its log-probs (which the loss's importance
# weight reads) rounded differently, so training figures agree to float32 rounding.
TIMING_DEPENDENT_METRICS = (
    "time/", "rollout/tokens_per_s", "rollout/forwards_per_token",
    "rollout/mean_accepted_length", "rollout/ahead_hit_rate", "rollout/spec_step_frac",
    "rollout/draft_accept_rate", "rollout/yields", "rollout/yield_passes",
    "rollout/bucket_moves", "rollout/moves_held", "rollout/prefill_",
    "epoch/accepted_length", "epoch/hit_rate", "epoch/drafted_per_step",
    "epoch/spec_step_frac", "epoch/asked_step_frac")


def without_timing(records: Sequence[dict]) -> list[dict]:
  """Logged metric records less their TIMING_DEPENDENT_METRICS: what two runs of the same
  flags (a resumed one and an uninterrupted one) must log alike (training figures to float32
  rounding where the engine chose other step shapes)."""
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_DEPENDENT_METRICS)}
          for r in records]


def engine_config(config: Config, eos_ids: Sequence[int], drafting: bool) -> EngineConfig:
  """Batch buckets: the step's sample count (or `--rollout_slots` when fewer) and the powers
  of two below it."""
  c = config
  b = min(c.rollout.rollout_slots or c.rl.samples_per_step, c.rl.samples_per_step)
  buckets = sorted({b} | {2**k for k in range(b.bit_length()) if 2**k < b}, reverse=True)
  return EngineConfig(
      max_len=c.rollout.max_prompt_len + c.rollout.max_new_tokens, buckets=tuple(buckets),
      max_draft=c.rollout.draft_budget if drafting else 0,
      speculate=c.rollout.speculate if drafting else "never",
      prefill_chunk=c.rollout.prefill_chunk, draft_mode=c.rollout.draft_mode,
      attention=c.rollout.attention, eos_ids=tuple(eos_ids), seed=c.run.seed,
      divide_every=c.rollout.divide_every, compile_threads=c.rollout.compile_threads,
      multi_step=c.rollout.multi_step, drain_steps=c.rollout.drain_steps,
      park_rows=c.rollout.park_rows if c.rollout.divide_every else 0)  # no pool unless used


def request_base(config: Config, step: int, round_idx: int, process_index: int = 0,
                 process_count: int = 1) -> int:
  """First request id of a process's round: ids run over (step, round, process, sample), so a
  run of P processes with N prompts each samples what one process with P * N prompts would."""
  rounds = ids_per_step(config) // config.rl.samples_per_step
  return ((step * rounds + round_idx) * process_count + process_index) * \
      config.rl.samples_per_step


class Rollouts:
  """Samples and scores groups of responses with the rollout engine (this host's)."""

  def __init__(self, config: Config, model, tokenizer, scorer: Scorer, process_index: int = 0,
               process_count: int = 1):
    c = config
    self.config = config
    self.process_index, self.process_count = process_index, process_count
    self.scorer = scorer
    predict = c.rollout.schedule != "fifo" or c.rollout.balance_hosts  # lengths from history
    history = c.rollout.spec == "histospec" or predict
    self.store = HistoryStore(c.rollout.history_epochs) if history else None
    self.predictor = LengthPredictor(StoreLengths(self.store)) if predict else None
    self.drafter = (HistoryDrafter(self.store, max_budget=c.rollout.draft_budget)
                    if c.rollout.spec == "histospec" else None)
    self.engine = RolloutEngine(
        model, engine_config(c, tokenizer.stop_ids, self.drafter is not None), self.drafter)
    self.sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                   top_k=c.rollout.top_k, max_new_tokens=c.rollout.max_new_tokens)
    self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0, top_k=0)
    self.record_dir = (os.path.join(c.run.run_dir, "rollouts") if c.run.record_rollouts
                       else None)

  def warmup(self) -> None:
    """Compiles every rollout shape once: for training sampling and for greedy evaluation."""
    for filters in {needs_filtering([self.sampling]), False}:
      self.engine.warmup(filters=filters)

  def _requests(self, prompts: Sequence[Prompt], base_id: int, params: SamplingParams,
                group_prefix, positions: Sequence[int] | None = None) -> list[Request]:
    """G requests per prompt; prompt i's ids start at base_id + G x positions[i] (default i)."""
    g = self.config.rl.group_size if params.temperature > 0 else 1
    positions = range(len(prompts)) if positions is None else positions
    return [Request(request_id=base_id + q * g + j, prompt=p.tokens, params=params,
                    group_id=(group_prefix, q), prompt_key=p.key)
            for q, p in zip(positions, prompts) for j in range(g)]

  def sample_round(self, prompts: Sequence[Prompt], step: int, round_idx: int,
                   stats: dict[str, Any], positions: Sequence[int] | None = None
                   ) -> list[list[Sample]]:
    """G scored responses per prompt (`record` adds them to the history store).

    `positions`: with --balance_hosts, the prompts' places in the whole round of every host
    (rl.hosts.HostPlan); their request ids, hence sampling keys, are then the ones the host
    whose slice holds them would have used, so which host samples a prompt never changes
    what it samples. Default: this host's slice of the round, in order."""
    c = self.config
    if positions is None:
      base = request_base(c, step, round_idx, self.process_index, self.process_count)
    else:
      base = request_base(c, step, round_idx, 0, self.process_count)
      if len(positions) != len(prompts):
        raise ValueError(f"sample_round: {len(prompts)} prompts but {len(positions)} positions")
    t0 = time.perf_counter()
    requests = self._requests(prompts, base, self.sampling, (step, round_idx), positions)
    admission = None
    if c.rollout.schedule != "fifo":
      # No kv_budget: the engine bounds the KV of yielded requests by its park pool (a full
      # pool stops yields), and a budget of buckets + park rows could never bind there.
      admission = plan_step(requests, self.predictor, step=step,
                            policy=SCHEDULES[c.rollout.schedule]).admission(0)
    results = self.engine.generate(requests, admission=admission)
    for k in _ENGINE_COUNTERS:
      stats[k] = stats.get(k, 0) + getattr(self.engine.stats, k)
    stats["time/rollout"] = stats.get("time/rollout", 0.0) + time.perf_counter() - t0
    finish = np.array([r.finish_time for r in results])
    stats["time/rollout_makespan"] = stats.get("time/rollout_makespan", 0.0) + finish.max()
    stats["time/rollout_tail"] = stats.get("time/rollout_tail", 0.0) + tail_time(finish)
    if self.record_dir is not None:
      self._save_round(prompts, results, step, round_idx)
    t0 = time.perf_counter()
    g = c.rl.group_size
    groups = []
    for i, p in enumerate(prompts):
      group = []
      for r in results[i * g:(i + 1) * g]:
        if r.finish_reason == "error":
          raise RuntimeError(f"rollout of example {p.example.uid} failed: {r.error}")
        group.append(Sample(p, r.tokens, r.logprobs, r.finish_reason))
      self.scorer.score_group(group)
      if self.drafter is not None:
        self.drafter.end_group(((step, round_idx), i if positions is None else positions[i]))
      groups.append(group)
    stats["time/reward"] = stats.get("time/reward", 0.0) + time.perf_counter() - t0
    return groups

  def _save_round(self, prompts: Sequence[Prompt], results, step: int, round_idx: int) -> None:
    """The round's tokens as one `Recording` per data epoch it spans, named by (epoch, step,
    round, process): a rerun of a step after a resume rewrites the same file."""
    c, g = self.config, self.config.rl.group_size
    os.makedirs(self.record_dir, exist_ok=True)
    meta = {"seed": c.run.seed, "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p, "top_k": self.sampling.top_k,
            "max_new_tokens": self.sampling.max_new_tokens, "group_size": g,
            "model": c.model.model, "task": c.data.task, "step": step, "round": round_idx,
            "process": self.process_index, "source": "GRPO run (--record_rollouts)"}
    for epoch in sorted({p.epoch for p in prompts}):
      idx = [i for i, p in enumerate(prompts) if p.epoch == epoch]
      rs = [results[i * g + j] for i in idx for j in range(g)]
      Recording(responses=[np.asarray(r.tokens, np.int32) for r in rs],
                request_ids=np.array([r.request_id for r in rs], np.int64),
                prompt_index=np.repeat(np.arange(len(idx), dtype=np.int64), g),
                finish=[r.finish_reason for r in rs], prompts=[prompts[i].tokens for i in idx],
                prompt_keys=[prompts[i].key for i in idx], meta=dict(meta, epoch=int(epoch))
                ).save(os.path.join(self.record_dir, f"e{epoch}_s{step:06d}_r{round_idx}"
                                                     f"_p{self.process_index}.npz"))

  def record(self, records: Sequence[GroupRecord]) -> None:
    """Adds finished groups to the history store, in order (later visits draft from them and
    are scheduled by them)."""
    for r in records:
      if self.drafter is not None:
        self.drafter.record_group(r.key, r.responses, r.rewards, epoch=r.epoch)
      elif self.store is not None:
        self.store.add_group(r.key, r.epoch, r.responses, r.rewards)

  def evaluate(self, prompts: Sequence[Prompt], step: int) -> dict[str, list]:
    """Greedy decoding of held-out prompts: per-prompt reward, response length, correctness
    (`eval_metrics` turns every host's lists into the logged means)."""
    results = self.engine.generate(self._requests(prompts, 0, self.greedy, ("eval", step)))
    samples = [Sample(p, r.tokens, r.logprobs, r.finish_reason) for p, r in zip(prompts, results)]
    for s in samples:
      self.scorer.score(s)
    if self.drafter is not None:
      for i in range(len(prompts)):
        self.drafter.end_group((("eval", step), i))
    return {"reward": [float(s.reward) for s in samples],
            "length": [len(s.tokens) for s in samples], "correct": [s.correct for s in samples]}


def eval_metrics(parts: Sequence[dict[str, list]], seconds: float) -> dict[str, float]:
  """Mean reward, response length and accuracy over every host's `Rollouts.evaluate` lists."""
  join = lambda k: [x for part in parts for x in part[k]]
  out = {"eval/reward": float(np.mean(join("reward"))),
         "eval/response_length": float(np.mean(join("length"))), "time/eval": seconds}
  acc = accuracy(join("correct"))
  if acc is not None:
    out["eval/accuracy"] = acc
  return out


def rollout_metrics(records: Sequence[GroupRecord], kept: int, stats: dict[str, Any],
                    prompts_per_step: int) -> dict[str, Any]:
  """What a step's rollouts did (every host's groups, in order): rewards, lengths, speculation
  and timing. `prompts_per_step` counts all hosts' prompts of one round."""
  m: dict[str, Any] = {}
  responses = [r for g in records for r in g.responses]
  rewards = np.array([x for g in records for x in g.rewards])
  lengths = np.array([len(r) for r in responses])
  m["reward/mean"] = float(rewards.mean())
  m["reward/std"] = float(rewards.std())
  acc = accuracy([x for g in records for x in g.correct])
  if acc is not None:
    m["accuracy"] = acc
  m["response_length/mean"] = float(lengths.mean())
  m["response_length/max"] = int(lengths.max())
  m["rollout/tokens_crc32"] = tokens_crc32(responses)
  m["response_length/truncated_frac"] = float(np.mean([f == "length" for g in records
                                                       for f in g.finish]))
  m["rollout/samples"] = len(responses)
  m["rollout/rounds"] = len(records) // prompts_per_step
  m["rollout/groups_kept"] = kept
  m["rollout/tokens_per_s"] = stats["tokens"] / max(stats["time/rollout"], 1e-9)
  m["rollout/mean_accepted_length"] = stats["tokens"] / max(stats["useful_slot_steps"], 1)
  m["rollout/forwards_per_token"] = stats["steps"] / max(stats["tokens"], 1)
  # Whether speculation ran at all, and how well: the share of decode steps that verified
  # drafts (the cost model sizes each step, and may draft nothing), and of drafted nodes taken.
  m["rollout/spec_step_frac"] = stats["spec_steps"] / max(stats["steps"], 1)
  m["rollout/draft_accept_rate"] = stats["accepted"] / max(stats["drafted"], 1)
  # Host drafting per decode step: on the critical path, and in the background (overlapped).
  m["time/draft_ms_per_step"] = 1e3 * stats["draft_time_s"] / max(stats["steps"], 1)
  m["time/lookahead_ms_per_step"] = 1e3 * stats["lookahead_time_s"] / max(stats["steps"], 1)
  m["rollout/ahead_hit_rate"] = stats["ahead_hits"] / max(
      stats["ahead_hits"] + stats["ahead_misses"], 1)
  m["rollout/yields"] = stats.get("yields", 0)  # slots given up mid-response (--divide_every)
  m["rollout/yield_passes"] = stats.get("yield_passes", 0)  # engine passes that yielded
  # The tail's moves into smaller buckets, and passes the cost model kept the rows in theirs
  m["rollout/bucket_moves"] = stats.get("bucket_moves", 0)
  m["rollout/moves_held"] = stats.get("moves_held", 0)
  # Requests given a copy of a sibling's prompt KV instead of a prefill, and prefill calls made
  # (which siblings are live at an admission moves with yields, so with timing)
  m["rollout/prefill_shared"] = stats.get("prefill_shared", 0)
  m["rollout/prefill_calls"] = stats.get("prefill_chunks", 0)
  m["time/rollout"] = stats["time/rollout"]
  # Wall time from the rollout's start to its last response, and to finish its last 10%
  # (summed over a step's rounds): what the admission order (--schedule) acts on.
  for k in ("time/rollout_makespan", "time/rollout_tail", "time/rollout_host_min"):
    if k in stats:
      m[k] = stats[k]
  m["time/reward"] = stats["time/reward"]
  m["data/epoch"] = int(max(g.epoch for g in records))
  m["data/batch_hash"] = rows_hash([g.uid for g in records])
  return m


def combine_stats(per_host: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Hosts' rollout counters summed; their wall times (they ran side by side) the longest."""
  out = {k: sum(h.get(k, 0) for h in per_host) for k in _ENGINE_COUNTERS}
  for k in ("time/rollout", "time/reward", "time/rollout_makespan", "time/rollout_tail"):
    if k in per_host[0]:
      out[k] = max(h[k] for h in per_host)
  if len(per_host) > 1:  # the host that finished first: how uneven the hosts' rollouts were
    out["time/rollout_host_min"] = min(h["time/rollout"] for h in per_host)
  return out
