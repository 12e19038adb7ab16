"""rl/hosts.py's balanced rounds (--balance_hosts) on one process: the plan every host derives,
the exchanged groups put back in data order, and the samples each host trains on. The two-
process run is tests/rl/test_trainer_multihost.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from rhyme_jax.data.datasets import Example
from rhyme_jax.rl import hosts
from rhyme_jax.rl.samples import GroupRecord, Sample, prompt_of
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable

G = 2


def _round(n):
  return [prompt_of(Example(f"u{i}", f"q{i}", "#### 1"), [10 + i, 20 + i]) for i in range(n)]


def _predictor(prompts, lengths):
  table = LengthTable()
  for p, n in zip(prompts, lengths):
    table.add(p.key, 0, [n] * G)
  return LengthPredictor(table)


def _group(prompt, q):
  rng = np.random.default_rng(q)
  return [Sample(prompt, rng.integers(0, 50, size=q + 1 + j).astype(np.int32),
                 rng.normal(size=q + 1 + j).astype(np.float32), "stop", reward=float(q) / 3 + j,
                 correct=None if j else 1.0) for j in range(G)]


def test_plan_moves_long_prompts_apart_and_groups_return_to_data_order():
  prompts = _round(4)  # host 0's slice is prompts 0-1, host 1's 2-3
  plan = hosts.HostPlan.make(prompts, _predictor(prompts, [90, 80, 5, 4]), G, 2)
  # LPT over G x length (180, 160, 10, 8): host 1 takes three groups, host 0 the longest
  assert plan.hosts == [[0], [1, 2, 3]] and plan.per_host == 2
  assert plan.slices() == [[0, 1], [2, 3]]

  # What the exchange returns: host 0's groups (its plan order), then host 1's, as JSON.
  sampled = {q: GroupRecord.of(_group(prompts[q], q), logprobs=True) for q in range(4)}
  wire = [GroupRecord.from_json(json.loads(json.dumps(sampled[q].to_json())))
          for q in plan.sampled_order()]
  ordered = hosts.in_data_order(wire, plan, prompts)
  assert [r.uid for r in ordered] == ["u0", "u1", "u2", "u3"]
  m = plan.metrics(ordered)
  assert m["schedule/host_groups_moved"] == 1
  assert m["schedule/host_work_ratio"] == pytest.approx(180 / 179)
  assert m["schedule/host_work_ratio_slices"] == pytest.approx(340 / 179)
  # true tokens: prompt q's G samples have q + 1 and q + 2 tokens (3, 5, 7, 9; mean host 12)
  assert m["schedule/host_tokens_ratio"] == pytest.approx(21 / 12)
  assert m["schedule/host_tokens_ratio_slices"] == pytest.approx(16 / 12)
  for q in range(4):  # what a host trains on: bit for bit what the sampling host had
    for got, want in zip(ordered[q].samples(prompts[q]), _group(prompts[q], q)):
      assert got.prompt is prompts[q]
      np.testing.assert_array_equal(got.tokens, want.tokens)
      assert got.logprobs.dtype == np.float32
      np.testing.assert_array_equal(got.logprobs, want.logprobs)
      assert (got.reward, got.correct, got.finish_reason) == (want.reward, want.correct, "stop")
  with pytest.raises(ValueError, match="2 groups for a plan of 4"):
    hosts.in_data_order(wire[:2], plan, prompts)
  # A host whose history differed planned [[1], [0, 2, 3]]: host 0 sampled prompt 1, host 1
  # prompts 0, 2, 3. Put back by this host's plan, prompt 1's answers would sit at place 0.
  other = hosts.HostPlan.make(prompts, _predictor(prompts, [80, 90, 5, 4]), G, 2)
  assert other.hosts == [[1], [0, 2, 3]]
  swapped = [sampled[q] for q in other.sampled_order()]
  with pytest.raises(ValueError, match=r"^--balance_hosts: the hosts derived different plans: "
                     r"round position 0 came back as prompt 'u1' \(epoch 0\) where this "
                     r"host's plan has 'u0' \(epoch 0\); every host must hold the same"):
    hosts.in_data_order(swapped, plan, prompts)
  with pytest.raises(ValueError, match="do not split over 3 hosts"):
    hosts.HostPlan.make(prompts, _predictor(prompts, [1, 2, 3, 4]), G, 3)


def test_records_without_logprobs_stay_small_and_cannot_be_trained_on():
  prompts = _round(2)
  record = GroupRecord.of(_group(prompts[0], 0))
  assert "logprobs" not in record.to_json()
  assert GroupRecord.from_json(record.to_json()).logprobs is None
  with pytest.raises(ValueError, match="recorded without log-probs"):
    record.samples(prompts[0])
  with pytest.raises(ValueError, match="is not the record's"):
    GroupRecord.of(_group(prompts[0], 0), logprobs=True).samples(prompts[1])


class _Rollouts:
  """Host h's rollouts: the real predictor, a sampler whose groups follow the round position
  (as the engine's keys do), informative (rewards differ) where `informative(round, q)`."""

  def __init__(self, predictor, informative):
    self.predictor, self.informative, self.calls = predictor, informative, []

  def sample_round(self, prompts, step, round_idx, stats, positions=None):
    positions = range(len(prompts)) if positions is None else positions
    self.calls.append((round_idx, list(positions)))
    out = []
    for p, q in zip(prompts, positions):
      group = _group(p, 10 * round_idx + q)
      if not self.informative(round_idx, q):
        for s in group:
          s.reward = 1.0
      out.append(group)
    return out


def _cfg(dynamic, rounds=3, per_host=2):
  return SimpleNamespace(rl=SimpleNamespace(prompts_per_step=per_host, group_size=G,
                                            dynamic_sampling=dynamic,
                                            dynamic_sampling_max_rounds=rounds))


def _run_hosts(cfg, informative, monkeypatch, hosts_n=2, per_round=4):
  """`balanced_rounds` of every host, the exchange played by running the hosts' samplers."""
  rounds = [_round(per_round) for _ in range(cfg.rl.dynamic_sampling_max_rounds)]
  predictor = _predictor(rounds[0], [50, 40, 30, 20])
  results = []
  for host in range(hosts_n):
    samplers = [_Rollouts(predictor, informative) for _ in range(hosts_n)]
    read = iter(rounds)

    def allgather(sent, samplers=samplers):
      r, _ = samplers[host].calls[-1]
      plan = hosts.HostPlan.make(rounds[r], predictor, G, hosts_n)
      out = []
      for h in range(hosts_n):
        if h == host:
          out.append(sent)
          continue
        mine = plan.hosts[h]
        groups = samplers[h].sample_round([rounds[r][q] for q in mine], 0, r, {}, mine)
        out.append([GroupRecord.of(g, logprobs=True).to_json() for g in groups])
      return json.loads(json.dumps(out))

    monkeypatch.setattr(hosts.multihost, "allgather_json", allgather)
    results.append(hosts.balanced_rounds(lambda: next(read), samplers[host], cfg, 0, host,
                                         hosts_n, {}))
  return rounds, results


def test_balanced_rounds_without_dynamic_sampling_train_each_host_on_its_slice(monkeypatch):
  rounds, (h0, h1) = _run_hosts(_cfg(False), lambda r, q: True, monkeypatch)
  assert [g.uid for g in h0.held] == [g.uid for g in h1.held] == ["u0", "u1", "u2", "u3"]
  for host, res in enumerate((h0, h1)):
    assert [[s.prompt.example.uid for s in g][0] for g in res.mine] == \
        [f"u{2 * host}", f"u{2 * host + 1}"]
    for q, group in zip((2 * host, 2 * host + 1), res.mine):
      for got, want in zip(group, _group(rounds[0][q], q)):
        np.testing.assert_array_equal(got.tokens, want.tokens)
  # predicted G x (50, 40, 30, 20): LPT puts prompts 0 and 3 on host 0, 1 and 2 on host 1
  assert h0.metrics == h1.metrics and h0.metrics["schedule/host_groups_moved"] == 2
  assert h0.metrics["schedule/host_work_ratio"] == 1.0


def test_balanced_dynamic_sampling_refills_globally_until_the_hosts_kept_enough(monkeypatch):
  keep = {(0, 1), (0, 3), (1, 0), (1, 2), (1, 3), (2, 0), (2, 1)}  # (round, position)
  rounds, (h0, h1) = _run_hosts(_cfg(True), lambda r, q: (r, q) in keep, monkeypatch)
  # round 0 kept 2 groups, round 1 three more: 4 = 2 hosts x 2 reached, round 2 never read
  assert len(h0.held) == len(h1.held) == 8 and h0.to_send == h1.to_send == []
  kept = [(0, 1), (0, 3), (1, 0), (1, 2)]
  for host, res in enumerate((h0, h1)):
    for (r, q), group in zip(kept[2 * host:2 * host + 2], res.mine):
      assert group[0].prompt is rounds[r][q]
      for got, want in zip(group, _group(rounds[r][q], 10 * r + q)):
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        assert got.reward == want.reward
  assert h0.metrics["schedule/host_groups_moved"] == 4  # two per round, summed
  # too few informative groups after every round: the hosts train on what there is
  rounds, (h0, h1) = _run_hosts(_cfg(True, rounds=2), lambda r, q: (r, q) == (1, 2),
                                monkeypatch)
  assert len(h0.held) == 8 and len(h0.mine) == 1 and h1.mine == []


def test_local_rounds_refill_a_hosts_own_slice_and_record_every_group():
  """Without --balance_hosts: one round without dynamic sampling, everything kept; with it,
  rounds of the host's own slice until prompts_per_step informative groups, every sampled
  group recorded (kept or not), the rest of the last round's informative ones dropped."""
  rounds = [_round(2) for _ in range(3)]
  predictor = _predictor(rounds[0], [50, 40])
  read = iter(rounds)
  got = hosts.local_rounds(lambda: next(read), _Rollouts(predictor, lambda r, q: False),
                           _cfg(False), 0, {})
  assert [g[0].prompt for g in got.mine] == rounds[0] and len(got.to_send) == 2
  assert got.metrics == {} and got.held is None
  keep = {(0, 1), (1, 0), (1, 1), (2, 0)}
  sampler = _Rollouts(predictor, lambda r, q: (r, q) in keep)
  read = iter(rounds)
  got = hosts.local_rounds(lambda: next(read), sampler, _cfg(True), 0, {})
  assert [c[0] for c in sampler.calls] == [0, 1]  # round 2 never read
  assert [g[0].prompt for g in got.mine] == [rounds[0][1], rounds[1][0]]
  assert [r.uid for r in got.to_send] == ["u0", "u1", "u0", "u1"]
  assert [hosts.informative(r) for r in got.to_send] == [False, True, True, True]
  # too few informative groups after every round: the host trains on what there is
  read = iter(rounds)
  got = hosts.local_rounds(lambda: next(read), _Rollouts(predictor, lambda r, q: r == 2 and q),
                           _cfg(True), 0, {})
  assert [g[0].prompt for g in got.mine] == [rounds[2][1]] and len(got.to_send) == 6
  shared = got.share({"tokens": 3})  # one process: what the host sampled, as it is
  assert shared.records == got.to_send and shared.kept == 1 and shared.stats == {"tokens": 3}


def test_share_step_keeps_held_groups_and_refuses_both():
  """Balanced rounds exchanged the groups already: share_step passes them through (one
  process here) and sends none; given groups both held and to send it refuses."""
  held = [GroupRecord.of(_group(p, q)) for q, p in enumerate(_round(2))]
  shared = hosts.share_step([], {"tokens": 5}, 2, held=held)
  assert shared.records == held and shared.kept == 2 and shared.stats == {"tokens": 5}
  assert hosts.share_step(held, {}, 1).records == held
  with pytest.raises(ValueError, match="share_step: groups both held"):
    hosts.share_step(held, {}, 1, held=held)


def test_resume_switching_balance_hosts_on_needs_the_hosts_at_one_round():
  """A checkpoint's per-host data states resume with or without --balance_hosts when the hosts
  agree: the balanced round then reads exactly the positions the hosts' slices would have read
  next (nothing skipped, nothing repeated). Hosts left at different rounds (dynamic sampling
  without --balance_hosts) cannot resume balanced: one clear error naming the flag."""
  from rhyme_jax.data.pipeline import PromptPipeline  # pylint: disable=import-outside-toplevel
  examples = [Example(f"u{i}", f"q{i}", "#### 1") for i in range(40)]
  local = [PromptPipeline(examples, batch_size=3, seed=0, process_index=i, process_count=2)
           for i in range(2)]
  iters = [iter(p) for p in local]
  for it in iters:
    for _ in range(2):
      next(it)
  saved = [it.get_state() for it in iters]  # what `data_states` gathers, in process order
  balanced = iter(PromptPipeline(examples, batch_size=6, seed=0, process_index=0,
                                 process_count=1))
  states = [hosts.my_data_state(saved, i, 2, "ckpt", balanced=True) for i in range(2)]
  assert states == saved
  balanced.set_state(states[0])
  assert next(balanced).positions == sum((next(it).positions for it in iters), ())

  skewed = [{"next_index": 5}, {"next_index": 7}]  # host 1 read two more refill rounds
  assert hosts.my_data_state(skewed, 1, 2, "ckpt") == {"next_index": 7}  # fine unbalanced
  with pytest.raises(ValueError, match=r"ckpt: .*different rounds.*\(5, 7\).*--balance_hosts"):
    hosts.my_data_state(skewed, 0, 2, "ckpt", balanced=True)
  with pytest.raises(ValueError, match=r"ckpt: written by 2 process\(es\), this run has 4"):
    hosts.my_data_state(skewed, 0, 4, "ckpt", balanced=True)
