"""HistoryDrafter: exact history gives the true continuation, adaptive budgets, sibling drafts,
group lifecycle, stats, and drafting ahead (`lookahead` + `DraftQuery.ahead`)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dataclasses

from rhyme_jax.history.drafter import HistoryDrafter
from rhyme_jax.history.store import HistoryStore, prompt_key
from rhyme_jax.history.tree_draft import tree_depth
from rhyme_jax.rollout.drafts import DraftQuery

PROMPT = np.array([11, 12, 13], np.int32)
KEY = prompt_key(PROMPT)


def query(response, budget=16, request_id=0, group_id="g"):
  return DraftQuery(request_id, group_id, KEY, PROMPT, np.asarray(response, np.int32), budget)


def true_response(seed=0, n=120):
  return np.random.default_rng(seed).permutation(5000)[:n].astype(np.int32)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 100), st.sampled_from([1, 4, 8, 16]), st.integers(0, 3))
def test_exact_history_drafts_the_true_continuation(pos, max_budget, seed):
  future = true_response(seed)
  store = HistoryStore()
  store.add_group(KEY, 0, [future] * 4)
  drafter = HistoryDrafter(store, use_siblings=False, max_budget=max_budget)
  tree, = drafter.propose([query(future[:pos], budget=16)])
  n = min(max_budget, len(future) - pos)
  assert tree.size == n and len(tree.tokens) == n  # unpadded
  np.testing.assert_array_equal(tree.tokens[:n], future[pos:pos + n])
  np.testing.assert_array_equal(tree.parents[:n], np.arange(n) - 1)


def test_unpadded_best_first_trees_with_path_probabilities():
  """Two histories that agree for 20 tokens then split: a chain with probability 1, then two
  branches of 1/2; sizes are the engine's budget, never adapted."""
  a = list(range(100, 140))
  b = list(range(100, 120)) + [7, 8, 9]
  store = HistoryStore()
  store.add_group(KEY, 0, [a, b])
  drafter = HistoryDrafter(store, use_siblings=False, max_budget=16)
  for pos in range(3, 6):  # rejections do not shrink anything
    tree, = drafter.propose([query(a[:pos], budget=8)])
    assert len(tree.tokens) == tree.size == 8 and tree.valid.all()
    drafter.observe(0, "g", np.asarray(a[pos:pos + 1]), 8, 0)
  tree, = drafter.propose([query(a[:18], budget=8, request_id=1)])
  assert tree_depth(tree) < tree.size  # branched at 120 vs 7
  np.testing.assert_allclose(tree.probs[:2], [1.0, 1.0])
  np.testing.assert_allclose(tree.probs[2:4], [0.5, 0.5])
  assert np.all(np.diff(tree.probs) <= 0)
  assert np.all(tree.parents < np.arange(8))
  # Flagged clean: the engine's `cleaned` slices it, which is what walking it would give.
  assert tree.clean
  for k in (0, 3, 8, 20):
    for got, want in zip(tree.cleaned(k), dataclasses.replace(tree, clean=False).cleaned(k)):
      np.testing.assert_array_equal(got, want)


def test_falls_back_to_one_token_suffixes():
  """A context whose two-token suffix was never seen still drafts from its last token."""
  past = list(range(300, 340))
  store = HistoryStore()
  store.add_group(KEY, 0, [past])
  drafter = HistoryDrafter(store, use_siblings=False, max_budget=4)
  tree, = drafter.propose([query([999, 310], budget=4)])  # (999, 310) never occurs; 310 does
  np.testing.assert_array_equal(tree.tokens, past[11:15])


def test_recent_epochs_weigh_more():
  """Two kept epochs disagree after the match: the newer one's continuation comes first."""
  store = HistoryStore(epochs_kept=2)
  store.add_group(KEY, 0, [[1, 2, 3, 4, 50]])
  store.add_group(KEY, 1, [[1, 2, 3, 4, 60]])
  drafter = HistoryDrafter(store, use_siblings=False, recency=0.5, max_budget=2)
  tree, = drafter.propose([query([1, 2, 3, 4], budget=2)])
  np.testing.assert_array_equal(tree.tokens, [60, 50])
  np.testing.assert_allclose(tree.probs, [2 / 3, 1 / 3], rtol=1e-6)


