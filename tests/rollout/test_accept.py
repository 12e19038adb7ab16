"""The packed layout and the closed-form accept rule against a plain-Python walk over random
trees, and DraftTree cleaning (what the engine packs)."""

import jax.numpy as jnp
import numpy as np
import pytest

from rhyme_jax.rollout import accept
from rhyme_jax.rollout.drafts import DraftTree


def random_tree(rng, budget, vocab):
  n = int(rng.integers(0, budget + 1))
  nodes = [(int(rng.integers(vocab)), int(rng.integers(-1, i))) for i in range(n)]
  return DraftTree.from_nodes(nodes)


def reference_walk(sampled, toks, pars):
  """Row-local ids of emitted nodes: start at the root (0); follow the first child whose token
  equals the node's sample."""
  node, path = 0, [0]
  while True:
    kids = [j + 1 for j in range(len(toks)) if pars[j] + 1 == node]
    nxt = next((j for j in kids if toks[j - 1] == sampled[node]), None)
    if nxt is None:
      return path
    node = nxt
    path.append(node)


@pytest.mark.parametrize("budget", [1, 4, 9, 31])
def test_accept_packed_matches_reference(budget):
  rng = np.random.default_rng(budget)
  vocab, b = 3, 128  # a tiny vocabulary makes deep matches and duplicate siblings common
  live = rng.random(b) < 0.9
  cleaned = [random_tree(rng, budget, vocab).cleaned(budget) for _ in range(b)]
  trees = [(t, p) for t, p, _ in cleaned]
  need = int(sum(1 + len(t) for (t, _), l in zip(trees, live) if l))
  packed = accept.pack(trees, live, need + 5)  # a few padding positions
  t = 1 + budget
  sampled_P = rng.integers(0, vocab, size=need + 5).astype(np.int32)
  logp_P = -rng.random(need + 5).astype(np.float32)
  acc = accept.accept_packed(jnp.asarray(sampled_P), jnp.asarray(logp_P),
                             accept.PackedTrees(*map(jnp.asarray, packed)), b, t)
  emitted, logp = np.asarray(acc.emitted_BxT), np.asarray(acc.logprobs_BxT)
  num = np.asarray(acc.num_accepted_B)
  deep = 0
  for r in range(b):
    if not live[r]:
      assert num[r] == 0
      continue
    s = packed.q_start_B[r]
    want = reference_walk(sampled_P[s:s + packed.q_len_B[r]], *trees[r])
    assert num[r] == len(want) - 1
    np.testing.assert_array_equal(emitted[r, :len(want)], sampled_P[s + np.asarray(want)])
    np.testing.assert_array_equal(logp[r, :len(want)], logp_P[s + np.asarray(want)])
    deep = max(deep, len(want) - 1)
  assert deep >= min(budget, 2)  # the test exercised multi-token acceptance


def test_pack_layout_ancestor_bits_and_depth():
  tree = DraftTree.from_nodes([(5, -1), (6, 0), (7, -1), (8, 1)], budget=6)
  toks, pars, _ = tree.cleaned(8)
  packed = accept.pack([None, (toks, pars)], [True, True], 8)
  np.testing.assert_array_equal(packed.q_start_B, [0, 1])
  np.testing.assert_array_equal(packed.q_len_B, [1, 5])
  np.testing.assert_array_equal(packed.depth_P[:6], [0, 0, 1, 2, 1, 3])
  np.testing.assert_array_equal(packed.parent_P[:6], [0, 1, 1, 2, 1, 3])
  # row 1, node 4 (token 8) sees the root, nodes 1, 2 and itself, not node 3.
  np.testing.assert_array_equal(packed.mask_PxW[1:6, 0], [0b1, 0b11, 0b111, 0b1001, 0b10111])
  assert packed.q_len_B.sum() == 6  # positions 6, 7 are padding
  with pytest.raises(ValueError, match="do not fit the packed size P=5"):
    accept.pack([None, (toks, pars)], [True, True], 5)


def test_cleaned_drops_invalid_subtrees_and_repeated_siblings():
  tree = DraftTree.from_nodes([(1, -1), (2, 0), (1, -1), (3, 2), (4, 0)], budget=7)
  tree.valid[1] = False  # an invalid node is dropped
  toks, pars, probs = tree.cleaned(10)
  # node 2 repeats node 0's token under the root: dropped with its child (token 3)
  np.testing.assert_array_equal(toks, [1, 4])
  np.testing.assert_array_equal(pars, [-1, 0])
  assert probs is None
  with_probs = DraftTree.of([5, 6, 7], [-1, 0, 1], probs=[0.9, 0.5, 0.2])
  toks, pars, probs = with_probs.cleaned(2)
  np.testing.assert_array_equal(toks, [5, 6])
  np.testing.assert_allclose(probs, [0.9, 0.5])


def test_truncated_tree_drops_orphans():
  tree = DraftTree.from_nodes([(1, -1), (2, 0), (3, 1)], budget=3)
  small = tree.padded(2)
  assert small.size == 2
  bigger = tree.padded(5)
  assert bigger.size == 3 and len(bigger.tokens) == 5


def test_from_nodes_rejects_forward_parent():
  with pytest.raises(ValueError, match="parent 3"):
    DraftTree.from_nodes([(1, -1), (2, 3)], budget=4)


