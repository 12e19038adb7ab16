"""rl/rollouts.py on its own: engine shapes, sampled and scored groups, history, metrics."""

from __future__ import annotations

import numpy as np

import train_entry

from rhyme_jax.config import parse_flags
from rhyme_jax.data.datasets import Example
from rhyme_jax.history.recording import Recording
from rhyme_jax.models.loading import load_model
from rhyme_jax.rl.rewards import get_reward_fn
from rhyme_jax.rl.rewards.scoring import Scorer
from rhyme_jax.rl.epoch_stats import EpochStats
from rhyme_jax.rl.rollouts import (TIMING_DEPENDENT_METRICS, Rollouts, combine_stats,
                                   engine_config, eval_metrics, request_base, rollout_metrics)
from rhyme_jax.rl.samples import GroupRecord, Sample, encode_prompts, prompt_of


def _config(*flags):
  return parse_flags(["--run_dir=unused", "--group_size=4", "--prompts_per_step=2",
                      "--max_prompt_len=64", "--max_new_tokens=6", "--temperature=1.0",
                      "--draft_budget=4", *flags])


def test_engine_config_shapes():
  e = engine_config(_config(), eos_ids=(2,), drafting=True)
  assert e.buckets == (8, 4, 2, 1) and e.max_draft == 4 and e.max_len == 70
  assert engine_config(_config("--prompts_per_step=3"), (2,), False).buckets == (12, 8, 4, 2, 1)
  assert engine_config(_config(), (2,), drafting=False).max_draft == 0
  assert engine_config(_config("--rollout_slots=3"), (2,), False).buckets == (3, 2, 1)
  assert engine_config(_config("--rollout_slots=64"), (2,), False).buckets == (8, 4, 2, 1)
  assert e.multi_step == 1 and engine_config(_config("--multi_step=4"), (2,), True).multi_step == 4


def test_history_epochs_sets_what_the_store_keeps_for_drafts_and_lengths(tmp_path,
                                                                          smollm2_tokenizer):
  """--history_epochs: the store (HistoSpec's drafts, the schedule's length predictions) keeps
  that many past epochs per prompt, the oldest dropped; fixed for a run (its checkpoints hold
  the store), so a resume cannot change it."""
  from rhyme_jax.config import RESUMABLE_CHANGES
  model, _ = load_model(train_entry.write_tiny_llama(str(tmp_path / "tiny")))
  scorer = Scorer(smollm2_tokenizer, get_reward_fn("format"), 6)
  record = lambda epoch, n: GroupRecord("u", "k", epoch, [np.arange(n, dtype=np.int32)] * 4,
                                        [0.0] * 4, [None] * 4, ["length"] * 4)
  for flags, kept, left in ((("--schedule=history",), [2], 5.0),
                            (("--history_epochs=2", "--schedule=history"), [1, 2], 4.5)):
    rollouts = Rollouts(_config(*flags), model, smollm2_tokenizer, scorer)
    rollouts.record([record(0, 3), record(1, 4), record(2, 5)])
    assert [e for e, _ in rollouts.store.epoch_lengths("k")] == kept
    # lengths 5 (and 4): the expected length over those kept
    assert rollouts.predictor.remaining_tokens("k", 0, 6) == left
  assert "rollout.history_epochs" not in RESUMABLE_CHANGES


def test_sample_round_is_deterministic_scored_and_recorded(tmp_path, smollm2_tokenizer):
  tok = smollm2_tokenizer
  model, _ = load_model(train_entry.write_tiny_llama(str(tmp_path / "tiny")))
  config = _config()
  scorer = Scorer(tok, get_reward_fn("format"), config.rollout.max_new_tokens)
  examples = [Example("a", "1+1?", "#### 2"), Example("b", "2+2?", "#### 4")]
  prompts = encode_prompts(["one plus one", "two plus two"], examples, [0, 0], tok, 64)

  rollouts = Rollouts(config, model, tok, scorer)  # one engine: compiled once
  stats = {}
  groups = rollouts.sample_round(prompts, 3, 0, stats)
  assert [len(g) for g in groups] == [4, 4]
  assert all(s.text == tok.decode(s.tokens) and s.reward in (0.0, 1.0) for g in groups for s in g)
  assert len(rollouts.store) == 0
  rollouts.record([GroupRecord.of(g) for g in groups])
  assert len(rollouts.store) == 2  # each finished group recorded for the prompt's next visit
  assert stats["tokens"] == sum(len(s.tokens) for g in groups for s in g)
  # Request ids depend on (step, round, prompt, sample) only: the same step samples the same
  # tokens (now with the first call's responses in the history to draft from), another does not.
  again = rollouts.sample_round(prompts, 3, 0, {})
  other = rollouts.sample_round(prompts, 4, 0, {})
  flat = lambda gs: [s.tokens.tolist() for g in gs for s in g]
  assert flat(again) == flat(groups) and flat(other) != flat(groups)


