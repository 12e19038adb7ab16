"""The packed verify layout (host) and the lossless accept rule over it (device).

Each step packs every live row's root (its last emitted token) followed by its draft nodes onto
one token axis of static size P; a row without a draft costs one position. Per packed token:
its draft token, the packed index of its parent, its depth below the root and its ancestor bits
(bit j: the row's new token j is an ancestor or the token itself; bit 0 is the root).

Accepting is closed form. At every node the target is sampled with the key of that position;
a draft node "matches" when its token equals its parent's sample. A node lies on the accepted
path iff every draft ancestor matches: (ancestor bits & ~matched bits of its row) == root bit.
Siblings never repeat a token (`pack` makes a repeat dead), so the path is a single chain; the
samples along it, by depth, are the emitted tokens, the deepest one being the bonus token.
Every emitted token is a sample of the target itself, whatever the draft.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.models.attention import packed_rows

WORDS = 1  # uint32 words of ancestor bits per token
MAX_ROW_TOKENS = 32 * WORDS  # root + draft nodes of one row
NEVER = -1  # the token of a packed node that must never be accepted: no sample equals it


class PackedTrees(NamedTuple):
  """Host-built (numpy) inputs of one verify step: B rows' tokens on a P-token axis."""

  tokens_P: np.ndarray  # int32 draft token (a root's entry is unused: roots live on device)
  parent_P: np.ndarray  # int32 packed index of the parent (a root points at itself)
  depth_P: np.ndarray  # int32 depth below the root (0 = root)
  mask_PxW: np.ndarray  # uint32 ancestor bits over the row's new tokens, itself included
  q_start_B: np.ndarray  # int32 first packed index of each row
  q_len_B: np.ndarray  # int32 1 + draft nodes for a live row, 0 for an empty slot

  def wire(self) -> np.ndarray:
    """The six arrays as one int32 array of (3 + WORDS) P + 2 B entries (ancestor bits bit-cast),
    so a step's inputs cross to the device in one transfer rather than six (`from_wire`)."""
    return np.concatenate([self.tokens_P, self.parent_P, self.depth_P,
                           self.mask_PxW.reshape(-1).view(np.int32), self.q_start_B,
                           self.q_len_B])

  @classmethod
  def from_wire(cls, wire: jax.Array, b: int) -> "PackedTrees":
    """The trees of `wire` (`wire()`'s int32 vector) for B rows, inside the jitted step:
    static slices and one bit-cast."""
    p = (wire.shape[0] - 2 * b) // (3 + WORDS)
    part = lambda k, n: wire[k:k + n]
    mask_PxW = jax.lax.bitcast_convert_type(part(3 * p, WORDS * p), jnp.uint32).reshape(p, WORDS)
    return cls(part(0, p), part(p, p), part(2 * p, p), mask_PxW,
               part((3 + WORDS) * p, b), part((3 + WORDS) * p + b, b))


def pack(trees: Sequence[tuple[np.ndarray, np.ndarray] | None], live_B: Sequence[bool],
         p: int) -> PackedTrees:
  """Packs per-row (tokens, parents) drafts (cleaned: see DraftTree.cleaned; None = no draft)
  for the live rows into P positions. Raises if they do not fit.

  Drafts only cost speed, even from a drafter that breaks the tree contract: a node whose
  parent is not an earlier node, or that repeats an earlier sibling's token, is packed with the
  token `NEVER`, which no sample equals, so neither it nor its subtree is ever accepted (two
  matching siblings would put two nodes of one depth on the path). Tokens outside the
  vocabulary are the step's to handle (`step.verify_step` embeds them clipped); they never
  match either."""
  b = len(live_B)
  q_len = np.asarray([(1 + (0 if t is None else len(t[0]))) if live else 0
                      for t, live in zip(trees, live_B)], np.int32)
  if q_len.max(initial=0) > MAX_ROW_TOKENS:
    raise ValueError(f"pack: a row has {q_len.max()} tokens, more than {MAX_ROW_TOKENS}")
  q_start = np.zeros(b, np.int32)
  np.cumsum(q_len[:-1], out=q_start[1:])
  total = int(q_len.sum())
  if total > p:
    raise ValueError(f"pack: {total} tokens do not fit the packed size P={p}")
  tokens = np.zeros(p, np.int32)
  parent = np.arange(p, dtype=np.int32)
  depth = np.zeros(p, np.int32)
  mask = np.zeros((p, WORDS), np.uint32)
  mask[q_start[q_len > 0], 0] = 1  # every live row's root (a plain step packs nothing else)
  rows = np.flatnonzero(q_len > 1)  # rows with draft nodes
  if len(rows):  # draft nodes (a bucket's empty rows pack nothing, so `total` cannot tell)
    _pack_nodes(trees, rows, q_start[rows], q_len[rows] - 1, total, tokens, parent, depth, mask)
    # a sibling repeating an earlier one's token is dead too
    node = np.flatnonzero(depth > 0)
    key = parent[node].astype(np.int64) << 32 | tokens[node].astype(np.int64) & 0xFFFFFFFF
    first = np.zeros(len(node), bool)
    first[np.unique(key, return_index=True)[1]] = True
    tokens[node[~first]] = NEVER
  return PackedTrees(tokens, parent, depth, mask, q_start, q_len)


