"""The compiled drafting rule (`fast_draft`) builds exactly the reference's trees
(`match_tree.draft_reference`) on random histories and queries, and its trees are valid,
best-first and within budget; the arena keeps segments and their chains intact through growth,
frees and compaction."""

import numpy as np
from hypothesis import given, settings, strategies as st

from rhyme_jax.history import fast_draft
from rhyme_jax.history.arena import HEAD_POS, HEAD_UID, Arena, Postings
from rhyme_jax.history.match_tree import START, draft_reference


def draft(arena, own, segs, budget, *, max_match, min_prob, decay, max_levels, kind_weights,
          static=0, postings=None):
  """One query through fast_draft.draft: its first `static` segments through postings, the
  rest through chains (the reference scans them all, in this order)."""
  out = [np.zeros((1, max(budget, 1)), t) for t in (np.int32, np.int32, np.float32)]
  n = np.zeros(1, np.int64)
  postings = postings or Postings()
  lo, hi = postings.range(postings.add(arena, np.array(segs[:static], np.int64)))
  growing = segs[static:]
  info = np.array([[own, 0, len(growing), budget, lo, hi]], np.int64)
  fast_draft.draft(arena, postings, info, np.array(growing, np.int64), *out, n,
                   max_match=max_match, min_prob=min_prob, decay=decay, max_levels=max_levels,
                   kind_weights=kind_weights)
  return tuple(o[0, :n[0]] for o in out)


segment = st.tuples(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 1),
                    st.sampled_from([1.0, 0.5, 0.25]))


@settings(max_examples=300, deadline=None)
@given(st.lists(segment, min_size=1, max_size=6), st.lists(st.integers(0, 4), max_size=15),
       st.booleans(), st.integers(0, 20), st.integers(1, 8), st.sampled_from([0.001, 0.05, 0.3]),
       st.sampled_from([0.5, 1.0]), st.integers(1, 4), st.sampled_from([(1.0, 1.0), (1.0, 0.3)]),
       st.integers(0, 6), st.integers(0, 3))
def test_compiled_equals_reference(segs, own_tokens, own_searched, budget, max_match, min_prob,
                                   decay, max_levels, kind_weights, static, other_postings):
  arena = Arena(capacity=8, chain_slots=4)  # tiny: exercises growth and chain resets
  ids = [arena.add(np.array(t, np.int32), k, w, capacity=len(t) + 3) for t, k, w in segs]
  own = arena.add(np.array(own_tokens, np.int32), 1, 1.0)
  if own_searched:
    ids.append(own)
  kw = dict(max_match=max_match, min_prob=min_prob, decay=decay, max_levels=max_levels,
            kind_weights=kind_weights)
  postings = Postings()
  for _ in range(other_postings):  # entries of other prompts around this query's range
    postings.add(arena, np.array(ids[:1], np.int64))
  got = draft(arena, own, ids, budget, static=min(static, len(segs)), postings=postings, **kw)
  ctx = arena.segment(own)[-max_match:]
  ref = draft_reference([(arena.segment(s), int(arena.seg_kind[s]), float(arena.seg_weight[s]))
                         for s in ids], ctx, budget, **{k: v for k, v in kw.items()
                                                        if k != "max_match"})
  for g, r, name in zip(got, ref, ("tokens", "parents", "probs")):
    np.testing.assert_array_equal(g, r, err_msg=name)
  tokens, parents, probs = got
  assert len(tokens) <= budget
  assert np.all(parents < np.arange(len(parents))) and np.all(parents >= -1)
  assert np.all(np.diff(probs) <= 0) and np.all(probs >= min_prob) and np.all(probs <= 1)
  assert not np.any(tokens == START)
  # What HistoryDrafter's `clean` flag promises the engine: no two siblings share a token.
  assert len(set(zip(parents.tolist(), tokens.tolist()))) == len(tokens)


def test_exact_repeat_drafts_the_continuation_with_probability_one():
  arena = Arena()
  past = np.arange(100, 160, dtype=np.int32)
  h = arena.add(past, 0, 1.0)
  own = arena.add(past[:20], 1, 1.0)
  tokens, parents, probs = draft(arena, own, [h, own], 16, max_match=8, min_prob=0.02,
                                 decay=0.5, max_levels=4, kind_weights=(1.0, 1.0))
  np.testing.assert_array_equal(tokens, past[20:36])
  np.testing.assert_array_equal(parents, np.arange(16) - 1)
  np.testing.assert_array_equal(probs, np.ones(16, np.float32))


