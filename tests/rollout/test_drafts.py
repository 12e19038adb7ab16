"""DraftTree helpers: `after` (the continuation of a tree below emitted tokens) and `padded`."""

import numpy as np

from rhyme_jax.rollout.drafts import DraftBatch, DraftTree, cleaned_drafts

# root -> 5 -> 6 -> 7          (nodes 0, 1, 3)
#      -> 5 -> 8               (node 4, child of 0)
#      -> 9                    (node 2)
TREE = DraftTree.from_nodes([(5, -1), (6, 0), (9, -1), (7, 1), (8, 0)], 8)


def nodes(tree):
  return [(int(t), int(p)) for t, p, v in zip(tree.tokens, tree.parents, tree.valid) if v]


def test_after_reroots_the_subtree_below_the_path_in_node_order():
  assert nodes(TREE.after([5])) == [(6, -1), (7, 0), (8, -1)]
  assert nodes(TREE.after([5, 6])) == [(7, -1)]
  assert nodes(TREE.after([])) == nodes(TREE)


def test_after_is_none_off_the_tree_or_at_a_leaf():
  assert TREE.after([6]) is None  # not a child of the root
  assert TREE.after([5, 9]) is None
  assert TREE.after([9]) is None  # a leaf: nothing continues it
  assert TREE.after([5, 6, 7]) is None


def test_after_keeps_the_drafters_estimates_conditional_on_the_path_taken():
  """A node's estimate is the probability its path from the root is accepted; below the
  emitted path the new root has been reached, so each kept node's is divided by the reached
  node's (order, and so best-first, unchanged)."""
  tree = DraftTree.of([5, 6, 9, 7, 8], [-1, 0, -1, 1, 0], probs=[0.9, 0.6, 0.3, 0.4, 0.2])
  np.testing.assert_allclose(tree.after([5]).probs, np.array([0.6, 0.4, 0.2]) / 0.9, rtol=1e-6)
  np.testing.assert_allclose(tree.after([5, 6]).probs, [0.4 / 0.6], rtol=1e-6)
  np.testing.assert_allclose(tree.after([]).probs, tree.probs)
  assert TREE.after([5]).probs is None


def test_cleaned_takes_no_nodes_below_zero_on_either_path():
  tree = DraftTree.of([1, 2, 3], [-1, 0, 1])
  assert len(tree.cleaned(-1)[0]) == 0
  tree.clean = True  # the slice a clean tree takes
  assert len(tree.cleaned(-1)[0]) == 0


def test_after_ignores_invalid_nodes():
  tree = DraftTree.from_nodes([(5, -1), (6, 0), (7, 1)], 4)
  tree.valid[1] = False  # node 2 hangs below an invalid node
  assert TREE.after([5, 6, 7, 1]) is None
  assert tree.after([5]) is None
  assert tree.after([5, 6]) is None


def test_padded_cut_keeps_best_first_prefix_and_drops_orphans():
  cut = TREE.padded(2)
  assert nodes(cut) == [(5, -1), (6, 0)]
  tree = DraftTree.from_nodes([(5, -1), (6, 0), (7, 1), (8, 2)], 4)
  tree.valid[1] = False
  assert nodes(tree.padded(3)) == [(5, -1)]  # a cut drops nodes below invalid ones
  grown = TREE.padded(12)
  assert len(grown.tokens) == 12 and nodes(grown) == nodes(TREE)
  np.testing.assert_array_equal(grown.valid[8:], False)


def test_draft_batch_rows_are_the_trees_it_stands_for():
  """A DraftBatch row, as a tree or cleaned directly, is the clean tree of its first nodes."""
  rng = np.random.default_rng(0)
  sizes = [0, 3, 5, 1]
  tok = rng.integers(0, 100, (4, 5)).astype(np.int32)
  par = np.tile(np.arange(5, dtype=np.int32) - 1, (4, 1))  # chains: parents before children
  prob = np.sort(rng.random((4, 5)), axis=1)[:, ::-1].astype(np.float32)
  batch = DraftBatch(tok, par, prob, sizes)
  assert len(batch) == 4 and len(list(batch)) == 4 and len(batch[1:3]) == 2
  for i, tree in enumerate(batch):
    assert tree.size == sizes[i] and tree.clean
    np.testing.assert_array_equal(tree.tokens, tok[i, :sizes[i]])
    for budget in (0, 2, 9):
      for got, want in zip(batch.cleaned(i, budget), tree.cleaned(budget)):
        np.testing.assert_array_equal(got, want)
  lists = cleaned_drafts(list(batch), [2] * 4)
  for got, want in zip(cleaned_drafts(batch, [2] * 4), lists):
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)

