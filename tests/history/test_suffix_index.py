"""Suffix automaton: counts equal brute force, interleaved extension equals whole indexing,
matches never cross sequences, and building is linear in the text length."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rhyme_jax.history.suffix_index import SuffixIndex


def brute_children(seqs, s):
  """Occurrences of s followed by each token, over all sequences (overlaps counted)."""
  out = collections.Counter()
  k = len(s)
  for q in seqs:
    for i in range(len(q) - k):
      if list(q[i:i + k]) == list(s):
        out[q[i + k]] += 1
  return dict(out)


def occurs(seqs, s):
  k = len(s)
  return any(list(q[i:i + k]) == list(s) for q in seqs for i in range(len(q) - k + 1))


def substrings(seqs, max_len):
  subs = {()}
  for q in seqs:
    for i in range(len(q)):
      for k in range(1, max_len + 1):
        if i + k <= len(q):
          subs.add(tuple(q[i:i + k]))
  return subs


# A schedule of (sequence, chunk) appends over a small alphabet (repetitive text stresses
# clones and suffix links).
schedules = st.tuples(
    st.integers(1, 4),  # number of sequences
    st.integers(1, 4),  # vocab
    st.sampled_from([1, 2, 3, 5, 40]),  # max_depth
    st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
             max_size=30))


def run_schedule(schedule):
  nseq, vocab, depth, steps = schedule
  seqs = [[] for _ in range(nseq)]
  index = SuffixIndex(depth)
  ids = [index.add_sequence() for _ in range(nseq)]
  for j, chunk in steps:
    chunk = [t % vocab for t in chunk]
    index.extend(ids[j % nseq], chunk)
    seqs[j % nseq] += chunk
  return index, seqs, depth


@settings(max_examples=150, deadline=None)
@given(schedules)
def test_counts_equal_brute_force(schedule):
  index, seqs, depth = run_schedule(schedule)
  for s in substrings(seqs, depth - 1):
    node = index.match(s, len(s), 0)
    assert node is not None and node.length == len(s)
    assert index.children(node) == brute_children(seqs, s)
    if s:  # (the empty string is counted once per indexed token)
      assert index.count(node) == sum(
          1 for q in seqs for i in range(len(q) - len(s) + 1) if tuple(q[i:i + len(s)]) == s)
  assert index.num_tokens == sum(map(len, seqs))
  assert index.num_states <= 2 * max(1, index.num_tokens) + 1


@settings(max_examples=60, deadline=None)
@given(schedules, st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_memoised_continuations_follow_extensions(schedule, more):
  """`continuations` (memoised per state) equals the brute-force counts before and after the
  index grows: an extension invalidates what was asked before."""
  index, seqs, depth = run_schedule(schedule)
  def check():
    for s in substrings(seqs, depth - 1):
      cont, total = index.continuations(index.match(s, len(s), 0))
      want = {t: c for t, c in brute_children(seqs, s).items() if t >= 0 and c > 0}
      assert cont == want and total == sum(want.values())
  check()
  index.extend(0, more)
  seqs[0] = list(seqs[0]) + more
  check()


@settings(max_examples=100, deadline=None)
@given(schedules)
def test_interleaved_extension_equals_whole_sequences(schedule):
  live, seqs, depth = run_schedule(schedule)
  whole = SuffixIndex(depth)
  for q in seqs:
    whole.add_sequence(q)
  for s in substrings(seqs, depth - 1):
    a, b = live.match(s, len(s), 0), whole.match(s, len(s), 0)
    assert live.children(a) == whole.children(b)


@settings(max_examples=150, deadline=None)
@given(schedules, st.lists(st.integers(0, 4), max_size=10), st.integers(0, 3),
       st.integers(0, 6))
def test_match_is_the_longest_occurring_suffix(schedule, context, min_len, extra):
  index, seqs, depth = run_schedule(schedule)
  max_len = min(depth, min_len + extra)
  if min_len > max_len:
    return
  node = index.match(context, max_len, min_len)
  best = None
  for k in range(min(max_len, len(context)), min_len - 1, -1):
    s = context[len(context) - k:]
    if occurs(seqs, s):
      best = k
      break
  if best is None:
    assert node is None
    return
  assert node is not None and node.length == best
  if best < depth:
    assert index.children(node) == brute_children(seqs, context[len(context) - best:])
  # Shorter suffixes down the links are suffixes of the match with their own counts.
  shorter = index.shorter(node)
  while shorter is not None and shorter.length + 1 <= depth:
    s = context[len(context) - shorter.length:]
    assert index.children(shorter) == brute_children(seqs, s)
    shorter = index.shorter(shorter)


def test_matches_never_cross_sequences():
  index = SuffixIndex(8)
  index.add_sequence([1, 2, 3])
  index.add_sequence([4, 5, 6])
  node = index.match([2, 3, 4, 5], 4, 1)
  assert node.length == 2  # [4, 5], not [3, 4, 5]
  assert index.children(index.match([3], 1, 1)) == {}  # 3 ends its sequence
  assert index.children(index.match([5], 1, 1)) == {6: 1}


def test_children_stop_at_max_depth_and_bad_arguments():
  index = SuffixIndex(3)
  index.add_sequence([1, 2, 3, 4])
  node = index.match([1, 2], 2, 1)
  assert index.children(node) == {3: 1}
  deeper = index.child(node, 3)
  assert deeper.length == 3 and index.children(deeper) == {}  # counts not kept past depth 3
  assert index.child(node, 9) is None
  with pytest.raises(ValueError, match="max_depth"):
    index.match([1, 2, 3, 4], 4, 1)
  with pytest.raises(KeyError, match="unknown sequence"):
    index.extend(7, [1])
  with pytest.raises(ValueError, match="max_depth"):
    SuffixIndex(0)


def _build_work(tokens, depth):
  """Suffix-link steps to index `tokens`, appended in chunks like a live sequence."""
  index = SuffixIndex(depth)
  sid = index.add_sequence()
  for chunk in np.array_split(tokens, max(1, len(tokens) // 4)):
    index.extend(sid, chunk)
  return index.work, index.num_states


@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_build_time_is_linear(kind):
  """Build cost is counted in suffix-link steps (deterministic, unlike wall time): 4x the text
  costs ~4x the steps (quadratic would be ~16x), and both steps and states stay O(n)."""
  rng = np.random.default_rng(0)
  n, depth = 20000, 25
  if kind == "random":
    text = rng.integers(0, 50, 4 * n)
  else:  # long runs and repeats: many clones, long suffix-link chains
    text = np.tile(np.array([7] * 30 + [1, 2, 3] * 10), 4 * n // 60 + 1)[:4 * n]
  small, small_states = _build_work(text[:n], depth)
  large, large_states = _build_work(text, depth)
  assert large / small < 4.5, (small, large)
  assert large <= 2 * depth * len(text) and large_states <= 2 * len(text) + 1
