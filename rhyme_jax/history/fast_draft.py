"""The drafting rule of `history.match_tree`, compiled with numba, one call per engine step.

Every searched segment lives in one persistent `history.arena.Arena`: past responses are
written once per prompt (and found through `Postings`), live responses grow in place as the
engine reports tokens (and are found through the arena's chains), so a step copies nothing.
Per step, `index_chains` adds the tokens appended since the last step to the chains of the
step's growing segments, then `draft_batch` drafts every live request in one compiled call: per
query (a row of `q_info`), its own segment (its context is that segment's tail), its growing
segments to search (a range of `q_segs`: its group's, shared by the siblings of one batch), its
budget and its postings range. Trees come back in fixed-size output arrays, `n` valid nodes per
row, best first. `tests/history/test_fast_draft.py` checks it builds the trees of
`match_tree.draft_reference` on random histories and queries.

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

from rhyme_jax.history.arena import HEAD_POS, HEAD_TOK, HEAD_UID, Arena, Postings


@_jit
def _head_slot(heads, uid, tok):
  """The slot of (uid, tok) in the chains' hash table, or the empty slot where it would go."""
  mask = heads.shape[1] - 1
  h = (uid * 1000003 + (tok + 1) * 7919) & mask
  while heads[HEAD_UID, h] != -1 and (heads[HEAD_UID, h] != uid or heads[HEAD_TOK, h] != tok):
    h = (h + 1) & mask
  return h


@_jit
def _index_chains(tokens, link, seg_start, seg_len, seg_uid, seg_indexed, segs, heads,
                  head_fill):
  """Chains every position with a next token of `segs` not indexed yet; False (with the table
  left consistent) when the hash table is half full."""
  limit = heads.shape[1] // 2
  for s in segs:
    a = seg_start[s]
    uid = seg_uid[s]
    for p in range(seg_indexed[s], seg_len[s] - 1):
      tok = tokens[a + p]
      h = _head_slot(heads, uid, tok)
      if heads[HEAD_UID, h] == -1:
        if head_fill[0] >= limit:
          return False
        heads[HEAD_UID, h] = uid
        heads[HEAD_TOK, h] = tok
        head_fill[0] += 1
        link[a + p] = -1
      else:
        link[a + p] = heads[HEAD_POS, h]
      heads[HEAD_POS, h] = p
      seg_indexed[s] = p + 1
  return True


def index_chains(arena: Arena, segs: np.ndarray) -> None:
  """Brings the chains of `segs` up to their current lengths (before `draft_batch` searches
  them); a full table is emptied, grown to hold these segments, and rebuilt for them."""
  args = (arena.seg_start, arena.seg_len, arena.seg_uid, arena.seg_indexed, segs)
  if _index_chains(arena.tokens, arena.link, *args, arena.heads, arena.head_fill):
    return
  need = int(arena.seg_len[segs].sum())
  slots = arena.heads.shape[1]
  while slots < 4 * need:
    slots *= 2
  arena.reset_chains(slots)  # stale entries (freed and finished segments) go too
  ok = _index_chains(arena.tokens, arena.link, *args, arena.heads, arena.head_fill)
  assert ok


@_jit
def _match_length(arena, a, p, cb, nc):
  """How many tokens ending at position p of the segment at `a` agree with the context's tail
  arena[cb:cb + nc] (its last token already does)."""
  m = 1
  while m < nc and p - m >= 0 and arena[a + p - m] == arena[cb + nc - 1 - m]:
    m += 1
  return m


# Columns of `draft_batch`'s per-query table: its own segment (the context is that segment's
# tail), its growing segments `q_segs[lo:hi]`, its budget, its postings range [lo, hi).
Q_OWN, Q_SEG_LO, Q_SEG_HI, Q_BUDGET, Q_POST_LO, Q_POST_HI = range(6)


IW_ROWS, FW_ROWS = 15, 7  # int64 and float64 scratch rows of `_draft_range`


