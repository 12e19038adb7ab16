"""A count-annotated generalised suffix automaton over token sequences.

What it is for: HistoSpec and grouped (Seer) drafts look up the last few generated tokens in past
or sibling responses and read off how often each next token followed them. This index answers
both questions:

* `match(context, max_len, min_len)`: the longest suffix of `context` that occurs in the indexed
  sequences, as a `Node` handle;
* `children(node)`: `{token: count}`, how many occurrences of that suffix continue with each token.

Why a suffix automaton: it has at most 2n states for n indexed tokens (a suffix trie of depth D
holds up to n·D nodes), it is built online in amortised O(n), and it is *generalised*: every
sequence has its own end state, so sequences can be appended to in any interleaving (siblings of a
group grow together, `extend(seq_id, tokens)` appends to one of them) and no match ever crosses
from one sequence into another. No separators are needed.

Counts. The continuation count of a string s with next token c is the number of end positions
of s·c, i.e. the occurrence count of the state reached from s by c. Maintaining occurrence
counts exactly online would mean bumping every state on the suffix-link chain of each new
position, which is O(n) per token on repetitive text. Drafting only ever asks about strings of
length <= `max_depth` (match length + draft depth), so each sequence keeps a pointer to the
state of its own suffix of length min(max_depth, len) and bumps only the states on the chain from
there: at most `max_depth` states, usually a handful. Build cost is therefore O(n) amortised
with a constant bounded by `max_depth`, memory O(n). Counts of states whose shortest string is
longer than `max_depth` are not maintained; `children` refuses (returns {}) at that depth.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import numpy as np

_ROOT = 0


class Node(NamedTuple):
  """A matched string: the automaton `state` holding it and its `length` in tokens."""

  state: int
  length: int


class _Seq:
  """Per-sequence online state: its end state, count pointer (state, length) and length."""

  __slots__ = ("last", "ptr_state", "ptr_len", "length")

  def __init__(self):
    self.last = _ROOT
    self.ptr_state = _ROOT
    self.ptr_len = 0
    self.length = 0


class SuffixIndex:
  """Generalised suffix automaton with continuation counts for strings up to `max_depth` long."""

  def __init__(self, max_depth: int = 32):
    if max_depth < 1:
      raise ValueError(f"SuffixIndex: max_depth must be >= 1, got {max_depth}")
    self.max_depth = int(max_depth)
    self._next: list[dict[int, int]] = [{}]
    self._link: list[int] = [-1]
    self._len: list[int] = [0]
    self._cnt: list[int] = [0]  # occurrence count (end positions), maintained for short states
    self._seqs: dict[int, _Seq] = {}
    self._next_seq_id = 0
    self.num_tokens = 0
    self.work = 0  # suffix-link steps taken while building: the build cost, counted exactly
    # continuations() answers per state, valid until the next insertion (history indexes are built
    # once and then only read, so drafting asks each of their states once).
    self._continuations_memo: dict[int, tuple[dict[int, int], int]] = {}

  # --- building ---------------------------------------------------------------------------

  def add_sequence(self, tokens: Iterable[int] = ()) -> int:
    """Starts a new sequence (optionally with tokens) and returns its id for `extend`."""
    seq_id = self._next_seq_id
    self._next_seq_id += 1
    self._seqs[seq_id] = _Seq()
    self.extend(seq_id, tokens)
    return seq_id

  def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
    """Appends tokens to a live sequence; counts afterwards equal indexing it whole at once."""
    seq = self._seqs.get(seq_id)
    if seq is None:
      raise KeyError(f"SuffixIndex.extend: unknown sequence id {seq_id}")
    toks = np.asarray(tokens, np.int64).reshape(-1).tolist()
    if toks and self._continuations_memo:
      self._continuations_memo.clear()
    for tok in toks:
      self._append(seq, tok)

  def _new_state(self, length: int, nxt: dict[int, int], link: int, cnt: int) -> int:
    self._next.append(nxt)
    self._link.append(link)
    self._len.append(length)
    self._cnt.append(cnt)
    return len(self._len) - 1

  def _clone(self, q: int, length: int) -> int:
    """Splits state q: a clone of length `length` takes q's shorter strings (and its links)."""
    clone = self._new_state(length, dict(self._next[q]), self._link[q], self._cnt[q])
    self._link[q] = clone
    return clone

  def _sam_extend(self, last: int, c: int) -> int:
    """Online generalised-SAM step; returns the state whose longest string is last's + c."""
    nxt, link, ln = self._next, self._link, self._len
    q = nxt[last].get(c)
    if q is not None:  # the extended string already occurs (another sequence wrote it)
      if ln[q] == ln[last] + 1:
        return q
      clone = self._clone(q, ln[last] + 1)
      p = last
      while p != -1 and nxt[p].get(c) == q:
        nxt[p][c] = clone
        p = link[p]
        self.work += 1
      return clone
    cur = self._new_state(ln[last] + 1, {}, _ROOT, 0)
    p = last
    while p != -1 and c not in nxt[p]:
      nxt[p][c] = cur
      p = link[p]
      self.work += 1
    if p != -1:
      q = nxt[p][c]
      if ln[p] + 1 == ln[q]:
        link[cur] = q
      else:
        clone = self._clone(q, ln[p] + 1)
        while p != -1 and nxt[p].get(c) == q:
          nxt[p][c] = clone
          p = link[p]
          self.work += 1
        link[cur] = clone
    return cur

  def _append(self, seq: _Seq, c: int) -> None:
    seq.last = self._sam_extend(seq.last, c)
    seq.length += 1
    self.num_tokens += 1
    nxt, link, ln, cnt = self._next, self._link, self._len, self._cnt
    # The pointer's state may have been split by other insertions since: the suffix of length
    # ptr_len now lives in one of its suffix-link ancestors.
    p, l = seq.ptr_state, seq.ptr_len
    while p != _ROOT and ln[link[p]] >= l:
      p = link[p]
      self.work += 1
    q, l = nxt[p][c], l + 1
    if l > self.max_depth:  # keep the suffix of length max_depth: q or its link (len == depth)
      l = self.max_depth
      if ln[link[q]] >= l:
        q = link[q]
    seq.ptr_state, seq.ptr_len = q, l
    cnt[_ROOT] += 1
    while q != _ROOT:  # this position ends every suffix of length <= l: one more occurrence each
      cnt[q] += 1
      q = link[q]
      self.work += 1

  # --- queries ----------------------------------------------------------------------------

  @property
  def num_states(self) -> int:
    return len(self._len)

  @property
  def num_sequences(self) -> int:
    return len(self._seqs)

  def sequence_length(self, seq_id: int) -> int:
    return self._seqs[seq_id].length

  def match(self, context: Sequence[int], max_len: int, min_len: int = 1) -> Node | None:
    """Longest suffix of `context` with length in [min_len, max_len] occurring in the index."""
    if not 0 <= min_len <= max_len <= self.max_depth:
      raise ValueError(f"SuffixIndex.match: need 0 <= min_len ({min_len}) <= max_len ({max_len})"
                       f" <= max_depth ({self.max_depth})")
    ctx = np.asarray(context, np.int64).reshape(-1)[-max_len:].tolist() if max_len else []
    nxt, link, ln = self._next, self._link, self._len
    v, l = _ROOT, 0
    for tok in ctx:
      while v != _ROOT and tok not in nxt[v]:
        v = link[v]
        l = ln[v]
      w = nxt[v].get(tok)
      if w is None:
        v, l = _ROOT, 0
      else:
        v, l = w, l + 1
    return Node(v, l) if l >= min_len else None

  def shorter(self, node: Node) -> Node | None:
    """The longest suffix of `node`'s string whose continuations differ (its suffix link)."""
    if node.state == _ROOT:
      return None
    p = self._link[node.state]
    return Node(p, self._len[p])

  def count(self, node: Node) -> int:
    """How often the node's string occurs (end positions, sequence ends included; the empty
    string counts every indexed token)."""
    if node.length > self.max_depth:
      raise ValueError(f"SuffixIndex.count: length {node.length} > max_depth {self.max_depth}")
    return self._cnt[node.state]

  def children(self, node: Node) -> dict[int, int]:
    """{next token: number of occurrences of the node's string followed by it}."""
    if node.length + 1 > self.max_depth:
      return {}
    cnt = self._cnt
    return {tok: cnt[s] for tok, s in self._next[node.state].items()}

  def continuations(self, node: Node) -> tuple[dict[int, int], int]:
    """({token: count} for tokens >= 0 with count > 0, their total): `children` without
    sentinels, memoised per state until the next insertion. The dict must not be modified."""
    if node.length + 1 > self.max_depth:
      return {}, 0
    out = self._continuations_memo.get(node.state)
    if out is None:
      cnt = self._cnt
      cont = {t: cnt[s] for t, s in self._next[node.state].items() if t >= 0 and cnt[s] > 0}
      out = (cont, sum(cont.values()))
      self._continuations_memo[node.state] = out
    return out

  def child(self, node: Node, token: int) -> Node | None:
    """The node for the string followed by `token`, or None if that never occurs."""
    s = self._next[node.state].get(int(token))
    return None if s is None else Node(s, node.length + 1)