def test_record_rollouts_writes_each_round_per_data_epoch(tmp_path, smollm2_tokenizer):
  """--record_rollouts: one recording per round and data epoch, holding exactly the sampled
  tokens, request ids, prompts and sampling settings."""
  tok = smollm2_tokenizer
  model, _ = load_model(train_entry.write_tiny_llama(str(tmp_path / "tiny")))
  config = parse_flags(["--run_dir=" + str(tmp_path / "run"), "--group_size=2",
                        "--prompts_per_step=3", "--max_prompt_len=64", "--max_new_tokens=5",
                        "--temperature=1.0", "--spec=none", "--record_rollouts"])
  scorer = Scorer(tok, get_reward_fn("format"), config.rollout.max_new_tokens)
  examples = [Example(u, q, "#### 1") for u, q in (("a", "1?"), ("b", "2?"), ("c", "3?"))]
  prompts = encode_prompts(["one", "two", "three"], examples, [4, 4, 5], tok, 64)
  groups = Rollouts(config, model, tok, scorer).sample_round(prompts, 7, 1, {})
  files = sorted((tmp_path / "run" / "rollouts").iterdir())
  assert [f.name for f in files] == ["e4_s000007_r1_p0.npz", "e5_s000007_r1_p0.npz"]
  for f, (lo, hi), epoch in zip(files, ((0, 2), (2, 3)), (4, 5)):
    rec = Recording.load(f)
    samples = [s for g in groups[lo:hi] for s in g]
    assert [r.tolist() for r in rec.responses] == [s.tokens.tolist() for s in samples]
    assert rec.finish == [s.finish_reason for s in samples]
    assert rec.prompt_keys == [p.key for p in prompts[lo:hi]]
    assert [p.tolist() for p in rec.prompts] == [p.tokens.tolist() for p in prompts[lo:hi]]
    assert rec.prompt_index.tolist() == np.repeat(np.arange(hi - lo), 2).tolist()
    assert len(set(rec.request_ids.tolist())) == 2 * (hi - lo)
    assert rec.meta["epoch"] == epoch and rec.meta["temperature"] == 1.0
    assert rec.meta["group_size"] == 2 and rec.meta["step"] == 7


def test_schedules_change_when_not_what(tmp_path, smollm2_tokenizer):
  """--schedule keeps a history store even without speculation, orders admissions from it
  (the second visit of a prompt has history), logs makespan and tail, and samples what FIFO
  samples."""
  tok = smollm2_tokenizer
  model, _ = load_model(train_entry.write_tiny_llama(str(tmp_path / "tiny")))
  examples = [Example(u, q, "#### 1") for u, q in (("a", "1+1?"), ("b", "2+2?"), ("c", "3+3?"))]
  prompts = encode_prompts(["one", "two plus two", "three"], examples, [0] * 3, tok, 64)
  flat = lambda gs: [s.tokens.tolist() for g in gs for s in g]
  out = {}
  divided = ["--rollout_slots=4", "--divide_every=2", "--park_rows=4"]  # 12 samples, 4 slots
  for schedule, extra in {"fifo": [], "history": [], "alternate": [], "probe": [],
                          "residual": divided}.items():
    config = _config("--spec=none", f"--schedule={schedule}", "--prompts_per_step=3", *extra)
    rollouts = Rollouts(config, model, tok, Scorer(tok, get_reward_fn("format"), 6))
    assert (rollouts.store is None) == (schedule == "fifo")
    assert rollouts.drafter is None and rollouts.engine.config.max_draft == 0  # no speculation
    stats = {}
    first = rollouts.sample_round(prompts, 1, 0, stats)
    assert stats["time/rollout_makespan"] >= stats["time/rollout_tail"] >= 0.0
    rollouts.record([GroupRecord.of(g) for g in first])  # what the trainer does after a step
    stats = {}
    second = rollouts.sample_round(prompts, 2, 0, stats)
    assert (stats["yields"] > 0) == (schedule == "residual")  # divided rollout
    assert 0 < stats["yield_passes"] <= stats["yields"] or stats["yields"] == 0
    # the round's one engine call's tail counters, summed into the step's stats
    assert (stats["bucket_moves"], stats["moves_held"]) == (rollouts.engine.stats.bucket_moves,
                                                            rollouts.engine.stats.moves_held)
    if schedule != "fifo":
      assert len(rollouts.store) == 3 and rollouts.predictor.predict(prompts[0].key).known
    out[schedule] = (flat(first), flat(second), rollouts.engine.stats.admitted)
  for schedule in ("history", "alternate", "probe", "residual"):
    assert out[schedule][:2] == out["fifo"][:2], schedule
  assert out["fifo"][2] == sorted(out["fifo"][2])
  assert out["probe"][2][:3] == [out["probe"][2][0] + 4 * k for k in range(3)]  # probes first


