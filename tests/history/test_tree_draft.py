"""Tree drafts: every path continues a matched suffix in the indexed text, probabilities are
best-first and above the floor, sources merge without duplicate paths, root fallback branches."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rhyme_jax.history.suffix_index import SuffixIndex
from rhyme_jax.history.tree_draft import build_tree, match_sources, tree_depth


def paths(tree):
  """Token path from the root to each valid node."""
  out = []
  for i in range(len(tree.tokens)):
    if not tree.valid[i]:
      continue
    path, j = [], i
    while j >= 0:
      path.append(int(tree.tokens[j]))
      j = int(tree.parents[j])
    out.append(path[::-1])
  return out


def occurs_after(seqs, prefix, path):
  s = list(prefix) + list(path)
  return any(list(q[i:i + len(s)]) == s for q in seqs for i in range(len(q) - len(s) + 1))


def build_index(seqs, depth=24):
  index = SuffixIndex(depth)
  for q in seqs:
    index.add_sequence(q)
  return index


seqs_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1,
                         max_size=5)


@settings(max_examples=120, deadline=None)
@given(seqs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(1, 16),
       st.sampled_from([0.01, 0.1, 0.3]), st.integers(1, 3))
def test_paths_continue_an_occurrence_of_the_matched_suffix(seqs, context, budget, min_prob,
                                                            min_len):
  index = build_index(seqs)
  sources = match_sources(index, context, min_len=min_len, max_len=8)
  tree, probs = build_tree(sources, budget, min_prob=min_prob, pad_to=16)
  assert len(tree.tokens) == 16 and tree.size <= budget
  assert np.all(tree.parents[tree.valid] < np.arange(16)[tree.valid])
  assert not tree.valid[tree.size:].any()  # valid nodes first, padding after
  if not sources:
    assert tree.size == 0
    return
  # Every path follows an occurrence of one of the matched suffixes (each >= min_len long).
  lengths = [s.node.length for s in sources]
  assert min(lengths) >= min_len
  for path in paths(tree):
    assert any(occurs_after(seqs, context[len(context) - k:], path) for k in lengths), path
  p = probs[:tree.size]
  assert np.all(p >= min_prob - 1e-6) and np.all(p <= 1 + 1e-6)
  assert np.all(np.diff(p) <= 1e-6)  # best-first: non-increasing in node order
  for i in range(tree.size):  # a child is never likelier than its parent
    if tree.parents[i] >= 0:
      assert p[i] <= p[tree.parents[i]] + 1e-6
  # Sibling nodes (same parent) never repeat a token: identical paths are one node.
  seen = set()
  for i in range(tree.size):
    key = (int(tree.parents[i]), int(tree.tokens[i]))
    assert key not in seen
    seen.add(key)


def test_single_history_gives_its_continuation_as_a_chain():
  rng = np.random.default_rng(1)
  seq = rng.permutation(1000)[:100]
  index = build_index([seq])
  sources = match_sources(index, seq[:40], min_len=2, max_len=8)
  tree, probs = build_tree(sources, 12, min_prob=0.1)
  np.testing.assert_array_equal(tree.tokens, seq[40:52])
  np.testing.assert_array_equal(tree.parents, np.arange(12) - 1)
  np.testing.assert_allclose(probs, 1.0)
  assert tree_depth(tree) == 12


def test_branches_where_histories_disagree():
  a = [5, 6, 7, 8, 1, 2, 3]
  b = [5, 6, 7, 9, 4, 4, 4]
  c = [5, 6, 7, 8, 1, 2, 0]
  index = build_index([a, b, c])
  tree, probs = build_tree(match_sources(index, [5, 6, 7], min_len=2), 16, min_prob=0.1)
  ps = {tuple(p): float(probs[i]) for i, p in enumerate(paths(tree))}
  assert ps[(8,)] == pytest.approx(2 / 3) and ps[(9,)] == pytest.approx(1 / 3)
  assert ps[(8, 1, 2, 3)] == pytest.approx(1 / 3) and ps[(8, 1, 2, 0)] == pytest.approx(1 / 3)
  assert (9, 4, 4, 4) in ps
  # A higher floor prunes the unlikely branches; a budget of 3 keeps the best nodes only.
  tree, _ = build_tree(match_sources(index, [5, 6, 7], min_len=2), 16, min_prob=0.5)
  assert paths(tree) == [[8], [8, 1], [8, 1, 2]]
  tree, _ = build_tree(match_sources(index, [5, 6, 7], min_len=2), 3, min_prob=0.1)
  assert paths(tree) == [[8], [8, 1], [8, 1, 2]]


def test_root_falls_back_to_shorter_suffixes():
  # "1 2 3" occurs once (followed by 4); "2 3" also occurs followed by 5 and 6.
  index = build_index([[1, 2, 3, 4], [9, 2, 3, 5], [8, 2, 3, 6], [7, 2, 3, 5]])
  sources = match_sources(index, [1, 2, 3], min_len=2, max_len=8, decay=0.5)
  assert [s.node.length for s in sources] == [3, 2]
  assert [s.weight for s in sources] == [1.0, 0.5]
  tree, probs = build_tree(sources, 8, min_prob=0.05)
  ps = {tuple(p): float(probs[i]) for i, p in enumerate(paths(tree))}
  # mixture: (1 * [4:1] + 0.5 * [4:1/4, 5:2/4, 6:1/4]) / 1.5
  assert ps[(4,)] == pytest.approx((1 + 0.5 / 4) / 1.5)
  assert ps[(5,)] == pytest.approx(0.25 / 1.5) and ps[(6,)] == pytest.approx(0.125 / 1.5)
  # Without the fallback only the single continuation would be drafted.
  single = match_sources(index, [1, 2, 3], min_len=3)
  assert [p for p in paths(build_tree(single, 8)[0])] == [[4]]


def test_merging_identical_sources_dedupes_paths():
  seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [2, 3, 4, 5, 1]]
  one = build_index(seqs)
  two = build_index(seqs)
  ctx = [0, 1, 2, 3]
  t1, p1 = build_tree(match_sources(one, ctx), 16, min_prob=0.05)
  t2, p2 = build_tree(match_sources(one, ctx) + match_sources(two, ctx), 16, min_prob=0.05)
  np.testing.assert_array_equal(t1.tokens, t2.tokens)
  np.testing.assert_array_equal(t1.parents, t2.parents)
  np.testing.assert_allclose(p1, p2, rtol=1e-6)


def test_empty_sources_and_bad_budget():
  tree, probs = build_tree([], 4, pad_to=8)
  assert tree.size == 0 and len(tree.tokens) == 8 and not probs.any()
  with pytest.raises(ValueError, match="exceeds the padded size"):
    build_tree([], 9, pad_to=8)
