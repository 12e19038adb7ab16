"""Draft trees and the `DraftSource` interface that every drafter (history, group, learned) meets.

A draft is a small token tree continuing a request's last emitted token (the root):
`tokens[T]`, `parents[T]` (−1 = the root, otherwise an index < i), `valid[T]`, and optionally
`probs[T]`, the drafter's estimate that each node's path is accepted. Drafters return trees
UNPADDED and best-first (any prefix of the nodes is a valid tree); the engine alone decides how
many nodes it verifies (`DraftQuery.budget` is the most it may take). Drafts only ever cost
speed: the engine samples from the target at every node, so garbage drafts change nothing.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Hashable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass
class DraftTree:
  """A host-side draft tree. Nodes are in topological order (parents[i] < i)."""

  tokens: np.ndarray  # int32[T]
  parents: np.ndarray  # int32[T], -1 = child of the root
  valid: np.ndarray  # bool[T] (all True in an unpadded tree)
  probs: np.ndarray | None = None  # float32[T] P(node's path accepted), best-first
  # True when the drafter guarantees the tree is already as `cleaned` leaves it (every node
  # valid, parents before children, no two siblings with one token, best-first): `cleaned` is
  # then a slice, not a walk over the nodes. Only drafters that build trees that way set it.
  clean: bool = False

  @classmethod
  def of(cls, tokens: Sequence[int], parents: Sequence[int],
         probs: Sequence[float] | None = None) -> "DraftTree":
    """An unpadded tree (every node valid)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    return cls(tokens, np.asarray(parents, np.int32).reshape(-1), np.ones(len(tokens), bool),
               None if probs is None else np.asarray(probs, np.float32).reshape(-1))

  def cleaned(self, max_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens, parents, probs) of the first valid nodes, at most `max_nodes`, renumbered:
    invalid nodes, their subtrees and siblings repeating an earlier sibling's token (which the
    accept rule would never follow) are dropped. What the engine packs."""
    if self.clean:
      n = min(max(max_nodes, 0), len(self.tokens))
      return self.tokens[:n], self.parents[:n], None if self.probs is None else self.probs[:n]
    keep = {-1: -1}
    seen = set()
    out_t, out_p, out_q = [], [], []
    for i in range(len(self.tokens)):
      if len(out_t) >= max_nodes:
        break
      par = int(self.parents[i])
      if not self.valid[i] or par not in keep:
        continue
      key = (keep[par], int(self.tokens[i]))
      if key in seen:
        continue
      seen.add(key)
      keep[i] = len(out_t)
      out_t.append(int(self.tokens[i]))
      out_p.append(keep[par])
      if self.probs is not None:
        out_q.append(float(self.probs[i]))
    probs = np.asarray(out_q, np.float32) if self.probs is not None else None
    return np.asarray(out_t, np.int32), np.asarray(out_p, np.int32), probs

  @classmethod
  def empty(cls, budget: int) -> "DraftTree":
    return cls(np.zeros(budget, np.int32), np.full(budget, -1, np.int32), np.zeros(budget, bool))

  @classmethod
  def chain(cls, tokens: Sequence[int], budget: int) -> "DraftTree":
    """A linear draft (each token the child of the previous one), truncated to the budget."""
    tree = cls.empty(budget)
    n = min(len(tokens), budget)
    tree.tokens[:n] = np.asarray(tokens[:n], np.int32)
    tree.parents[:n] = np.arange(n, dtype=np.int32) - 1
    tree.valid[:n] = True
    return tree

  @classmethod
  def from_nodes(cls, nodes: Sequence[tuple[int, int]], budget: int | None = None
                 ) -> "DraftTree":
    """From (token, parent) pairs in topological order; extra nodes past the budget are dropped
    (budget None: unpadded)."""
    tree = cls.empty(len(nodes) if budget is None else budget)
    for i, (tok, parent) in enumerate(nodes[:budget]):
      if not -1 <= parent < i:
        raise ValueError(f"draft node {i}: parent {parent} must be in [-1, {i})")
      tree.tokens[i], tree.parents[i], tree.valid[i] = tok, parent, True
    return tree

  @property
  def size(self) -> int:
    return int(self.valid.sum())

  def depth(self) -> np.ndarray:
    """Depth of each node below the root (children of the root have depth 1)."""
    d = np.zeros(len(self.tokens), np.int32)
    for i, p in enumerate(self.parents):
      d[i] = 1 if p < 0 else d[p] + 1
    return d

  def after(self, path: Sequence[int]) -> "DraftTree | None":
    """The subtree below the node reached from the root by the tokens `path`, as a tree rooted
    at that node (node order kept, so a best-first tree stays best-first); None when `path` is
    not a path of this tree or its end has no children.

    What a tree drafted ahead is good for once a step has emitted `path`: its continuation.
    """
    tokens, parents = self.tokens.tolist(), self.parents.tolist()
    valid = self.valid.tolist()
    node = -1
    for tok in path:  # nodes are topologically ordered: a child comes after its parent
      node = next((i for i in range(node + 1, len(tokens))
                   if valid[i] and parents[i] == node and tokens[i] == tok), None)
      if node is None:
        return None
    new_index = {node: -1}  # kept node -> its index in the subtree
    nodes, kept = [], []
    for i in range(node + 1, len(tokens)):
      if valid[i] and parents[i] in new_index:
        new_index[i] = len(nodes)
        nodes.append((tokens[i], new_index[parents[i]]))
        kept.append(i)
    if not nodes:
      return None
    tree = DraftTree.from_nodes(nodes, len(nodes))
    if self.probs is not None:  # the drafter's estimates, for the engine's cost model: a
      # path's probability from the new root is conditional on having reached it
      reached = float(self.probs[node]) if node >= 0 else 1.0
      tree.probs = (np.minimum(self.probs[kept] / reached, 1.0).astype(np.float32)
                    if reached > 0 else self.probs[kept])
    return tree

  def padded(self, budget: int) -> "DraftTree":
    """The same tree in a budget of another size (nodes past it dropped, with their subtrees)."""
    n = min(budget, len(self.tokens))
    out = DraftTree.empty(budget)
    out.tokens[:n], out.parents[:n], out.valid[:n] = (self.tokens[:n], self.parents[:n],
                                                      self.valid[:n])
    if self.probs is not None:
      out.probs = np.zeros(budget, np.float32)
      out.probs[:n] = self.probs[:n]
    for i, p in enumerate(out.parents[:n]):  # a kept node whose parent is invalid is invalid too
      if p >= 0 and not out.valid[p]:
        out.valid[i] = False
    return out


class DraftBatch(collections.abc.Sequence):
  """The trees of one `propose` call in padded arrays, as a compiled drafter writes them.

  Row i of `tokens_NxW` / `parents_NxW` / `probs_NxW` holds `sizes[i]` nodes, best first and
  clean (see `DraftTree.clean`). Indexing gives row i as a `DraftTree` of views (for code that
  walks trees); the engine takes `cleaned` arrays per row and never builds the objects, which
  at 64 rows cost about as much host time as drafting itself.
  """

  def __init__(self, tokens_NxW: np.ndarray, parents_NxW: np.ndarray, probs_NxW: np.ndarray,
               sizes: Sequence[int]):
    w = tokens_NxW.shape[1]
    self._flat = (tokens_NxW.reshape(-1), parents_NxW.reshape(-1), probs_NxW.reshape(-1))
    self._at = range(0, len(sizes) * w, w)  # row i starts at _at[i] of the flat views
    self.sizes = list(sizes)
    self._ones = np.ones(w, bool)

  def __len__(self) -> int:
    return len(self.sizes)

  def __iter__(self):
    return (self[i] for i in range(len(self.sizes)))

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[k] for k in range(*i.indices(len(self)))]
    o, n = self._at[i], self.sizes[i]
    tok, par, prob = self._flat
    return DraftTree(tok[o:o + n], par[o:o + n], self._ones[:n], prob[o:o + n], True)

  def cleaned(self, i: int, max_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`self[i].cleaned(max_nodes)` without the tree: its first nodes are already clean."""
    o = self._at[i]
    e = o + min(self.sizes[i], max(max_nodes, 0))
    tok, par, prob = self._flat
    return tok[o:e], par[o:e], prob[o:e]