def test_siblings_draft_for_a_prompt_without_history():
  leader = true_response(3, 80)
  drafter = HistoryDrafter(HistoryStore(), max_budget=8)
  # Request 0 generates; request 1 of the same group starts later on the same path.
  drafter.propose([query(leader[:1], request_id=0)])
  for pos in range(1, 60, 3):
    drafter.observe(0, "g", leader[pos:pos + 3], 0, 0)
  tree, = drafter.propose([query(leader[:10], request_id=1)])
  np.testing.assert_array_equal(tree.tokens[:8], leader[10:18])
  # Another group sees nothing of it.
  tree, = drafter.propose([query(leader[:10], request_id=2, group_id="other")])
  assert tree.size == 0
  # Without siblings there is nothing to draft from.
  lonely = HistoryDrafter(HistoryStore(), use_siblings=False, max_budget=8)
  tree, = lonely.propose([query(leader[:10], request_id=1)])
  assert tree.size == 0


def test_response_sync_equals_observed_tokens():
  """Tokens the engine never reported via observe are taken from the query's response."""
  leader = true_response(4, 50)
  via_observe = HistoryDrafter(None, use_history=False)
  via_observe.propose([query(leader[:1], request_id=0)])
  via_observe.observe(0, "g", leader[1:40], 0, 0)
  via_query = HistoryDrafter(None, use_history=False)
  via_query.propose([query(leader[:40], request_id=0)])
  ta, = via_observe.propose([query(leader[:20], request_id=1)])
  tb, = via_query.propose([query(leader[:20], request_id=1)])
  np.testing.assert_array_equal(ta.tokens, tb.tokens)
  np.testing.assert_array_equal(ta.tokens, leader[20:36])


def test_history_and_siblings_merge_and_record_group_invalidates():
  old = list(range(200, 260))
  store = HistoryStore()
  drafter = HistoryDrafter(store, max_budget=8)
  drafter.record_group(KEY, [old], [1.0], epoch=0)
  tree, = drafter.propose([query(old[:10])])
  np.testing.assert_array_equal(tree.tokens[:8], old[10:18])
  assert drafter.stats["history_index_builds"] == 1
  drafter.propose([query(old[:11])])
  assert drafter.stats["history_index_builds"] == 1  # cached
  new = old[:30] + [1, 2, 3]
  drafter.record_group(KEY, [new], epoch=1)  # epochs_kept=1: epoch 0 is replaced
  assert [g.epoch for g in store.get(KEY)] == [1]
  tree, = drafter.propose([query(old[:25], request_id=3)])
  assert drafter.stats["history_index_builds"] == 2
  np.testing.assert_array_equal(tree.tokens[:8], new[25:33])


def test_finish_and_end_group_free_state_and_stats_accumulate():
  drafter = HistoryDrafter(HistoryStore(), idle_groups_kept=2)
  for g in range(4):
    drafter.propose([query([1, 2, 3], request_id=g, group_id=g)])
    drafter.observe(g, g, np.array([4, 5]), 2, 1)
    drafter.finish(g, g)
  assert drafter.live_groups == 2  # idle groups beyond the cap are freed
  assert not drafter._requests
  drafter.end_group(3)
  assert drafter.live_groups == 1
  assert drafter.stats["propose_calls"] == 4 and drafter.stats["observe_calls"] == 4
  assert drafter.stats["accepted_tokens"] == 4 and drafter.stats["propose_seconds"] > 0


def test_lookahead_changes_nothing_and_its_continuation_is_the_true_one():
  """A tree drafted ahead from the context before a step, cut below the emitted tokens, drafts
  the true continuation, as a synchronous draft would; `lookahead` counts no proposal."""
  future = true_response(5)
  store = HistoryStore()
  store.add_group(KEY, 0, [future, future[::-1]])
  drafter = HistoryDrafter(store, max_budget=8)
  pos = 10
  q = query(future[:pos], budget=8)
  wide, = drafter.lookahead([dataclasses.replace(q, budget=17)])
  assert wide.size == 17 and tree_depth(wide) == 17  # lookahead may go past max_budget
  assert drafter.stats["propose_calls"] == 0
  emitted = future[pos:pos + 3]  # two drafted tokens accepted + the bonus
  ahead = wide.after(emitted)
  tree, = drafter.propose([dataclasses.replace(query(np.concatenate([future[:pos], emitted])),
                                               ahead=ahead)])
  assert drafter.stats["ahead_used"] == 1
  assert tree.size == 8  # the query's budget (capped by max_budget) still applies
  np.testing.assert_array_equal(tree.tokens, future[pos + 3:pos + 11])
  synchronous, = HistoryDrafter(store, max_budget=8).propose(
      [query(np.concatenate([future[:pos], emitted]))])
  np.testing.assert_array_equal(tree.tokens, synchronous.tokens)
  assert wide.after(future[pos:pos + 2][::-1]) is None  # emitted tokens that left the tree