class Scratch:
  """Work space of `draft_batch`, kept between steps and grown when a step needs more: one
  slice per thread, each IW_ROWS / FW_ROWS rows of `width` (a query's most candidates or
  nodes) and a hash table of 2 * width slots or more, all zero between uses (about 0.5 MB
  for GSM8K-length histories: not allocated again every step)."""

  def __init__(self, threads: int = 1, width: int = 64):
    self.iw = np.zeros((threads, IW_ROWS, width), np.int64)
    self.fw = np.zeros((threads, FW_ROWS, width), np.float64)
    slots = 16
    while slots < 2 * width:
      slots *= 2
    self.table = np.zeros((threads, slots), np.int64)

  @classmethod
  def at_least(cls, old: "Scratch", threads: int, width: int) -> "Scratch":
    return cls(max(threads, old.iw.shape[0]), max(width, 2 * old.iw.shape[2]))


@_jit
def _width(q_info, q_segs, seg_len):
  """The scratch width `draft_batch` needs: the most candidates (postings entries and growing
  positions) or nodes (budget ** 2 + 1) of any query."""
  longest = 1
  for q in range(q_info.shape[0]):
    n = q_info[q, Q_POST_HI] - q_info[q, Q_POST_LO]
    for s in q_segs[q_info[q, Q_SEG_LO]:q_info[q, Q_SEG_HI]]:
      n += seg_len[s]
    longest = max(longest, n, q_info[q, Q_BUDGET] * q_info[q, Q_BUDGET] + 1)
  return longest