def cleaned_drafts(drafts: Sequence[DraftTree], max_nodes: Sequence[int]
                   ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
  """(tokens, parents, probs) of each draft cleaned to at most max_nodes[i] nodes (what the
  engine packs), from a `DraftBatch` without building its trees."""
  if isinstance(drafts, DraftBatch):
    return [drafts.cleaned(i, n) for i, n in enumerate(max_nodes)]
  return [tree.cleaned(n) for tree, n in zip(drafts, max_nodes)]


@dataclasses.dataclass
class DraftQuery:
  """What a drafter sees of one live request before a step."""

  request_id: int
  group_id: Hashable
  prompt_key: Hashable  # stable key of the prompt (hash of its tokens or a dataset uid)
  prompt: np.ndarray  # int32 prompt tokens
  response: np.ndarray  # int32 response tokens so far; the last one is the tree's root
  budget: int  # the most draft nodes the engine may verify for this request this step
  # A draft prepared ahead, off the critical path: the part of the tree this request's drafter
  # returned from `lookahead` during the previous step that continues what that step emitted
  # (None when the emitted tokens left that tree). A drafter may use it instead of drafting.
  ahead: DraftTree | None = None


class DraftSource(Protocol):
  """A drafter plugged into the rollout engine.

  `propose` is called once per step for the live requests; `observe` after each step with what
  was accepted (siblings' tokens feed grouped drafts, acceptance feeds adaptive budgets);
  `finish` when a request ends.

  Optional, for drafting off the critical path (`EngineConfig.draft_mode`):
  `lookahead(queries) -> list[DraftTree]` drafts as `propose` would but changes no state the
  other calls read (e.g. adaptive budgets); the engine calls it in a background thread while the
  device verifies the current step, with the step's queries and a larger budget, and passes each
  request the continuation of what was actually emitted as `DraftQuery.ahead` next step. The
  engine never calls another method while `lookahead` runs.
  """

  def propose(self, queries: Sequence[DraftQuery]) -> Sequence[DraftTree]:
    """One tree per query (a list, or a `DraftBatch`)."""
    ...

  def observe(self, request_id: int, group_id: Hashable, new_tokens: np.ndarray,
              drafted: int, accepted: int) -> None:
    ...

  def finish(self, request_id: int, group_id: Hashable) -> None:
    ...


class StatelessDrafter:
  """Base for drafters that learn nothing from what the engine emits."""

  def propose(self, queries: Sequence[DraftQuery]) -> list[DraftTree]:
    raise NotImplementedError

  def observe(self, request_id, group_id, new_tokens, drafted, accepted):
    pass

  def finish(self, request_id, group_id):
    pass


class NoDrafts(StatelessDrafter):
  """Plain decoding through the speculative step: every draft is empty."""

  def propose(self, queries):
    return [DraftTree.empty(q.budget) for q in queries]


class OracleDrafter(StatelessDrafter):
  """Drafts from known continuations (tests, benchmarks), with a controlled acceptance rate.

  `targets[request_id]` is the response the target will produce (e.g. from a plain rollout).
  Each drafted token is the true next token with probability `accuracy` and a wrong one
  otherwise, so acceptance can be dialled in; `branches > 1` adds wrong siblings at each depth
  to exercise tree verification.
  """

  def __init__(self, targets: dict[int, Sequence[int]], vocab_size: int, accuracy: float = 1.0,
               branches: int = 1, max_len: int | None = None, seed: int = 0):
    self.targets = {k: np.asarray(v, np.int32) for k, v in targets.items()}
    self.vocab_size = vocab_size
    self.accuracy = accuracy
    self.branches = branches
    self.max_len = max_len
    self.rng = np.random.default_rng(seed)

  def _wrong(self, tok: int) -> int:
    return int((tok + 1 + self.rng.integers(self.vocab_size - 1)) % self.vocab_size)

  def propose(self, queries):
    out = []
    for q in queries:
      target = self.targets.get(q.request_id)
      if target is None:
        out.append(DraftTree.empty(q.budget))
        continue
      pos = len(q.response)
      future = target[pos:pos + (self.max_len or q.budget)]
      nodes, parent = [], -1
      for tok in future:
        if len(nodes) >= q.budget:
          break
        true_tok = int(tok)
        drafted = true_tok if self.rng.random() < self.accuracy else self._wrong(true_tok)
        me = len(nodes)
        nodes.append((drafted, parent))
        for _ in range(self.branches - 1):
          if len(nodes) < q.budget:
            nodes.append((self._wrong(true_tok), parent))
        parent = me
      out.append(DraftTree.from_nodes(nodes, q.budget))
    return out


class RandomDrafter(StatelessDrafter):
  """Garbage drafts: random tokens in random tree shapes (tests that drafts never change output).

  `extra_tokens` are mixed in with probability 1/4 per node (e.g. EOS, to test drafts that
  contain end-of-sequence tokens).
  """

  def __init__(self, vocab_size: int, seed: int = 0, extra_tokens: Sequence[int] = ()):
    self.vocab_size = vocab_size
    self.rng = np.random.default_rng(seed)
    self.extra = list(extra_tokens)

  def propose(self, queries):
    out = []
    for q in queries:
      n = int(self.rng.integers(0, q.budget + 1))
      nodes = []
      for i in range(n):
        tok = int(self.rng.integers(self.vocab_size))
        if self.extra and self.rng.random() < 0.25:
          tok = int(self.rng.choice(self.extra))
        nodes.append((tok, int(self.rng.integers(-1, i))))
      out.append(DraftTree.from_nodes(nodes, q.budget))
    return out
