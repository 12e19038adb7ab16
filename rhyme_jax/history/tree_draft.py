"""Draft trees from suffix-index matches: best-first by path probability, merged over sources.

A *source* is a matched node in one index (past responses of the prompt, or the growing
responses of its siblings) with a mixture weight. The draft is a walk over the *merged* tree of
continuations: a draft node is a token path from the root, and its next-token distribution is
the weighted mixture of every source's continuation frequencies (count(child)/Σ counts) along
that same path. Identical paths from different sources are therefore one node (dedupe), and
their evidence adds up. Nodes are taken best-first by path probability (product of the mixture
probabilities from the root) while it is >= `min_prob` and the token budget lasts, so the tree
branches exactly where the history disagrees with itself.

Root fallback (DESIGN §4): the longest match of the context often occurs once, which gives a
single chain and nothing to branch on. `match_sources` therefore also takes the shorter suffixes
(down the suffix links, each a state with different continuation counts) while the longer ones
have a single continuation, with geometrically decaying weights so the longest match dominates
where they disagree.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from rhyme_jax.history.suffix_index import Node, SuffixIndex
from rhyme_jax.rollout.drafts import DraftTree


@dataclasses.dataclass(frozen=True)
class Source:
  """A place to draft from: a matched node in an index, with its mixture weight."""

  index: SuffixIndex
  node: Node
  weight: float


def match_sources(index: SuffixIndex, context: Sequence[int], *, min_len: int = 2,
                  max_len: int = 8, weight: float = 1.0, decay: float = 0.5,
                  max_sources: int = 4) -> list[Source]:
  """Sources from the longest suffix of `context` found in `index`, falling back to shorter ones.

  Walks from the longest match down its suffix links (length >= min_len), skipping nodes with no
  continuation (e.g. a live sequence matching its own end), and stops after the first node whose
  continuations branch (>= 2 distinct tokens) or after `max_sources` sources.
  """
  max_len = min(max_len, index.max_depth - 1)
  if max_len < min_len:
    return []
  node = index.match(context, max_len, min_len)
  out: list[Source] = []
  w = float(weight)
  while node is not None and node.length >= min_len and len(out) < max_sources:
    cont, _ = index.continuations(node)  # (sentinel tokens < 0 are never drafted)
    if cont:
      out.append(Source(index, node, w))
      w *= decay
      if len(cont) >= 2:
        break
    node = index.shorter(node)
  return out


def _mixture(sources: Sequence[Source], min_share: float = 0.0
             ) -> dict[int, tuple[float, list[Source]]]:
  """{token: (probability, child sources)} of the weighted mixture over sources, for tokens of
  probability >= min_share (child nodes are looked up only for those)."""
  per_src = []
  total_w = 0.0
  for s in sources:
    cont, tot = s.index.continuations(s.node)
    if tot:
      per_src.append((s, cont, tot))
      total_w += s.weight
  probs: dict[int, float] = {}
  for s, cont, tot in per_src:
    f = s.weight / (tot * total_w)
    for tok, c in cont.items():
      probs[tok] = probs.get(tok, 0.0) + c * f
  out: dict[int, tuple[float, list[Source]]] = {}
  for tok, p in probs.items():
    if p < min_share:
      continue
    children = []
    for s, cont, tot in per_src:
      c = cont.get(tok)
      if c:
        children.append(Source(s.index, s.index.child(s.node, tok), s.weight * c / tot))
    out[tok] = (p, children)
  return out


def build_tree(sources: Sequence[Source], budget: int, *, min_prob: float = 0.1,
               pad_to: int | None = None,
               max_depth: int | None = None) -> tuple[DraftTree, np.ndarray]:
  """Best-first draft tree of at most `budget` nodes, padded to `pad_to` (default budget).

  Returns the tree and float32[pad_to] path probabilities of its nodes (0 for padding).
  """
  pad_to = budget if pad_to is None else pad_to
  if budget > pad_to:
    raise ValueError(f"build_tree: budget {budget} exceeds the padded size {pad_to}")
  probs = np.zeros(pad_to, np.float32)
  nodes: list[tuple[int, int]] = []
  heap: list[tuple[float, int, int, int, int, list[Source]]] = []
  counter = 0

  def push(parent: int, depth: int, srcs: Sequence[Source], prob: float) -> None:
    nonlocal counter
    if max_depth is not None and depth >= max_depth:
      return
    for tok, (share, children) in _mixture(srcs, min_prob / prob).items():
      p = prob * share
      if p >= min_prob:  # (re-checked: the division above can round either way)
        heapq.heappush(heap, (-p, counter, tok, parent, depth + 1, children))
        counter += 1

  if budget > 0:
    push(-1, 0, sources, 1.0)
  while heap and len(nodes) < budget:
    neg_p, _, tok, parent, depth, srcs = heapq.heappop(heap)
    me = len(nodes)
    nodes.append((tok, parent))
    probs[me] = -neg_p
    push(me, depth, srcs, -neg_p)
  return DraftTree.from_nodes(nodes, pad_to), probs


def tree_depth(tree: DraftTree) -> int:
  """The longest root-to-leaf path of valid nodes (0 for an empty tree)."""
  if not tree.valid.any():
    return 0
  return int(tree.depth()[tree.valid].max())
