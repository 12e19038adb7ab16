"""The drafting rule of `history.match_tree`, compiled with numba, one call per engine step.

Every indexed segment lives in one persistent int32 *arena* (`Arena`): past responses are
written once per prompt, live responses grow in place as the engine reports tokens, so a step
copies nothing. `draft_batch` then drafts every live request of the step in one compiled call:
per query (a row of `q_info`), the query's own segment (its context is that segment's tail),
the segments to scan (a range of `q_segs`: its group's, shared by the siblings of one batch),
its budget and its postings range. Trees come back in fixed-size output arrays,
`n` valid nodes per row, best first. `tests/history/test_fast_draft.py` checks it builds the
trees of `match_tree.draft_reference` on random histories and queries.

Without numba installed the same functions run as plain Python (correct, ~1000x slower).
"""

from __future__ import annotations

import numpy as np

try:
  import numba
  _jit = numba.njit(cache=True, nogil=True)
  _pjit = numba.njit(cache=True, nogil=True, parallel=True)
  _prange = numba.prange
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
  _jit = _pjit = lambda f: f
  _prange = range
  HAVE_NUMBA = False

START = -1


class Arena:
  """Growable int32 token storage holding segments [start, start + len) with spare capacity."""

  def __init__(self, capacity: int = 1 << 16):
    self.tokens = np.full(capacity, START, np.int32)
    self.used = 0
    self.seg_start = np.zeros(64, np.int64)
    self.seg_len = np.zeros(64, np.int64)
    self.seg_cap = np.zeros(64, np.int64)
    self.seg_weight = np.ones(64, np.float64)
    self.seg_kind = np.zeros(64, np.int64)
    self.num_segs = 0
    self._free: list[int] = []
    self.live_tokens = 0  # capacity held by live segments (compaction trigger)

  def _reserve(self, n: int) -> int:
    if self.used + n > len(self.tokens):
      if 2 * self.live_tokens + n < len(self.tokens):
        self._compact()
      if self.used + n > len(self.tokens):
        grown = np.full(max(2 * len(self.tokens), self.used + n), START, np.int32)
        grown[:self.used] = self.tokens[:self.used]
        self.tokens = grown
    start = self.used
    self.used += n
    return start

  def _compact(self) -> None:
    """Moves live segments to the front (freed ones leave holes otherwise)."""
    live = [s for s in range(self.num_segs) if self.seg_cap[s] > 0]
    out = np.full(len(self.tokens), START, np.int32)
    pos = 0
    for s in sorted(live, key=lambda s: self.seg_start[s]):
      a, c = self.seg_start[s], self.seg_cap[s]
      out[pos:pos + c] = self.tokens[a:a + c]
      self.seg_start[s] = pos
      pos += c
    self.tokens, self.used = out, pos

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
        for name in ("seg_start", "seg_len", "seg_cap", "seg_weight", "seg_kind"):
          old = getattr(self, name)
          setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
    start = self._reserve(cap)
    self.tokens[start] = START
    self.tokens[start + 1:start + n] = tokens
    self.seg_start[seg], self.seg_len[seg], self.seg_cap[seg] = start, n, cap
    self.seg_weight[seg], self.seg_kind[seg] = weight, kind
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