def two_samples():
  """A prompt's two scored samples: 2 tokens (stopped, right) and 1 (cut at the cap, wrong)."""
  p = prompt_of(Example("u", "q", "a"), [1, 2], epoch=1)
  return [Sample(p, np.array([5, 6], np.int32), np.zeros(2), "stop", reward=1.0, correct=1.0),
          Sample(p, np.array([5], np.int32), np.zeros(1), "length", reward=0.0, correct=0.0)]


def test_rollout_metrics():
  samples = two_samples()
  records = [GroupRecord.of(samples[:1]), GroupRecord.of(samples[1:])]  # two one-sample rows
  stats = {"tokens": 3, "useful_slot_steps": 2, "steps": 2, "spec_steps": 1, "drafted": 4,
           "accepted": 1, "draft_time_s": 0.0, "lookahead_time_s": 0.0, "ahead_hits": 1,
           "ahead_misses": 3, "time/rollout": 1.5, "time/reward": 0.1}
  m = rollout_metrics(records, kept=1, stats=stats, prompts_per_step=1)
  assert m["rollout/spec_step_frac"] == 0.5 and m["rollout/draft_accept_rate"] == 0.25
  assert m["reward/mean"] == 0.5 and m["accuracy"] == 0.5
  assert m["response_length/max"] == 2 and m["response_length/truncated_frac"] == 0.5
  assert m["rollout/mean_accepted_length"] == 1.5  # 3 tokens in 2 useful slot-steps
  assert m["rollout/forwards_per_token"] == 2 / 3
  assert m["rollout/ahead_hit_rate"] == 0.25 and m["rollout/rounds"] == 2
  assert m["data/epoch"] == 1 and m["rollout/tokens_per_s"] == 2.0
  assert m["rollout/samples"] == 2


def test_metrics_that_move_with_timing_are_the_listed_ones():
  """Two rollouts that sampled the same tokens but made different timed choices (the cost
  model's speculation, divided rollout's yields, wall times) differ only in the metrics
  TIMING_DEPENDENT_METRICS names, per step and per data epoch: resume tests compare the rest
  with an uninterrupted run, so a metric missing from the list makes them flaky, and a listed
  one that does not move is compared nowhere."""
  samples = two_samples()
  records = [GroupRecord.of(samples)]
  # The same 3 tokens; every counter the engine's timed choices set, and every time, differs
  a = {"tokens": 3, "useful_slot_steps": 3, "steps": 3, "spec_steps": 0, "asked_steps": 0,
       "drafted": 0, "accepted": 0, "draft_time_s": 0.0, "lookahead_time_s": 0.0,
       "ahead_hits": 0, "ahead_misses": 0, "yields": 0, "yield_passes": 0, "bucket_moves": 2,
       "moves_held": 0, "prefill_chunks": 4, "prefill_shared": 0, "time/rollout": 1.5,
       "time/reward": 0.1, "time/rollout_makespan": 1.4, "time/rollout_tail": 0.2}
  b = {"tokens": 3, "useful_slot_steps": 2, "steps": 2, "spec_steps": 1, "asked_steps": 2,
       "drafted": 4, "accepted": 1, "draft_time_s": 0.2, "lookahead_time_s": 0.1,
       "ahead_hits": 1, "ahead_misses": 3, "yields": 2, "yield_passes": 1, "bucket_moves": 0,
       "moves_held": 5, "prefill_chunks": 2, "prefill_shared": 1, "time/rollout": 1.0,
       "time/reward": 0.2, "time/rollout_makespan": 0.9, "time/rollout_tail": 0.1}
  moved = set()
  for ma, mb in ((rollout_metrics(records, 1, a, 1), rollout_metrics(records, 1, b, 1)),
                 (EpochStats().update(1, a, [1.0, 0.0], [2, 1]),
                  EpochStats().update(1, b, [1.0, 0.0], [2, 1]))):
    assert ma.keys() == mb.keys()
    moved |= {k for k in ma if ma[k] != mb[k]}
  listed = lambda k: k.startswith(TIMING_DEPENDENT_METRICS)
  assert moved and all(listed(k) for k in moved), sorted(k for k in moved if not listed(k))
  assert all(any(k.startswith(prefix) for k in moved) for prefix in TIMING_DEPENDENT_METRICS)


