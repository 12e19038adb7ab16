"""Lossless acceptance of a verified draft tree, and the tree's attention layout.

The verify step feeds the root (the last emitted token) plus T draft nodes: node 0 is the root,
node j ≥ 1 is draft token j−1. At every node the target's distribution is sampled with the key
of that position; walking from the root, a node's sample that equals one of its children's
tokens descends into that child, anything else is emitted and ends the walk (at a leaf it is the
bonus token). Every emitted token is therefore a sample of the target itself, whatever the
draft: drafts decide only how many tokens one forward pass yields.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.rollout.drafts import DraftTree


class TreeBatch(NamedTuple):
  """Device inputs describing B padded draft trees of budget T (host-built, numpy)."""

  tokens_BxT: np.ndarray  # int32 draft tokens
  parents_BxT: np.ndarray  # int32 parent node (0 = root, j ≥ 1 = draft j−1), node numbering
  valid_BxT: np.ndarray  # bool
  depth_BxT: np.ndarray  # int32 depth below the root (≥ 1)
  mask_BxNxN: np.ndarray  # bool, N = T+1: node i sees node j iff j is i's ancestor or itself


def pack_trees(trees: Sequence[DraftTree], budget: int) -> TreeBatch:
  """Pads trees to `budget` and builds parents in node numbering, depths and ancestor masks.

  A node below an invalid node is dropped (invalid). Vectorised over the batch, one pass over
  node positions: it runs before every step, on the critical path.
  """
  b, n = len(trees), budget + 1
  mask = np.zeros((b, n, n), bool)
  mask[:, :, 0] = True
  idx = np.arange(n)
  mask[:, idx, idx] = True
  parents = np.zeros((b, budget), np.int32)
  depth = np.ones((b, budget), np.int32)
  if budget == 0 or b == 0:
    return TreeBatch(np.zeros((b, budget), np.int32), parents, np.zeros((b, budget), bool),
                     depth, mask)
  padded = [t if len(t.tokens) == budget else t.padded(budget) for t in trees]
  tokens = np.stack([t.tokens for t in padded]).astype(np.int32)
  valid = np.stack([t.valid for t in padded]).astype(bool)
  draft_parents = np.stack([t.parents for t in padded]).astype(np.int32)
  rows = np.arange(b)
  for j in range(budget):
    p = draft_parents[:, j]
    has_parent = p >= 0
    at = np.maximum(p, 0)
    valid[:, j] &= ~has_parent | valid[rows, at]  # orphans of invalid nodes are dropped
    v = valid[:, j]
    parents[:, j] = np.where(v, p + 1, 0)
    depth[:, j] = np.where(v & has_parent, depth[rows, at] + 1, 1)
    mask[v, j + 1] |= mask[rows[v], p[v] + 1]
  return TreeBatch(tokens, parents, valid, depth, mask)


class Accepted(NamedTuple):
  """Result of the accept walk for B rows of N = T+1 nodes."""

  num_accepted_B: jax.Array  # int32 draft tokens accepted (the emitted count is this + 1)
  path_BxT: jax.Array  # int32 node ids (1..T) of accepted draft nodes in depth order; 0-padded
  last_node_B: jax.Array  # int32 node whose sample is the final (bonus) token


def accept_walk(sampled_BxN: jax.Array, tokens_BxT: jax.Array, parents_BxT: jax.Array,
                valid_BxT: jax.Array) -> Accepted:
  """Descends from the root while a node's sample equals one of its children's tokens.

  Where siblings repeat a token only the first is followed. Nodes are topologically ordered
  (parent id < node id), so a single pass in node order decides every node.
  """
  tokens_BxT, parents_BxT, valid_BxT = map(jnp.asarray, (tokens_BxT, parents_BxT, valid_BxT))
  b, t = tokens_BxT.shape
  n = t + 1

  def body(j, carry):
    on_path_BxN, taken_BxN = carry
    parent_B = parents_BxT[:, j]
    parent_sample_B = jnp.take_along_axis(sampled_BxN, parent_B[:, None], axis=1)[:, 0]
    parent_on_B = jnp.take_along_axis(on_path_BxN, parent_B[:, None], axis=1)[:, 0]
    parent_taken_B = jnp.take_along_axis(taken_BxN, parent_B[:, None], axis=1)[:, 0]
    ok_B = (valid_BxT[:, j] & parent_on_B & ~parent_taken_B
            & (tokens_BxT[:, j] == parent_sample_B))
    on_path_BxN = on_path_BxN.at[:, j + 1].set(ok_B)
    taken_BxN = taken_BxN.at[jnp.arange(b), parent_B].set(parent_taken_B | ok_B)
    return on_path_BxN, taken_BxN

  on_path = jnp.zeros((b, n), bool).at[:, 0].set(True)
  on_path, _ = jax.lax.fori_loop(0, t, body, (on_path, jnp.zeros((b, n), bool)))
  drafted_on_BxT = on_path[:, 1:]
  num_B = jnp.sum(drafted_on_BxT, axis=1).astype(jnp.int32)
  # Accepted nodes in increasing id = increasing depth along the single accepted path.
  order_BxT = jnp.argsort(~drafted_on_BxT, axis=1, stable=True).astype(jnp.int32)
  path_BxT = jnp.where(jnp.arange(t)[None, :] < num_B[:, None], order_BxT + 1, 0)
  last_B = jnp.where(num_B > 0,
                     jnp.take_along_axis(path_BxT, jnp.maximum(num_B - 1, 0)[:, None], 1)[:, 0],
                     0)
  return Accepted(num_B, path_BxT, last_B)


def emitted_nodes(acc: Accepted) -> jax.Array:
  """B×N node ids whose samples are emitted in order: root, then each accepted node; the
  k-th emitted token is sampled at node k (k ≤ num_accepted); entries past it are 0."""
  b, t = acc.path_BxT.shape
  return jnp.concatenate([jnp.zeros((b, 1), jnp.int32), acc.path_BxT], axis=1)