@_jit
def _draft_one(arena, seg_start, seg_len, seg_w, seg_kind, segs, ctx, budget, min_prob, decay,
               max_levels, kw0, kw1, out_tok, out_par, out_prob, iw, fw, table, lvl_w, lvl_first,
               lvl_branch, scale, acc, included, post_tok, post_seg, post_pos, plo, phi):
  """One query's tree into out_*; returns its size. iw / fw / table / lvl_* / scale / acc /
  included are scratch space shared by the batch (sized by `draft_batch`)."""
  nc = len(ctx)
  if budget <= 0 or nc == 0:
    return 0
  last = ctx[nc - 1]
  c_seg, c_pos, c_m = iw[0], iw[1], iw[2]
  nc_all = 0
  lo, hi = plo, phi  # 1. candidates: of the static segments by binary search in the postings
  while lo < hi:
    mid = (lo + hi) // 2
    if post_tok[mid] < last:
      lo = mid + 1
    else:
      hi = mid
  e = lo
  while e < phi and post_tok[e] == last:
    s = post_seg[e]
    a = seg_start[s]
    p = post_pos[e]
    m = 1
    while m < nc and p - m >= 0 and arena[a + p - m] == ctx[nc - 1 - m]:
      m += 1
    c_seg[nc_all] = s
    c_pos[nc_all] = a + p
    c_m[nc_all] = m
    nc_all += 1
    e += 1
  for s in segs:  # ... then of the growing ones by a scan
    a = seg_start[s]
    n = seg_len[s]
    for p in range(n - 1):
      if arena[a + p] != last:
        continue
      m = 1
      while m < nc and p - m >= 0 and arena[a + p - m] == ctx[nc - 1 - m]:
        m += 1
      c_seg[nc_all] = s
      c_pos[nc_all] = a + p
      c_m[nc_all] = m
      nc_all += 1
  # 2. levels per kind, from per-match-length sums: level l holds the candidates with m >= l
  lvl_w[:] = 0.0  # segment weight of candidates with m == l
  lvl_first[:] = -2  # a next token of them (-2: none yet)
  lvl_branch[:] = False  # whether their next tokens differ
  for i in range(nc_all):
    k = seg_kind[c_seg[i]]
    m = c_m[i]
    lvl_w[k, m] += seg_w[c_seg[i]]
    nxt = arena[c_pos[i] + 1]
    if lvl_first[k, m] == -2:
      lvl_first[k, m] = nxt
    elif lvl_first[k, m] != nxt:
      lvl_branch[k, m] = True
  scale[:] = 0.0  # a candidate's weight: seg_w * scale[kind, m]
  for k in range(2):
    lam = kw0 if k == 0 else kw1
    total = 0.0
    first = -2
    branches = False
    levels = 0
    acc[:] = 0.0  # lam_l / W_l of included levels
    included[:] = False
    for l in range(nc, 0, -1):
      total += lvl_w[k, l]
      if lvl_first[k, l] != -2:
        if first == -2:
          first = lvl_first[k, l]
        elif lvl_first[k, l] != first:
          branches = True
        branches = branches or lvl_branch[k, l]
      if total == 0.0:
        continue  # no candidate this long: the longest match is shorter
      if levels >= max_levels:
        break
      acc[l] = lam / total
      included[l] = True
      levels += 1
      if branches:
        break
      lam *= decay
    run = 0.0
    for m in range(1, nc + 1):  # scale[m] = sum of lam_l / W_l over included l <= m
      if included[m]:
        run += acc[m]
      scale[k, m] = run
  c_w = fw[0]
  for i in range(nc_all):
    c_w[i] = seg_w[c_seg[i]] * scale[seg_kind[c_seg[i]], c_m[i]]
  # 3. depth-by-depth weighted trie over the live candidates
  l_pos, l_end, l_node = iw[3], iw[4], iw[5]
  l_w = fw[1]
  n_live = 0
  for i in range(nc_all):
    if c_w[i] > 0:
      l_pos[n_live] = c_pos[i]
      l_end[n_live] = seg_start[c_seg[i]] + seg_len[c_seg[i]]
      l_w[n_live] = c_w[i]
      l_node[n_live] = -1
      n_live += 1
  max_nodes = budget * budget  # <= budget per depth
  node_tok, node_par = iw[6, :max_nodes], iw[7, :max_nodes]
  node_prob = fw[2, :max_nodes]
  out_w = fw[3, :max_nodes + 1]  # weight continuing from node i at [i + 1]
  out_w[:] = 0.0
  new_par, new_tok, new_final, move_j, used = iw[8], iw[9], iw[10], iw[11], iw[12]
  new_w, new_prob, top = fw[4], fw[5], fw[6]
  size = 16  # (parent, token) -> 1 + index into new_*: a prefix of `table` (zero between uses)
  while size < 2 * n_live:  # small enough to stay in cache
    size *= 2
  n_top = 0
  n_nodes = 0
  depth = 0
  while n_live > 0 and depth < budget:
    depth += 1
    n_new = 0
    n_used = 0
    n_move = 0
    for i in range(n_live):
      p = l_pos[i] + 1
      if p >= l_end[i]:
        continue
      tok = arena[p]
      par = l_node[i]
      h = ((par + 1) * 1000003 + tok * 7919) & (size - 1)
      while table[h] != 0:
        j = table[h] - 1
        if new_par[j] == par and new_tok[j] == tok:
          break
        h = (h + 1) & (size - 1)
      if table[h] == 0:
        j = n_new
        new_par[j] = par
        new_tok[j] = tok
        new_w[j] = 0.0
        n_new += 1
        table[h] = j + 1
        used[n_used] = h
        n_used += 1
      else:
        j = table[h] - 1
      new_w[j] += l_w[i]
      out_w[par + 1] += l_w[i]
      l_pos[n_move] = p
      l_end[n_move] = l_end[i]
      l_w[n_move] = l_w[i]
      move_j[n_move] = j
      n_move += 1
    for k in range(n_used):
      table[used[k]] = 0
    # A node at most as probable as the budget-th best of earlier depths cannot make the tree
    # (earlier depths win ties), nor can its descendants: cut it here.
    thr = top[budget - 1] if n_top >= budget else -1.0
    n_keep = 0
    for j in range(n_new):
      par = new_par[j]
      base = 1.0 if par < 0 else node_prob[par]
      new_prob[j] = base * (new_w[j] / out_w[par + 1])  # never above its parent
      new_final[j] = -1
      if new_prob[j] < min_prob or new_prob[j] <= thr:
        new_prob[j] = -1.0  # dropped
      else:
        n_keep += 1
    if n_keep > budget:  # keep the `budget` most probable of this depth (stable)
      order = np.argsort(-new_prob[:n_new], kind="mergesort")
      taken = 0
      for k in range(n_new):
        j = order[k]
        if new_prob[j] < 0:
          continue
        if taken < budget:
          new_final[j] = -2  # marked; numbered below in creation order
          taken += 1
      for j in range(n_new):
        if new_final[j] == -2:
          new_final[j] = n_nodes
          node_tok[n_nodes] = new_tok[j]
          node_par[n_nodes] = new_par[j]
          node_prob[n_nodes] = new_prob[j]
          n_nodes += 1
    else:
      for j in range(n_new):
        if new_prob[j] >= 0:
          new_final[j] = n_nodes
          node_tok[n_nodes] = new_tok[j]
          node_par[n_nodes] = new_par[j]
          node_prob[n_nodes] = new_prob[j]
          n_nodes += 1
    for j in range(n_new):  # the best `budget` probabilities so far, descending
      if new_final[j] >= 0:
        v = new_prob[j]
        k = min(n_top, budget - 1)
        if n_top < budget or v > top[k]:
          while k > 0 and top[k - 1] < v:
            top[k] = top[k - 1]
            k -= 1
          top[k] = v
          n_top = min(n_top + 1, budget)
    n_live = 0
    for i in range(n_move):
      f = new_final[move_j[i]]
      if f >= 0:
        l_pos[n_live] = l_pos[i]
        l_end[n_live] = l_end[i]
        l_w[n_live] = l_w[i]
        l_node[n_live] = f
        n_live += 1
  # 4. best first: (-prob, creation order) -- creation order is depth order
  order = iw[13, :n_nodes]
  for i in range(n_nodes):  # stable insertion sort by descending probability (few nodes)
    k = i
    while k > 0 and node_prob[order[k - 1]] < node_prob[i]:
      order[k] = order[k - 1]
      k -= 1
    order[k] = i
  n_out = min(n_nodes, budget)
  new_index = iw[14, :n_nodes]
  for k in range(n_out):
    new_index[order[k]] = k
  for k in range(n_out):
    i = order[k]
    out_tok[k] = node_tok[i]
    out_par[k] = -1 if node_par[i] < 0 else new_index[node_par[i]]
    out_prob[k] = node_prob[i]
  return n_out


