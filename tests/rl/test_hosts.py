"""rl/hosts.py's balanced rounds (--balance_hosts) on one process: the plan every host derives,
the exchanged groups put back in data order, and the samples each host trains on. The two-
process run is tests/rl/test_trainer_multihost.py."""

from __future__ import annotations

import json

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
  ordered = hosts.in_data_order(wire, plan)
  assert [r.uid for r in ordered] == ["u0", "u1", "u2", "u3"]
  m = plan.metrics(ordered)
  assert m["schedule/host_groups_moved"] == 1
  assert m["schedule/host_work_ratio"] == pytest.approx(180 / 179)
  assert m["schedule/host_work_ratio_slices"] == pytest.approx(340 / 179)
  # true tokens: prompt q's G samples have q + 1 and q + 2 tokens (3, 5, 7, 9; mean host 12)
  assert m["schedule/host_tokens_ratio"] == pytest.approx(21 / 12)
  assert m["schedule/host_tokens_ratio_slices"] == pytest.approx(16 / 12)
  for p in range(2):  # each host's slice, bit for bit what the sampling host had
    mine = hosts.my_groups(ordered, prompts, p, plan.per_host)
    for q, group in zip((2 * p, 2 * p + 1), mine):
      for got, want in zip(group, _group(prompts[q], q)):
        assert got.prompt is prompts[q]
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert got.logprobs.dtype == np.float32
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        assert (got.reward, got.correct, got.finish_reason) == (want.reward, want.correct, "stop")
  with pytest.raises(ValueError, match="2 groups for a plan of 4"):
    hosts.in_data_order(wire[:2], plan)
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