def _chain(arena, seg, tok):
  """Positions of `tok` (with a next token) in segment `seg` along its chain, in order."""
  heads, a, out = arena.heads, int(arena.seg_start[seg]), []
  h = int(fast_draft._head_slot(heads, int(arena.seg_uid[seg]), tok))
  p = int(heads[HEAD_POS, h]) if heads[HEAD_UID, h] != -1 else -1
  while p >= 0:
    out.append(p)
    p = int(arena.link[a + p])
  return out[::-1]


def test_arena_segments_survive_growth_free_and_compaction():
  rng = np.random.default_rng(0)
  arena = Arena(capacity=16, chain_slots=8)
  want = {}
  for step in range(300):
    r = rng.random()
    if r < 0.3 or not want:
      toks = rng.integers(0, 50, int(rng.integers(0, 10))).astype(np.int32)
      seg = arena.add(toks, 1, 1.0, capacity=int(rng.integers(0, 12)))
      want[seg] = [START] + toks.tolist()
    elif r < 0.8:
      seg = int(rng.choice(list(want)))
      toks = rng.integers(0, 50, int(rng.integers(1, 7))).astype(np.int32)
      arena.extend(seg, toks)
      want[seg] += toks.tolist()
    else:
      seg = int(rng.choice(list(want)))
      arena.free(seg)
      del want[seg]
    for seg, toks in want.items():
      assert arena.segment(seg).tolist() == toks
    if step % 10 == 0 and want:  # chains indexed now and then, between extensions and moves
      segs = np.array(sorted(want), np.int64)
      fast_draft.index_chains(arena, segs)
      for seg, toks in want.items():
        for tok in set(toks):
          assert _chain(arena, seg, tok) == [p for p, t in enumerate(toks[:-1]) if t == tok]
  assert arena.live_tokens == sum(int(arena.seg_cap[s]) for s in want)


def test_postings_survive_frees_and_compaction():
  rng = np.random.default_rng(1)
  arena, postings = Arena(), Postings()
  kept = {}
  for step in range(200):
    segs = np.array([arena.add(rng.integers(0, 9, 30).astype(np.int32), 0, 1.0)
                     for _ in range(4)], np.int64)
    kept[postings.add(arena, segs)] = segs
    if len(kept) > 3:
      pid = next(iter(kept))
      postings.free(pid)
      del kept[pid]
  assert len(postings.tok) < 200 * 4 * 30  # freed entries were dropped
  for pid, segs in kept.items():
    lo, hi = postings.range(pid)
    got = sorted(zip(postings.tok[lo:hi].tolist(), postings.seg[lo:hi].tolist(),
                     postings.pos[lo:hi].tolist()))
    want = sorted((int(t), int(s), p) for s in segs.tolist()
                  for p, t in enumerate(arena.segment(s)[:-1]))
    assert got == want
    assert np.all(np.diff(postings.tok[lo:hi]) >= 0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=2, max_size=8),
       st.integers(1, 40), st.integers(0, 10), st.integers(0, 2**31 - 1))
def test_parallel_batch_equals_serial(segs, num_queries, budget, seed):
  """The threaded kernel splits the queries across threads; every tree is the serial one."""
  rng = np.random.default_rng(seed)
  arena = Arena(capacity=8)
  ids = [arena.add(np.array(t, np.int32), int(rng.integers(2)), 1.0) for t in segs]
  postings = Postings()
  lo, hi = postings.range(postings.add(arena, np.array(ids[:1], np.int64)))
  q_segs = np.array(ids[1:], np.int64)
  info = np.array([[ids[int(rng.integers(len(ids)))], 0, int(rng.integers(len(q_segs) + 1)),
                    int(rng.integers(budget + 1)), lo, hi] for _ in range(num_queries)], np.int64)
  outs = []
  for threads in (1, max(fast_draft.num_threads(), 2)):
    out = [np.full((num_queries, max(budget, 1)), -7, t) for t in (np.int32, np.int32, np.float32)]
    n = np.full(num_queries, -7, np.int64)
    fast_draft.draft(arena, postings, info, q_segs, *out, n, max_match=8, min_prob=0.02,
                     decay=0.5, max_levels=4, kind_weights=(1.0, 1.0), threads=threads)
    outs.append((n, [o[q, :k] for o in out for q, k in enumerate(n)]))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  for a, b in zip(outs[0][1], outs[1][1]):
    np.testing.assert_array_equal(a, b)
