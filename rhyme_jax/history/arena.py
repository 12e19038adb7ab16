"""Token storage of the drafter: the `Arena` of indexed segments and the `Postings` of static ones.

Every sequence the drafter searches (a prompt's kept past responses, the live responses of a
group) is a *segment* START + tokens in one growable int32 array, so the compiled kernels of
`history.fast_draft` read them all through one buffer and a step copies nothing: live
responses grow in place as tokens are emitted.

Two look-up structures sit beside the tokens:
- `Postings` of static segments (past responses, written once per prompt): their positions
  sorted by token, searched by bisection.
- *Chains* of growing segments (live responses): per position, the previous position of the same
  token in the same segment (`link`, relative to the segment's start, so it moves with the
  tokens), and a hash table from (segment, token) to its latest position (`heads`). The kernel
  `fast_draft.index_chains` extends them by the tokens appended since a segment was last indexed
  (`seg_indexed`), so finding a token's occurrences costs its occurrences, not a scan. Segment
  ids are reused after `free`; `seg_uid` is not, so a freed segment's table entries never match.
  This module only stores; the kernels live in `fast_draft`.
"""

from __future__ import annotations

import numpy as np

START = -1
HEAD_UID, HEAD_TOK, HEAD_POS = range(3)
_SEG_FIELDS = ("seg_start", "seg_len", "seg_cap", "seg_weight", "seg_kind", "seg_uid",
               "seg_indexed")


class Arena:
  """Growable int32 token storage holding segments [start, start + len) with spare capacity."""

  def __init__(self, capacity: int = 1 << 16, chain_slots: int = 1 << 12):
    self.tokens = np.full(capacity, START, np.int32)
    self.link = np.full(capacity, -1, np.int32)  # chains: previous position of the same token
    self.used = 0
    self.seg_start = np.zeros(64, np.int64)
    self.seg_len = np.zeros(64, np.int64)
    self.seg_cap = np.zeros(64, np.int64)
    self.seg_weight = np.ones(64, np.float64)
    self.seg_kind = np.zeros(64, np.int64)
    self.seg_uid = np.full(64, -1, np.int64)  # never reused (ids are)
    self.seg_indexed = np.zeros(64, np.int64)  # positions [0, this) are in the chains
    self.num_segs = 0
    self._free: list[int] = []
    self._next_uid = 0
    self.live_tokens = 0  # capacity held by live segments (compaction trigger)
    self.reset_chains(chain_slots)

  def reset_chains(self, slots: int) -> None:
    """Empties the chains' hash table (`slots`, a power of two): every segment is re-indexed
    when next searched. What `fast_draft.index_chains` does when the table fills up."""
    assert slots & (slots - 1) == 0, slots
    # Rows HEAD_UID, HEAD_TOK, HEAD_POS: (segment uid, token) -> its latest indexed position
    # (relative); uid -1 = an empty slot. Open addressing, linear probing, never deleted from.
    self.heads = np.full((3, slots), -1, np.int64)
    self.head_fill = np.zeros(1, np.int64)  # slots in use
    self.seg_indexed[:] = 0

  def _reserve(self, n: int) -> int:
    if self.used + n > len(self.tokens):
      if 2 * self.live_tokens + n < len(self.tokens):
        self._compact()
      if self.used + n > len(self.tokens):
        size = max(2 * len(self.tokens), self.used + n)
        grown = np.full(size, START, np.int32)
        grown[:self.used] = self.tokens[:self.used]
        link = np.full(size, -1, np.int32)
        link[:self.used] = self.link[:self.used]
        self.tokens, self.link = grown, link
    start = self.used
    self.used += n
    return start

  def _compact(self) -> None:
    """Moves live segments to the front (freed ones leave holes otherwise)."""
    live = [s for s in range(self.num_segs) if self.seg_cap[s] > 0]
    out = np.full(len(self.tokens), START, np.int32)
    link = np.full(len(self.tokens), -1, np.int32)
    pos = 0
    for s in sorted(live, key=lambda s: self.seg_start[s]):
      a, c = self.seg_start[s], self.seg_cap[s]
      out[pos:pos + c] = self.tokens[a:a + c]
      link[pos:pos + c] = self.link[a:a + c]
      self.seg_start[s] = pos
      pos += c
    self.tokens, self.link, self.used = out, link, pos

  def add(self, tokens: np.ndarray, kind: int, weight: float, capacity: int = 0) -> int:
    """A new segment START + tokens (room for `capacity` tokens in all); returns its id."""
    n = len(tokens) + 1
    cap = max(n, capacity)
    if self._free:
      seg = self._free.pop()
    else:
      seg = self.num_segs
      self.num_segs += 1
      if seg >= len(self.seg_start):
        for name in _SEG_FIELDS:
          old = getattr(self, name)
          setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
    start = self._reserve(cap)
    self.tokens[start] = START
    self.tokens[start + 1:start + n] = tokens
    self.seg_start[seg], self.seg_len[seg], self.seg_cap[seg] = start, n, cap
    self.seg_weight[seg], self.seg_kind[seg] = weight, kind
    self.seg_uid[seg], self.seg_indexed[seg] = self._next_uid, 0
    self._next_uid += 1
    self.live_tokens += cap
    return seg

  def extend(self, seg: int, tokens: np.ndarray) -> None:
    """Appends tokens to a segment (moved to the end of the arena when its room runs out)."""
    k = len(tokens)
    n = int(self.seg_len[seg])
    if n + k > self.seg_cap[seg]:
      cap = max(2 * int(self.seg_cap[seg]), n + k)
      old = int(self.seg_start[seg])
      start = self._reserve(cap)
      old = int(self.seg_start[seg])  # (a compaction may have moved it)
      self.tokens[start:start + n] = self.tokens[old:old + n]
      self.link[start:start + n] = self.link[old:old + n]
      self.live_tokens += cap - int(self.seg_cap[seg])
      self.seg_start[seg], self.seg_cap[seg] = start, cap
    a = int(self.seg_start[seg]) + n
    self.tokens[a:a + k] = tokens
    self.seg_len[seg] = n + k

  def free(self, seg: int) -> None:
    self.live_tokens -= int(self.seg_cap[seg])
    self.seg_cap[seg] = 0
    self.seg_len[seg] = 0
    self._free.append(seg)

  def segment(self, seg: int) -> np.ndarray:
    a = int(self.seg_start[seg])
    return self.tokens[a:a + int(self.seg_len[seg])]