def _pack_nodes(trees, rows: np.ndarray, start_R: np.ndarray, n_R: np.ndarray, total: int,
                tokens: np.ndarray, parent: np.ndarray, depth: np.ndarray, mask: np.ndarray
                ) -> None:
  """Writes the draft nodes of `rows` (n_R nodes after each row's root at start_R) into the
  packed arrays, vectorised over all nodes (a step packs ~1000 at 64 rows, budget 16: one
  Python iteration per node was most of a step's host time). A node's depth and ancestor bits
  come from pointer jumping: each round adds the part of its path its current ancestor
  covers and jumps that ancestor to its own, so after k rounds 2**k edges are summed; rows
  hold < 32 nodes, so at most 5 rounds (fewer for shallow drafts)."""
  toks = np.concatenate([trees[r][0] for r in rows])
  pars = [trees[r][1] for r in rows]
  if any(len(q) != n for q, n in zip(pars, n_R.tolist())):  # cut, or padded with -2: not a tree
    pars = [np.concatenate([np.asarray(q, np.int64)[:n], np.full(max(n - len(q), 0), -2)])
            for q, n in zip(pars, n_R.tolist())]
  pars = np.concatenate(pars).astype(np.int64)
  first = np.repeat(np.cumsum(n_R) - n_R, n_R)  # each node's row's first node
  j = np.arange(len(toks)) - first  # row-local node index (its packed offset - 1)
  row_start = np.repeat(start_R, n_R)
  at = row_start + 1 + j  # packed index
  par = pars + 1  # row-local index of the parent (0 = root)
  bad = (par < 0) | (par > j)  # not a tree (a drafter's bug): a dead node below the root
  par[bad] = 0
  tokens[at] = toks
  tokens[at[bad]] = NEVER
  parent[at] = row_start + par
  anc = parent[:total].astype(np.intp)
  bits = np.zeros(total, np.uint32)
  bits[at] = np.left_shift(np.uint32(1), (j + 1).astype(np.uint32))
  dep = np.zeros(total, np.int32)
  dep[at] = 1
  for _ in range(int(n_R.max()).bit_length()):  # 2**rounds > n >= any depth
    bits, dep, anc = bits | bits[anc], dep + dep[anc], anc[anc]
  mask[:total, 0] = bits | 1  # the root's bit (0), which every node's path holds
  depth[:total] = dep


class Accepted(NamedTuple):
  """Result of the accept rule for B rows (T = static bound of tokens per row)."""

  emitted_BxT: jax.Array  # int32 samples along the accepted path by depth (first num+1 valid)
  logprobs_BxT: jax.Array  # float32 their log-probabilities
  num_accepted_B: jax.Array  # int32 draft nodes accepted (emitted = this + 1 for a live row)
  on_path_P: jax.Array  # bool packed tokens on the accepted path (roots of live rows included)


def accept_packed(sampled_P: jax.Array, logp_P: jax.Array, trees: PackedTrees, b: int, t: int
                  ) -> Accepted:
  """The accept rule in closed form from ancestor bits (no loop over nodes)."""
  p = sampled_P.shape[0]
  row_P, i_P, valid_P = packed_rows(trees.q_start_B, trees.q_len_B, p)
  is_root_P = i_P == 0
  matched_P = valid_P & ~is_root_P & (trees.tokens_P == sampled_P[trees.parent_P])
  bit_P = jnp.left_shift(jnp.uint32(1), jnp.clip(i_P, 0, 31).astype(jnp.uint32))
  matched_B = jax.ops.segment_sum(jnp.where(matched_P, bit_P, jnp.uint32(0)), row_P,
                                  num_segments=b) | jnp.uint32(1)  # distinct bits: sum = OR
  mask_P = trees.mask_PxW[:, 0]
  on_path_P = valid_P & ((mask_P & ~matched_B[row_P]) == 0)
  num_B = jax.ops.segment_sum(on_path_P.astype(jnp.int32), row_P, num_segments=b)
  num_accepted_B = jnp.maximum(num_B - 1, 0)
  col_P = jnp.where(on_path_P, trees.depth_P, t)  # off-path entries are dropped
  emitted = jnp.zeros((b, t), jnp.int32).at[row_P, col_P].set(sampled_P, mode="drop")
  logprobs = jnp.zeros((b, t), jnp.float32).at[row_P, col_P].set(logp_P, mode="drop")
  return Accepted(emitted, logprobs, num_accepted_B.astype(jnp.int32), on_path_P)
