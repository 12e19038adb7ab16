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
  drafter = HistoryDrafter(store, use_siblings=False, start_budget=max_budget,
                           max_budget=max_budget)
  tree, = drafter.propose([query(future[:pos], budget=16)])
  n = min(max_budget, len(future) - pos)
  assert tree.size == n and len(tree.tokens) == 16
  np.testing.assert_array_equal(tree.tokens[:n], future[pos:pos + n])
  np.testing.assert_array_equal(tree.parents[:n], np.arange(n) - 1)


def test_budget_grows_to_full_chain_when_drafts_are_accepted():
  future = true_response(1)
  store = HistoryStore()
  store.add_group(KEY, 0, [future])
  drafter = HistoryDrafter(store, start_budget=2, max_budget=16)
  pos, sizes = 5, []
  while pos < 60:
    tree, = drafter.propose([query(future[:pos])])
    sizes.append(tree.size)
    np.testing.assert_array_equal(tree.tokens[:tree.size], future[pos:pos + tree.size])
    accepted = tree.size  # the target agrees with the history: everything accepted + bonus
    new = future[pos:pos + accepted + 1]
    drafter.observe(0, "g", new, tree.size, accepted)
    pos += len(new)
  assert sizes[:4] == [2, 4, 8, 16] and set(sizes[4:]) <= {16}


def test_adaptive_budget_doubles_halves_and_is_capped():
  future = true_response(2)
  store = HistoryStore()
  store.add_group(KEY, 0, [future])
  drafter = HistoryDrafter(store, use_siblings=False, start_budget=4, max_budget=8)
  assert drafter.budget_of(0) == 4
  tree, = drafter.propose([query(future[:10])])
  assert tree.size == 4
  drafter.observe(0, "g", future[10:12], 4, 1)  # partly accepted: halve
  assert drafter.budget_of(0) == 2
  drafter.propose([query(future[:12])])
  drafter.observe(0, "g", future[12:13], 2, 0)
  assert drafter.budget_of(0) == 1
  drafter.propose([query(future[:13])])
  drafter.observe(0, "g", future[13:14], 1, 0)
  assert drafter.budget_of(0) == 1  # floor
  for expected in [2, 4, 8, 8]:  # fully accepted: double, up to max_budget
    tree, = drafter.propose([query(future[:20])])
    drafter.observe(0, "g", future[20:21], tree.size, tree.size)
    assert drafter.budget_of(0) == expected
  tree, = drafter.propose([query(future[:20], budget=3)])  # the engine's budget caps it
  assert tree.size == 3 and len(tree.tokens) == 3
  # A step that drafted nothing (no history for this prompt) leaves the budget alone.
  other = DraftQuery(5, "h", "unknown", PROMPT, future[:20], 16)
  tree, = drafter.propose([other])
  assert tree.size == 0
  drafter.observe(5, "h", future[20:21], 0, 0)
  assert drafter.budget_of(5) == 4


def test_tree_full_acceptance_means_the_deepest_path():
  a = list(range(100, 140))
  b = list(range(100, 120)) + [7, 8, 9]
  store = HistoryStore()
  store.add_group(KEY, 0, [a, b])
  drafter = HistoryDrafter(store, use_siblings=False, start_budget=8, max_budget=16)
  tree, = drafter.propose([query(a[:18])])
  depth = tree_depth(tree)
  assert tree.size == 8 and depth < tree.size  # branched at 120 vs 7
  drafter.observe(0, "g", np.asarray(a[18:18 + depth + 1]), tree.size, depth)
  assert drafter.budget_of(0) == 16


def test_siblings_draft_for_a_prompt_without_history():
  leader = true_response(3, 80)
  drafter = HistoryDrafter(HistoryStore(), start_budget=8, max_budget=8)
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
  lonely = HistoryDrafter(HistoryStore(), use_siblings=False, start_budget=8, max_budget=8)
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
  assert ta.size == 2


def test_history_and_siblings_merge_and_record_group_invalidates():
  old = list(range(200, 260))
  store = HistoryStore()
  drafter = HistoryDrafter(store, start_budget=8, max_budget=8)
  drafter.begin_epoch(0)
  drafter.record_group(KEY, [old], [1.0])
  tree, = drafter.propose([query(old[:10])])
  np.testing.assert_array_equal(tree.tokens[:8], old[10:18])
  assert drafter.stats["history_index_builds"] == 1
  drafter.propose([query(old[:11])])
  assert drafter.stats["history_index_builds"] == 1  # cached
  drafter.begin_epoch(1)
  new = old[:30] + [1, 2, 3]
  drafter.record_group(KEY, [new])  # epochs_kept=1: epoch 0 is replaced
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


def test_lookahead_changes_no_adaptive_state_and_its_continuation_is_the_true_one():
  """A tree drafted ahead from the context before a step, cut below the emitted tokens, drafts
  the true continuation; `lookahead` leaves budgets and stats `observe` reads untouched."""
  future = true_response(5)
  store = HistoryStore()
  store.add_group(KEY, 0, [future, future[::-1]])
  drafter = HistoryDrafter(store, start_budget=2, max_budget=8)
  pos = 10
  q = query(future[:pos], budget=8)
  wide, = drafter.lookahead([dataclasses.replace(q, budget=17)])
  # Capped at this step's adaptive draft (2) + bonus + the next budget (<= 4): one chain.
  assert wide.size == 7 and tree_depth(wide) == 7
  assert drafter.budget_of(0) == 2 and drafter.stats["propose_calls"] == 0
  emitted = future[pos:pos + 3]  # two drafted tokens accepted + the bonus
  ahead = wide.after(emitted)
  tree, = drafter.propose([dataclasses.replace(query(np.concatenate([future[:pos], emitted])),
                                               ahead=ahead)])
  assert drafter.stats["ahead_used"] == 1
  assert tree.size == 2  # the adaptive budget still applies
  np.testing.assert_array_equal(tree.tokens[:2], future[pos + 3:pos + 5])
  synchronous, = HistoryDrafter(store, start_budget=2, max_budget=8).propose(
      [query(np.concatenate([future[:pos], emitted]))])
  np.testing.assert_array_equal(tree.tokens, synchronous.tokens)
  assert wide.after(future[pos:pos + 2][::-1]) is None  # emitted tokens that left the tree


def test_bad_config_is_named():
  with pytest.raises(ValueError, match="min_match"):
    HistoryDrafter(HistoryStore(), min_match=5, max_match=3)
  with pytest.raises(ValueError, match="start_budget"):
    HistoryDrafter(HistoryStore(), start_budget=32, max_budget=16)
  with pytest.raises(ValueError, match="needs a HistoryStore"):
    HistoryDrafter(None)
