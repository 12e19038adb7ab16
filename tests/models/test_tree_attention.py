"""tree_attention (the ATTENTION CONTRACT's XLA path) against a dense per-token reference:
packed rows of different lengths, ancestor bits, GQA, padding, cache buckets, and garbage (NaN)
past each row's live length that must not leak."""

import jax
import numpy as np
import pytest

from rhyme_jax.models.attention import tree_attention


def reference(q, k, v, kv_len, q_start, q_len, mask, scale):
  p, n, h = q.shape
  g = n // k.shape[2]
  out = np.zeros_like(q)
  for b in range(len(kv_len)):
    for i in range(q_len[b]):
      t = q_start[b] + i
      cols = list(range(kv_len[b])) + [kv_len[b] + j for j in range(q_len[b])
                                       if (int(mask[t, j // 32]) >> (j % 32)) & 1]
      for head in range(n):
        kk, vv = k[b, cols, head // g], v[b, cols, head // g]
        s = kk @ q[t, head] * scale
        w = np.exp(s - s.max())
        out[t, head] = (w / w.sum()) @ vv
  return out


@pytest.mark.parametrize("words,max_q_len", [(1, 8), (1, None), (2, 40)])
def test_tree_attention_matches_dense_reference(words, max_q_len):
  rng = np.random.default_rng(words)
  b, s, kh, g, h = 5, 96, 2, 3, 8
  q_len = np.asarray([3, 0, 1, min(8, max_q_len or 8) if words == 1 else 37, 2], np.int32)
  kv_len = np.asarray([10, 4, 0, 20, 33], np.int32)
  q_start = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
  p = int(q_len.sum()) + 3  # padding tokens at the end
  q = rng.normal(size=(p, kh * g, h)).astype(np.float32)
  k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
  v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
  for r in range(b):  # garbage past each row's live length
    k[r, kv_len[r] + q_len[r]:] = np.nan
    v[r, kv_len[r] + q_len[r]:] = np.nan
  mask = np.zeros((p, words), np.uint32)
  for r in range(b):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, q_len[r])]
    bits = []
    for i in range(q_len[r]):
      anc = {i} | (bits[parents[i]] if i else set())
      bits.append(anc)
      for j in anc:
        mask[q_start[r] + i, j // 32] |= np.uint32(1 << (j % 32))
  max_kv = int((kv_len + q_len).max())
  fn = jax.jit(lambda *a: tree_attention(*a, max_kv_len=max_kv, max_q_len=max_q_len))
  got = np.asarray(fn(q, k, v, kv_len, q_start, q_len, mask))
  want = reference(q, np.nan_to_num(k), np.nan_to_num(v), kv_len, q_start, q_len, mask, h ** -0.5)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert not got[int(q_len.sum()):].any()  # padding outputs are 0