def test_hosts_stats_and_eval_combine():
  a = {"tokens": 3, "useful_slot_steps": 2, "steps": 2, "draft_time_s": 0.5,
       "lookahead_time_s": 0.0, "ahead_hits": 1, "ahead_misses": 0, "time/rollout": 1.5,
       "time/reward": 0.1}
  b = dict(a, tokens=5, steps=4, **{"time/rollout": 2.5, "time/reward": 0.05})
  both = combine_stats([a, b])
  assert both["tokens"] == 8 and both["steps"] == 6 and both["draft_time_s"] == 1.0
  assert both["time/rollout"] == 2.5 and both["time/reward"] == 0.1  # side by side: the longest
  m = eval_metrics([{"reward": [1.0], "length": [4], "correct": [1.0]},
                    {"reward": [0.0, 0.5], "length": [2, 3], "correct": [0.0, None]}], 2.0)
  assert m == {"eval/reward": 0.5, "eval/response_length": 3.0, "time/eval": 2.0,
               "eval/accuracy": 0.5}


def test_request_ids_are_distinct_across_processes_rounds_and_steps():
  """Two processes of 2 prompts x 4 samples use exactly the ids one process of 4 prompts
  would: distinct keys on every host, and the same samples as the one-host run."""
  two = _config("--dynamic_sampling", "--dynamic_sampling_max_rounds=2")
  one = _config("--dynamic_sampling", "--dynamic_sampling_max_rounds=2", "--prompts_per_step=4")
  ids = lambda c, p, n, step, r: set(range(request_base(c, step, r, p, n),
                                           request_base(c, step, r, p, n) + c.rl.samples_per_step))
  for step in (0, 1, 7):
    for r in (0, 1):
      host0, host1 = ids(two, 0, 2, step, r), ids(two, 1, 2, step, r)
      assert not host0 & host1
      assert host0 | host1 == ids(one, 0, 1, step, r)
  every = [i for step in range(3) for r in range(2) for p in range(2) for i in ids(two, p, 2, step, r)]
  assert sorted(every) == list(range(3 * 2 * 2 * 8))  # dense, none shared
  assert request_base(_config(), 5, 0) == 5 * 8  # one process: step * samples per step


def test_multi_step_samples_what_one_step_per_launch_does(tmp_path, smollm2_tokenizer):
  """--multi_step runs several plain steps per engine call (with and without --spec): the
  trainer's samples are those of one step per call."""
  tok = smollm2_tokenizer
  model, _ = load_model(train_entry.write_tiny_llama(str(tmp_path / "tiny")))
  examples = [Example(u, q, "#### 1") for u, q in (("a", "1+1?"), ("b", "2+2?"))]
  prompts = encode_prompts(["one", "two plus two"], examples, [0, 0], tok, 64)
  flat = lambda gs: [s.tokens.tolist() for g in gs for s in g]
  for spec in ("none", "histospec"):
    got = {}
    for k in (1, 3):
      config = _config(f"--spec={spec}", f"--multi_step={k}", "--max_new_tokens=12")
      rollouts = Rollouts(config, model, tok, Scorer(tok, get_reward_fn("format"), 12))
      assert rollouts.engine.config.multi_step == k
      first = rollouts.sample_round(prompts, 1, 0, {})
      rollouts.record([GroupRecord.of(g) for g in first])  # history to draft from
      stats = {}
      got[k] = flat(first) + flat(rollouts.sample_round(prompts, 2, 0, stats))
      assert stats["steps"] > 0
    assert got[3] == got[1], spec
