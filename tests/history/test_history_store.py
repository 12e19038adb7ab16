"""History store: keys, epochs kept, length prediction, eviction by recording order, checkpoint
round trip."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rhyme_jax.history.store import HistoryStore, prompt_key


def test_prompt_key_is_stable_and_dtype_independent():
  a = prompt_key([1, 2, 3])
  assert a == prompt_key(np.array([1, 2, 3], np.int64)) == prompt_key(np.array([[1, 2, 3]]))
  assert a != prompt_key([1, 2, 4]) and a != prompt_key([1, 2, 3, 0])
  assert len(a) == 32 and set(a) <= set("0123456789abcdef")  # 128-bit lowercase hex


def test_epochs_kept_and_predicted_length():
  store = HistoryStore(epochs_kept=2)
  store.add_group("p", 0, [[1] * 4, [1] * 6], [0.0, 1.0])
  store.add_group("p", 1, [[2] * 10], [1.0])
  store.add_group("p", 1, [[2] * 20], [0.0])  # same epoch again: appended
  assert [g.epoch for g in store.get("p")] == [0, 1]
  assert store.predicted_length("p") == (15.0, 20)
  store.add_group("p", 2, [[3] * 3], None)
  groups = store.get("p")
  assert [g.epoch for g in groups] == [1, 2]
  assert np.isnan(groups[1].rewards[0])
  assert store.num_tokens == 10 + 20 + 3
  assert store.predicted_length("missing") is None
  assert [len(r) for r in store.responses("p")] == [10, 20, 3]
  store.add_group("q", 0, [[1] * 5])
  assert store.keys() == ["p", "q"]
  lengths = store.epoch_lengths("p")  # what scheduling reads; the order stays
  assert [e for e, _ in lengths] == [1, 2] and [l.tolist() for _, l in lengths] == [[10, 20], [3]]
  assert store.keys() == ["p", "q"] and store.epoch_lengths("missing") == []


def test_eviction_by_tokens_least_recently_recorded_first():
  store = HistoryStore(max_tokens=30)
  store.add_group("a", 0, [[0] * 10])
  store.add_group("b", 0, [[0] * 10])
  store.add_group(7, 0, [[0] * 10])
  assert store.get("a") is not None and store.responses("a")  # reads: the order stays
  store.add_group("b", 1, [[0] * 10])  # recorded again: "b" moves last, "a" is the oldest
  store.add_group("d", 0, [[0] * 5])
  assert store.keys() == [7, "b", "d"] and store.num_tokens == 25 and store.evictions == 1
  store.add_group("big", 0, [[0] * 100])  # alone above the bound: kept, everything else goes
  assert store.keys() == ["big"] and store.num_tokens == 100
  assert store.version("a") is None


def test_version_changes_with_content():
  store = HistoryStore()
  store.add_group("k", 0, [[1, 2]])
  v0 = store.version("k")
  store.get("k")
  assert store.version("k") == v0
  store.add_group("k", 1, [[1, 2]])
  assert store.version("k") != v0


def test_bad_input_is_named():
  store = HistoryStore()
  with pytest.raises(ValueError, match="2 responses but 1 rewards"):
    store.add_group("k", 0, [[1], [2]], [1.0])
  with pytest.raises(TypeError, match="prompt key"):
    store.add_group((1, 2), 0, [[1]])
  with pytest.raises(ValueError, match="epochs_kept"):
    HistoryStore(epochs_kept=0)
  with pytest.raises(ValueError, match="missing field"):
    store.load_state_dict({"tokens": np.zeros(0, np.int32)})


groups_strategy = st.lists(
    st.tuples(st.one_of(st.integers(0, 5), st.sampled_from(["x", "y", "z"])),
              st.integers(0, 3),
              st.lists(st.lists(st.integers(0, 50000), max_size=12), min_size=1, max_size=4)),
    max_size=15)


@settings(max_examples=60, deadline=None)
@given(groups_strategy, st.integers(1, 3), st.integers(5, 80))
def test_state_round_trip(groups, epochs_kept, max_tokens):
  store = HistoryStore(epochs_kept=epochs_kept, max_tokens=max_tokens)
  rng = np.random.default_rng(0)
  for key, epoch, responses in groups:
    store.add_group(key, epoch, responses, rng.normal(size=len(responses)))
  state = store.state_dict()
  json.loads(state["meta_json"])  # plain JSON + numpy arrays
  assert all(isinstance(v, np.ndarray) for k, v in state.items() if k != "meta_json")
  restored = HistoryStore()
  restored.load_state_dict(state)
  assert restored.keys() == store.keys()  # eviction order included
  assert (restored.epochs_kept, restored.max_tokens, restored.num_tokens) == (
      store.epochs_kept, store.max_tokens, store.num_tokens)
  for key in store.keys():
    a, b = store._entries[key], restored._entries[key]
    assert [g.epoch for g in a] == [g.epoch for g in b]
    for ga, gb in zip(a, b):
      assert len(ga.responses) == len(gb.responses)
      for ra, rb in zip(ga.responses, gb.responses):
        np.testing.assert_array_equal(ra, rb)
      np.testing.assert_array_equal(ga.rewards, gb.rewards)
    assert store.predicted_length(key) == restored.predicted_length(key)


def test_hosts_that_draft_different_prompts_keep_identical_stores():
  """Every host of a pod records the same groups in the same order, but drafts (reads) only
  its own prompts: the stores, and the host plan derived from them, must stay identical (a
  read that moved a prompt in the eviction order made the hosts evict different prompts)."""
  from rhyme_jax.scheduling.assignment import plan_hosts
  from rhyme_jax.scheduling.predictor import LengthPredictor, StoreLengths
  stores = [HistoryStore(max_tokens=8 * 100) for _ in range(2)]
  for store in stores:
    for i, n in enumerate([10, 20, 30, 40]):
      store.add_group(f"k{i}", 0, [[1] * n] * 8)
  stores[1].get("k0")  # host 1 alone drafts prompt k0
  stores[1].responses("k1")
  for store in stores:
    store.add_group("k4", 0, [[1] * 10] * 8)  # the same record on both: one eviction
  assert stores[0].keys() == stores[1].keys() == ["k1", "k2", "k3", "k4"]
  plans = [plan_hosts(["k0", "k1", "k2", "k3"], 8, LengthPredictor(StoreLengths(s)), 2)[0]
           for s in stores]
  assert plans[0] == plans[1]


def test_an_empty_group_records_nothing_and_resumes_alike():
  """A group of no responses keeps no epoch: it would push an older epoch out, and a store
  reloaded from its `state_dict` (which holds responses) would keep that epoch instead."""
  store = HistoryStore(epochs_kept=2)
  store.add_group("x", 0, [[1] * 10] * 2)
  store.add_group("x", 1, [])
  assert [e for e, _ in store.epoch_lengths("x")] == [0] and len(store.get("x")) == 1
  restored = HistoryStore()
  restored.load_state_dict(store.state_dict())
  for s in (store, restored):
    s.add_group("x", 2, [[1] * 60] * 2)
  assert store.epoch_lengths("x")[0][0] == restored.epoch_lengths("x")[0][0] == 0
  assert [e for e, _ in store.epoch_lengths("x")] == [e for e, _ in restored.epoch_lengths("x")]
  with pytest.raises(ValueError, match="0 responses but 1 rewards"):
    store.add_group("x", 3, [], [1.0])