def test_epoch_summary_reports_and_resets():
  future = true_response(6)
  store = HistoryStore()
  store.add_group(KEY, 0, [future])
  drafter = HistoryDrafter(store, use_siblings=False, max_budget=4)
  tree, = drafter.propose([query(future[:10], budget=4)])
  drafter.observe(0, "g", future[10:15], tree.size, 4)
  drafter.propose([query(future[:15], budget=4)])
  drafter.observe(0, "g", future[15:16], 0, 0)
  s = drafter.epoch_summary()
  assert s["accepted_length"] == 3.0 and s["hit_rate"] == 1.0 and s["no_draft_frac"] == 0.5
  assert s["drafted_per_step"] == 2.0 and s["draft_us_per_query"] > 0
  assert drafter.epoch_summary()["accepted_length"] == 0.0


def test_bad_config_is_named():
  with pytest.raises(ValueError, match="max_match"):
    HistoryDrafter(HistoryStore(), max_match=0)
  with pytest.raises(ValueError, match="min_prob"):
    HistoryDrafter(HistoryStore(), min_prob=0.0)
  with pytest.raises(ValueError, match="recency"):
    HistoryDrafter(HistoryStore(), recency=1.5)
  with pytest.raises(ValueError, match="needs a HistoryStore"):
    HistoryDrafter(None)


def test_more_prompts_in_a_batch_than_the_index_cache_all_draft_their_history():
  """A batch touching more prompts than `index_cache` holds: no index in use is evicted while
  the batch drafts (its postings range would be stale), every prompt drafts its own history,
  and the cache shrinks back on the next batch; a reloaded store's content is drafted, not
  what was cached for the old one."""
  store = HistoryStore()
  futures = {f"p{i}": true_response(10 + i, 60) for i in range(6)}
  for key, fut in futures.items():
    store.add_group(key, 0, [fut])
  drafter = HistoryDrafter(store, use_siblings=False, max_budget=8, index_cache=2)
  for rounds in range(2):
    qs = [DraftQuery(i, key, key, PROMPT, fut[:5 + rounds], 8)
          for i, (key, fut) in enumerate(futures.items())]
    for tree, (key, fut) in zip(drafter.propose(qs), futures.items()):
      np.testing.assert_array_equal(tree.tokens, fut[5 + rounds:13 + rounds], err_msg=key)
  reloaded = HistoryStore()
  other = {key: fut[::-1].copy() for key, fut in futures.items()}
  for key, fut in other.items():
    reloaded.add_group(key, 0, [fut])
  store.load_state_dict(reloaded.state_dict())
  qs = [DraftQuery(100 + i, key, key, PROMPT, fut[:5], 8)
        for i, (key, fut) in enumerate(other.items())]
  for tree, (key, fut) in zip(drafter.propose(qs), other.items()):
    np.testing.assert_array_equal(tree.tokens, fut[5:13], err_msg=key)


def test_threaded_drafting_gives_the_same_trees():
  store = HistoryStore()
  futures = [true_response(30 + i, 80) for i in range(4)]
  store.add_group(KEY, 0, futures)
  qs = [query(futures[i % 4][:10 + i], request_id=i, group_id=f"g{i % 3}") for i in range(20)]
  serial = HistoryDrafter(store, max_budget=8).propose(qs)
  threaded = HistoryDrafter(store, max_budget=8, parallel=True).propose(qs)
  for a, b in zip(serial, threaded):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.parents, b.parents)
    np.testing.assert_array_equal(a.probs, b.probs)
