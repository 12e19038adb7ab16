"""The on-device accept walk against a plain-Python walk over random trees."""

import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rollout import accept
from rhyme_jax.rollout.drafts import DraftTree


def random_tree(rng, budget, vocab):
  n = int(rng.integers(0, budget + 1))
  nodes = [(int(rng.integers(vocab)), int(rng.integers(-1, i))) for i in range(n)]
  return DraftTree.from_nodes(nodes, budget)


def reference_walk(sampled, tree):
  """Emitted node ids: start at the root (node 0); follow the first child whose token equals
  the node's sample."""
  node, path = 0, [0]
  while True:
    kids = [j for j in range(len(tree.tokens)) if tree.valid[j] and tree.parents[j] + 1 == node]
    nxt = next((j + 1 for j in kids if tree.tokens[j] == sampled[node]), None)
    if nxt is None:
      return path
    node = nxt
    path.append(node)


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_accept_walk_matches_reference(budget):
  rng = np.random.default_rng(budget)
  vocab, b = 3, 256  # a tiny vocabulary makes deep matches and duplicate siblings common
  trees = [random_tree(rng, budget, vocab) for _ in range(b)]
  batch = accept.pack_trees(trees, budget)
  sampled = rng.integers(0, vocab, size=(b, budget + 1)).astype(np.int32)
  acc = accept.accept_walk(jnp.asarray(sampled), batch.tokens_BxT, batch.parents_BxT,
                           batch.valid_BxT)
  nodes = np.asarray(accept.emitted_nodes(acc))
  num = np.asarray(acc.num_accepted_B)
  deep = 0
  for row, tree in enumerate(trees):
    want = reference_walk(sampled[row], tree)
    assert num[row] == len(want) - 1
    np.testing.assert_array_equal(nodes[row, :len(want)], want)
    assert acc.last_node_B[row] == want[-1]
    deep = max(deep, len(want) - 1)
  assert deep >= min(budget, 2)  # the test exercised multi-token acceptance


def test_pack_trees_ancestor_mask_and_depth():
  tree = DraftTree.from_nodes([(5, -1), (6, 0), (7, -1), (8, 1)], budget=6)
  batch = accept.pack_trees([tree], 6)
  np.testing.assert_array_equal(batch.depth_BxT[0, :4], [1, 2, 1, 3])
  np.testing.assert_array_equal(batch.parents_BxT[0, :4], [0, 1, 0, 2])
  mask = batch.mask_BxNxN[0]
  # node 4 (draft 3, token 8) sees root, draft 0, draft 1 and itself, not draft 2.
  np.testing.assert_array_equal(np.nonzero(mask[4])[0], [0, 1, 2, 4])
  np.testing.assert_array_equal(np.nonzero(mask[3])[0], [0, 3])
  # padding nodes see only the root and themselves
  np.testing.assert_array_equal(np.nonzero(mask[6])[0], [0, 6])
  assert not batch.valid_BxT[0, 4:].any()


def test_truncated_tree_drops_orphans():
  tree = DraftTree.from_nodes([(1, -1), (2, 0), (3, 1)], budget=3)
  small = tree.padded(2)
  assert small.size == 2
  bigger = tree.padded(5)
  assert bigger.size == 3 and len(bigger.tokens) == 5


def test_from_nodes_rejects_forward_parent():
  with pytest.raises(ValueError, match="parent 3"):
    DraftTree.from_nodes([(1, -1), (2, 3)], budget=4)


def _pack_one_reference(tree, budget):
  """Node-by-node construction of one row of pack_trees (the definition)."""
  n = budget + 1
  t = tree.padded(budget)
  valid = t.valid.copy()
  parents, depth = np.zeros(budget, np.int32), np.ones(budget, np.int32)
  mask = np.zeros((n, n), bool)
  mask[:, 0] = True
  mask[np.arange(n), np.arange(n)] = True
  for j in range(budget):
    p = int(t.parents[j])
    if not valid[j] or (p >= 0 and not valid[p]):
      valid[j] = False
      continue
    parents[j] = p + 1
    depth[j] = 1 if p < 0 else depth[p] + 1
    mask[j + 1] |= mask[p + 1]
  return t.tokens, parents, valid, depth, mask


def test_pack_trees_matches_the_node_by_node_definition():
  rng = np.random.default_rng(0)
  for budget in (1, 3, 8):
    trees = []
    for _ in range(12):
      size = int(rng.integers(0, budget + 1))
      nodes = [(int(rng.integers(50)), int(rng.integers(-1, i))) for i in range(size)]
      tree = DraftTree.from_nodes(nodes, int(rng.integers(budget // 2, budget + 2)))
      tree.valid[rng.random(len(tree.valid)) < 0.15] = False  # orphans below these
      trees.append(tree)
    batch = accept.pack_trees(trees, budget)
    for row, tree in enumerate(trees):
      want = _pack_one_reference(tree, budget)
      got = (batch.tokens_BxT[row], batch.parents_BxT[row], batch.valid_BxT[row],
             batch.depth_BxT[row], batch.mask_BxNxN[row])
      for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)