def test_pack_kills_nodes_that_break_the_tree_contract():
  """A drafter that flags malformed trees as clean (`DraftTree.clean`) reaches `pack` as is:
  a parent that is not an earlier node, or a sibling repeating a token, must never be followed,
  and neither must anything below it."""
  rows = [(np.array([5, 5, 6], np.int32), np.array([-1, -1, 1], np.int32)),  # repeat, its child
          (np.array([7, 8, 9, 4], np.int32), np.array([-1, 3, -3, 0], np.int32))]  # bad parents
  packed = accept.pack(rows, [True, True], 12)
  np.testing.assert_array_equal(packed.tokens_P[:9], [0, 5, accept.NEVER, 6,
                                                      0, 7, accept.NEVER, accept.NEVER, 4])
  np.testing.assert_array_equal(packed.parent_P[:9], [0, 0, 0, 2, 4, 4, 4, 4, 5])
  # Every sample equals every draft token that is not NEVER: the target "agrees" everywhere.
  sampled = np.array([5, 6, 6, 9, 7, 4, 9, 9, 1, 0, 0, 0], np.int32)
  acc = accept.accept_packed(jnp.asarray(sampled), jnp.zeros(12), accept.PackedTrees(
      *map(jnp.asarray, packed)), 2, 5)
  np.testing.assert_array_equal(acc.num_accepted_B, [1, 2])  # 5 | 7 -> 4
  np.testing.assert_array_equal(np.asarray(acc.emitted_BxT)[:, :3], [[5, 6, 0], [7, 4, 1]])
  for r, (toks, pars) in enumerate(rows):  # the walk over the tree as a valid tree reads it
    s = int(packed.q_start_B[r])
    ok = [t if t != accept.NEVER else -99 for t in packed.tokens_P[s + 1:s + 1 + len(toks)]]
    path = reference_walk(sampled[s:s + 1 + len(toks)], ok,
                          packed.parent_P[s + 1:s + 1 + len(toks)] - s - 1)
    assert len(path) == int(acc.num_accepted_B[r]) + 1


def test_pack_kills_a_repeated_sibling_in_a_bucket_with_empty_rows():
  """The duplicate guard must not depend on how full the bucket is: one live row of 2 nodes in
  a bucket of 4 packs 3 positions, fewer than the bucket's rows. Two matching siblings left
  alive would both sit on the accepted path (one depth counted twice, a token never sampled)."""
  trees = [(np.array([5, 5], np.int32), np.array([-1, -1], np.int32)), None, None, None]
  packed = accept.pack(trees, [True, False, False, False], 8)
  np.testing.assert_array_equal(packed.tokens_P[:3], [0, 5, accept.NEVER])
  acc = accept.accept_packed(jnp.asarray([5, 9, 9, 0, 0, 0, 0, 0], jnp.int32), jnp.zeros(8),
                             accept.PackedTrees(*map(jnp.asarray, packed)), 4, 3)
  assert int(acc.num_accepted_B[0]) == 1
  np.testing.assert_array_equal(np.asarray(acc.emitted_BxT)[0, :2], [5, 9])


def reference_layout(trees, live, p):
  """The packed layout node by node, as `pack` defines it: (tokens, parent, depth, ancestor
  bits) per packed position, a node with a bad parent (or none given) dead below the root, a
  sibling repeating an earlier live sibling's token dead."""
  tokens, parent, depth, bits = [0] * p, list(range(p)), [0] * p, [0] * p
  at = 0
  for tree, is_live in zip(trees, live):
    if not is_live:
      continue
    toks, pars = ([], []) if tree is None else tree
    s, bits[at] = at, 1
    seen = set()
    for j, tok in enumerate(toks):
      par = int(pars[j]) + 1 if j < len(pars) else -1
      dead = not 0 <= par <= j
      par = 0 if dead else par
      dead = dead or (s + par, int(tok)) in seen
      if not dead:
        seen.add((s + par, int(tok)))
      i = s + 1 + j
      tokens[i], parent[i] = (accept.NEVER if dead else int(tok)), s + par
      depth[i], bits[i] = depth[s + par] + 1, bits[s + par] | 1 << (j + 1)
    at = s + 1 + len(toks)
  return tokens, parent, depth, bits


def test_pack_matches_a_node_by_node_layout_on_random_and_malformed_trees():
  """`pack` lays every row's nodes out at once (pointer jumping for depths and ancestor bits);
  it must give what a walk over each node gives, for drafts that break the tree contract too:
  parents out of range, parent lists longer or shorter than the tokens, repeated siblings."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    b = int(rng.integers(1, 12))
    full = 0.85 if rng.random() < 0.5 else 0.2  # half of the buckets mostly empty
    trees, live = [], [bool(rng.random() < full) for _ in range(b)]
    for _ in range(b):
      n = int(rng.integers(0, 4 if rng.random() < 0.5 else accept.MAX_ROW_TOKENS))
      pars = [int(rng.integers(-1, j)) if j else -1 for j in range(n)]
      if n and rng.random() < 0.3:
        pars[int(rng.integers(n))] = int(rng.integers(-4, n + 4))
      if rng.random() < 0.1:
        pars = pars[:int(rng.integers(0, n + 1))] + [0] * int(rng.integers(0, 3))
      toks = rng.integers(0, 3 if rng.random() < 0.5 else 1000, n).astype(np.int32)
      trees.append(None if rng.random() < 0.2 else (toks, np.asarray(pars, np.int32)))
    need = sum(1 + (0 if t is None else len(t[0])) for t, ok in zip(trees, live) if ok)
    packed = accept.pack(trees, live, need + 3)
    tokens, parent, depth, bits = reference_layout(trees, live, need + 3)
    np.testing.assert_array_equal(packed.tokens_P, tokens)
    np.testing.assert_array_equal(packed.parent_P, parent)
    np.testing.assert_array_equal(packed.depth_P, depth)
    np.testing.assert_array_equal(packed.mask_PxW[:, 0], np.asarray(bits, np.uint32))