# Columns of `draft_batch`'s per-query table: its own segment (the context is that segment's
# tail), its scanned segments `q_segs[lo:hi]`, its budget, its postings range [lo, hi).
Q_OWN, Q_SEG_LO, Q_SEG_HI, Q_BUDGET, Q_POST_LO, Q_POST_HI = range(6)


@_jit
def _draft_range(q0, q1, arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                 min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob, out_n,
                 post_tok, post_seg, post_pos):
  """Queries q0..q1-1 of `draft_batch`, with scratch space of their own."""
  longest = 1  # scratch sized for the largest query of the range, allocated once
  for q in range(q0, q1):
    n = q_info[q, Q_POST_HI] - q_info[q, Q_POST_LO]
    for s in q_segs[q_info[q, Q_SEG_LO]:q_info[q, Q_SEG_HI]]:
      n += seg_len[s]
    longest = max(longest, n, q_info[q, Q_BUDGET] * q_info[q, Q_BUDGET] + 1)
  iw = np.empty((15, longest), np.int64)
  fw = np.empty((7, longest), np.float64)
  size = 16
  while size < 2 * longest:
    size *= 2
  table = np.zeros(size, np.int64)
  lvl_w = np.empty((2, max_match + 1), np.float64)
  lvl_first = np.empty((2, max_match + 1), np.int64)
  lvl_branch = np.empty((2, max_match + 1), np.bool_)
  scale = np.empty((2, max_match + 1), np.float64)
  acc = np.empty(max_match + 1, np.float64)
  included = np.empty(max_match + 1, np.bool_)
  for q in range(q0, q1):
    own = q_info[q, Q_OWN]
    a = seg_start[own]
    n = seg_len[own]
    c0 = max(n - max_match, 0)
    ctx = arena[a + c0:a + n]
    out_n[q] = _draft_one(arena, seg_start, seg_len, seg_w, seg_kind,
                          q_segs[q_info[q, Q_SEG_LO]:q_info[q, Q_SEG_HI]], ctx,
                          q_info[q, Q_BUDGET], min_prob, decay, max_levels, kw0, kw1,
                          out_tok[q], out_par[q], out_prob[q], iw, fw, table, lvl_w, lvl_first,
                          lvl_branch, scale, acc, included, post_tok, post_seg, post_pos,
                          q_info[q, Q_POST_LO], q_info[q, Q_POST_HI])