@_jit
def _draft_range(q0, q1, arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                 min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob, out_n,
                 post_tok, post_seg, post_pos, link, seg_uid, heads, iw, fw, table):
  """Queries q0..q1-1 of `draft_batch` (the rule of `match_tree`, steps 1-4 below), in scratch
  space of their own (one thread's `Scratch` slice: iw / fw rows, `table` zero between uses).

  One loop over the queries rather than a function per query: a numba call passing ~30 arrays
  cost about 0.5 us, as much as drafting a query."""
  lvl_w = np.empty((2, max_match + 1), np.float64)
  lvl_first = np.empty((2, max_match + 1), np.int64)
  lvl_branch = np.empty((2, max_match + 1), np.bool_)
  scale = np.empty((2, max_match + 1), np.float64)
  acc = np.empty(max_match + 1, np.float64)
  included = np.empty(max_match + 1, np.bool_)
  c_seg, c_pos, c_m, l_pos, l_end, l_node = iw[0], iw[1], iw[2], iw[3], iw[4], iw[5]
  node_tok, node_par, new_par, new_tok, new_final = iw[6], iw[7], iw[8], iw[9], iw[10]
  move_j, used, order, new_index = iw[11], iw[12], iw[13], iw[14]
  c_w, l_w, node_prob, new_w, new_prob, top = fw[0], fw[1], fw[2], fw[4], fw[5], fw[6]
  out_w = fw[3]  # weight continuing from node i at [i + 1]
  for q in range(q0, q1):
    out_n[q] = 0
    own = q_info[q, Q_OWN]
    budget = q_info[q, Q_BUDGET]
    nc = min(seg_len[own], max_match)  # the context: the own segment's tail arena[cb:cb + nc]
    cb = seg_start[own] + seg_len[own] - nc
    if budget <= 0 or nc == 0:
      continue
    last = arena[cb + nc - 1]
    nc_all = 0
    plo, phi = q_info[q, Q_POST_LO], q_info[q, Q_POST_HI]
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
      c_seg[nc_all] = s
      c_pos[nc_all] = seg_start[s] + post_pos[e]
      c_m[nc_all] = _match_length(arena, seg_start[s], post_pos[e], cb, nc)
      nc_all += 1
      e += 1
    for g in range(q_info[q, Q_SEG_LO], q_info[q, Q_SEG_HI]):  # ... then of the growing ones
      s = q_segs[g]  # along their chains (latest first)
      a = seg_start[s]
      h = _head_slot(heads, seg_uid[s], last)
      p = heads[HEAD_POS, h] if heads[HEAD_UID, h] != -1 else -1
      first = nc_all
      while p >= 0:
        c_seg[nc_all] = s
        c_pos[nc_all] = a + p
        c_m[nc_all] = _match_length(arena, a, p, cb, nc)
        nc_all += 1
        p = link[a + p]
      i, j = first, nc_all - 1  # into position order: the order a scan finds them in
      while i < j:
        c_pos[i], c_pos[j] = c_pos[j], c_pos[i]
        c_m[i], c_m[j] = c_m[j], c_m[i]
        i += 1
        j -= 1
    # 2. levels per kind, from per-match-length sums: level l holds the candidates with m >= l
    lvl_w.fill(0.0)  # segment weight of candidates with m == l
    lvl_first.fill(-2)  # a next token of them (-2: none yet)
    lvl_branch.fill(False)  # whether their next tokens differ
    for i in range(nc_all):
      k = seg_kind[c_seg[i]]
      m = c_m[i]
      lvl_w[k, m] += seg_w[c_seg[i]]
      nxt = arena[c_pos[i] + 1]
      if lvl_first[k, m] == -2:
        lvl_first[k, m] = nxt
      elif lvl_first[k, m] != nxt:
        lvl_branch[k, m] = True
    scale.fill(0.0)  # a candidate's weight: seg_w * scale[kind, m]
    for k in range(2):
      lam = kw0 if k == 0 else kw1
      total = 0.0
      first = -2
      branches = False
      levels = 0
      acc.fill(0.0)  # lam_l / W_l of included levels
      included.fill(False)
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
    for i in range(nc_all):
      c_w[i] = seg_w[c_seg[i]] * scale[seg_kind[c_seg[i]], c_m[i]]
    # 3. depth-by-depth weighted trie over the live candidates
    n_live = 0
    for i in range(nc_all):
      if c_w[i] > 0:
        l_pos[n_live] = c_pos[i]
        l_end[n_live] = seg_start[c_seg[i]] + seg_len[c_seg[i]]
        l_w[n_live] = c_w[i]
        l_node[n_live] = -1
        n_live += 1
    max_nodes = budget * budget  # <= budget per depth
    for i in range(max_nodes + 1):
      out_w[i] = 0.0
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
        by_prob = np.argsort(-new_prob[:n_new], kind="mergesort")
        taken = 0
        for k in range(n_new):
          j = by_prob[k]
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
      # Children are never more probable than their node, so a node at most as probable as
      # the budget-th best so far has none that can make the tree: its candidates stop here.
      thr = top[budget - 1] if n_top >= budget else -1.0
      n_live = 0
      for i in range(n_move):
        f = new_final[move_j[i]]
        if f >= 0 and node_prob[f] > thr:
          l_pos[n_live] = l_pos[i]
          l_end[n_live] = l_end[i]
          l_w[n_live] = l_w[i]
          l_node[n_live] = f
          n_live += 1
    # 4. best first: (-prob, creation order) -- creation order is depth order. The `budget`
    # best: every node above the budget-th best probability (`top`), then the earliest ties.
    thr = top[budget - 1] if n_nodes > budget else -1.0
    ties = budget
    for i in range(n_nodes):
      if node_prob[i] > thr:
        ties -= 1
    n_out = 0
    for i in range(n_nodes):
      v = node_prob[i]
      if v > thr or (v == thr and ties > 0):
        if v == thr:
          ties -= 1
        k = n_out  # stable insertion by descending probability (at most `budget` nodes)
        while k > 0 and node_prob[order[k - 1]] < v:
          order[k] = order[k - 1]
          k -= 1
        order[k] = i
        n_out += 1
    for k in range(n_out):
      new_index[order[k]] = k
    for k in range(n_out):
      i = order[k]
      out_tok[q, k] = node_tok[i]
      out_par[q, k] = -1 if node_par[i] < 0 else new_index[node_par[i]]
      out_prob[q, k] = node_prob[i]
    out_n[q] = n_out


@_jit
def draft_batch(arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob, out_n,
                post_tok, post_seg, post_pos, link, seg_uid, heads, iw, fw, table):
  """Drafts every query (row of `q_info`, columns Q_*): rows of out_tok / out_par / out_prob get
  out_n[q] nodes, best first. Returns 0, or (drafting nothing) the scratch width it needs when
  `Scratch` iw / fw / table are too small.

  Query q searches the postings entries [Q_POST_LO, Q_POST_HI) (its static segments) and then
  the chains of segments q_segs[Q_SEG_LO:Q_SEG_HI] (growing ones: `index_chains` must have
  indexed them); its context is the tail of segment Q_OWN.
  """
  width = _width(q_info, q_segs, seg_len)
  if width > iw.shape[2] or 2 * width > table.shape[1]:
    return width
  _draft_range(0, q_info.shape[0], arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs,
               max_match, min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob,
               out_n, post_tok, post_seg, post_pos, link, seg_uid, heads, iw[0], fw[0],
               table[0])
  return 0