class Postings:
  """Candidates of static segments (past responses) by binary search instead of a scan.

  For a list of segments, entries (token, segment, position) of every position with a next
  token, sorted by token and, within a token, in segment-list order then position: the order a
  scan of those segments finds them. Positions are relative to the segment's start (the arena
  may move segments when it compacts).
  """

  def __init__(self):
    self.tok = np.zeros(0, np.int32)
    self.seg = np.zeros(0, np.int64)
    self.pos = np.zeros(0, np.int64)
    self._ranges: dict[int, tuple[int, int]] = {}
    self._next_id = 0
    self.live = 0

  def add(self, arena: Arena, segs: np.ndarray) -> int:
    toks, seg_ids, pos = [], [], []
    for s in segs.tolist():
      body = arena.segment(s)[:-1]  # positions with a next token
      toks.append(body)
      seg_ids.append(np.full(len(body), s, np.int64))
      pos.append(np.arange(len(body), dtype=np.int64))
    tok = np.concatenate(toks).astype(np.int32) if toks else np.zeros(0, np.int32)
    seg_all = np.concatenate(seg_ids) if toks else np.zeros(0, np.int64)
    pos_all = np.concatenate(pos) if toks else np.zeros(0, np.int64)
    order = np.argsort(tok, kind="stable")
    if len(self.tok) > 2 * self.live + 4096:  # mostly freed entries: drop them first
      self._compact()
    start = len(self.tok)
    self.tok = np.concatenate([self.tok, tok[order]])
    self.seg = np.concatenate([self.seg, seg_all[order]])
    self.pos = np.concatenate([self.pos, pos_all[order]])
    pid = self._next_id
    self._next_id += 1
    self._ranges[pid] = (start, start + len(tok))
    self.live += len(tok)
    return pid

  def range(self, pid: int) -> tuple[int, int]:
    return self._ranges[pid]

  def free(self, pid: int) -> None:
    lo, hi = self._ranges.pop(pid)
    self.live -= hi - lo

  def _compact(self) -> None:
    parts, start = [], 0
    for pid, (lo, hi) in self._ranges.items():
      parts.append((lo, hi))
      self._ranges[pid] = (start, start + hi - lo)
      start += hi - lo
    pick = np.concatenate([np.arange(lo, hi) for lo, hi in parts]) if parts else np.zeros(0, int)
    self.tok, self.seg, self.pos = self.tok[pick], self.seg[pick], self.pos[pick]