@_jit
def draft_batch(arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob, out_n,
                post_tok, post_seg, post_pos):
  """Drafts every query (row of `q_info`, columns Q_*): rows of out_tok / out_par / out_prob get
  out_n[q] nodes, best first.

  Query q searches the postings entries [Q_POST_LO, Q_POST_HI) (its static segments) and then
  scans segments q_segs[Q_SEG_LO:Q_SEG_HI] (growing ones); its context is the tail of segment
  Q_OWN.
  """
  _draft_range(0, q_info.shape[0], arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs,
               max_match, min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob,
               out_n, post_tok, post_seg, post_pos)


@_pjit
def draft_batch_parallel(arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                         min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob,
                         out_n, post_tok, post_seg, post_pos, threads):
  """`draft_batch` with the queries split into `threads` contiguous chunks run by numba's
  threads (`num_threads()`); queries are independent: each writes its own output row, the
  arena and postings are only read."""
  n = q_info.shape[0]
  chunks = max(min(threads, n), 1)
  for c in _prange(chunks):
    _draft_range(c * n // chunks, (c + 1) * n // chunks, arena, seg_start, seg_len, seg_w,
                 seg_kind, q_info, q_segs, max_match, min_prob, decay, max_levels, kw0, kw1,
                 out_tok, out_par, out_prob, out_n, post_tok, post_seg, post_pos)


def num_threads() -> int:
  """Threads `draft_batch_parallel` splits a batch across (numba's; NUMBA_NUM_THREADS)."""
  return numba.get_num_threads() if HAVE_NUMBA else 1


_WARM: set = set()  # kernels compiled (or loaded) in this process


def warmup(parallel: bool = False) -> None:
  """Compiles (or loads from numba's cache) `draft_batch`, and `draft_batch_parallel` when
  asked for, for the drafter's argument types, once per process: called when a compiled
  `HistoryDrafter` is built, so the first rollout step does not pay for it (nothing compiles
  inside a rollout)."""
  kernels = [(draft_batch, ())] + ([(draft_batch_parallel, (num_threads(),))] if parallel else [])
  kernels = [(fn, extra) for fn, extra in kernels if fn not in _WARM]
  if not kernels or not HAVE_NUMBA:
    return
  arena = Arena(capacity=16)
  own = arena.add(np.array([1, 2, 1], np.int32), 1, 1.0)
  postings = Postings()
  lo, hi = postings.range(postings.add(arena, np.array([own], np.int64)))
  out = [np.empty((1, 2), t) for t in (np.int32, np.int32, np.float32)]
  for fn, extra in kernels:
    fn(arena.tokens, arena.seg_start, arena.seg_len, arena.seg_weight, arena.seg_kind,
       np.array([[own, 0, 1, 2, lo, hi]], np.int64), np.array([own], np.int64), 8, 0.02, 0.5, 4,
       1.0, 1.0, *out, np.empty(1, np.int64), postings.tok, postings.seg, postings.pos, *extra)
    _WARM.add(fn)