@_pjit
def draft_batch_parallel(arena, seg_start, seg_len, seg_w, seg_kind, q_info, q_segs, max_match,
                         min_prob, decay, max_levels, kw0, kw1, out_tok, out_par, out_prob,
                         out_n, post_tok, post_seg, post_pos, link, seg_uid, heads, iw, fw,
                         table, threads):
  """`draft_batch` with the queries split into `threads` contiguous chunks run by numba's
  threads (`num_threads()`), each in its own scratch slice; queries are independent: each
  writes its own output row, the arena and postings are only read."""
  width = _width(q_info, q_segs, seg_len)
  if width > iw.shape[2] or 2 * width > table.shape[1] or iw.shape[0] < threads:
    return width
  n = q_info.shape[0]
  chunks = max(min(threads, n), 1)
  for c in _prange(chunks):
    _draft_range(c * n // chunks, (c + 1) * n // chunks, arena, seg_start, seg_len, seg_w,
                 seg_kind, q_info, q_segs, max_match, min_prob, decay, max_levels, kw0, kw1,
                 out_tok, out_par, out_prob, out_n, post_tok, post_seg, post_pos, link,
                 seg_uid, heads, iw[c], fw[c], table[c])
  return 0


def draft(arena: Arena, postings: Postings, q_info: np.ndarray, q_segs: np.ndarray,
          out_tok: np.ndarray, out_par: np.ndarray, out_prob: np.ndarray, out_n: np.ndarray, *,
          max_match: int, min_prob: float, decay: float, max_levels: int,
          kind_weights: tuple[float, float], scratch: Scratch | None = None,
          threads: int = 1) -> Scratch:
  """One step's drafting: the growing segments' chains brought up to date, then `draft_batch`
  (`draft_batch_parallel` for threads > 1) over the queries of `q_info`. Returns the scratch
  space used (pass it to the next call)."""
  index_chains(arena, q_segs)
  scratch = scratch or Scratch(threads)
  args = (arena.tokens, arena.seg_start, arena.seg_len, arena.seg_weight, arena.seg_kind, q_info,
          q_segs, max_match, min_prob, decay, max_levels, kind_weights[0], kind_weights[1],
          out_tok, out_par, out_prob, out_n, postings.tok, postings.seg, postings.pos,
          arena.link, arena.seg_uid, arena.heads)
  while True:
    if threads > 1:
      need = draft_batch_parallel(*args, scratch.iw, scratch.fw, scratch.table, threads)
    else:
      need = draft_batch(*args, scratch.iw, scratch.fw, scratch.table)
    if not need:
      return scratch
    scratch = Scratch.at_least(scratch, threads, need)


def num_threads() -> int:
  """Threads `draft_batch_parallel` splits a batch across (numba's; NUMBA_NUM_THREADS)."""
  return numba.get_num_threads() if HAVE_NUMBA else 1


_WARM: set = set()  # kernels compiled (or loaded) in this process


def warmup(parallel: bool = False) -> None:
  """Compiles (or loads from numba's cache) `draft_batch`, and `draft_batch_parallel` when
  asked for, for the drafter's argument types, once per process: called when a compiled
  `HistoryDrafter` is built, so the first rollout step does not pay for it (nothing compiles
  inside a rollout)."""
  kernels = [(draft_batch, 1)] + ([(draft_batch_parallel, 2)] if parallel else [])
  kernels = [(fn, threads) for fn, threads in kernels if fn not in _WARM]
  if not kernels or not HAVE_NUMBA:
    return
  arena = Arena(capacity=16)
  own = arena.add(np.array([1, 2, 1], np.int32), 1, 1.0)
  postings = Postings()
  lo, hi = postings.range(postings.add(arena, np.array([own], np.int64)))
  out = [np.empty((1, 2), t) for t in (np.int32, np.int32, np.float32)]
  for fn, threads in kernels:
    draft(arena, postings, np.array([[own, 0, 1, 2, lo, hi]], np.int64),
          np.array([own], np.int64), *out, np.empty(1, np.int64), max_match=8, min_prob=0.02,
          decay=0.5, max_levels=4, kind_weights=(1.0, 1.0), threads=threads)
    _WARM.add(fn)
