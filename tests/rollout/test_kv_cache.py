"""KV-cache row moves (rollout/kv_cache.py): divided rollout's batched row copies."""

import jax
import numpy as np

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled, kv_cache


def _cache(rows, seed):
  rng = np.random.default_rng(seed)
  shape = (2, rows, 5, 2, 3)  # L x B x S x K x H
  return KVCache(jax.numpy.asarray(rng.normal(size=shape), jax.numpy.float32),
                 jax.numpy.asarray(rng.normal(size=shape), jax.numpy.float32))


def test_copy_rows_moves_the_listed_rows_and_nothing_else():
  """Pairs before the first -1 are copied (source row -> destination row, any order); the
  padding after it is ignored even where it holds valid-looking rows; other rows keep their
  values."""
  dst, src = _cache(6, 0), _cache(4, 1)
  rows_2xM = np.array([[4, 0, 2, -1, 1], [1, 3, 1, -1, 0]], np.int32)
  want_k = np.array(dst.k_LxBxSxKxH)
  want_v = np.array(dst.v_LxBxSxKxH)
  for d, s in [(4, 1), (0, 3), (2, 1)]:
    want_k[:, d] = np.array(src.k_LxBxSxKxH)[:, s]
    want_v[:, d] = np.array(src.v_LxBxSxKxH)[:, s]
  out = kv_cache.copy_rows(dst, src, rows_2xM)
  np.testing.assert_array_equal(out.k_LxBxSxKxH, want_k)
  np.testing.assert_array_equal(out.v_LxBxSxKxH, want_v)


def test_copy_rows_with_no_pairs_is_the_identity_and_compiles_once_per_shape():
  """An all-padding index array copies nothing; another pass of the same shapes, with other
  rows and another count, reuses the compilation."""
  dst, src = _cache(6, 2), _cache(6, 3)
  before = np.array(dst.k_LxBxSxKxH)
  none = np.full((2, 6), -1, np.int32)
  out = compiled.copy_rows_jit(dst, src, none)
  np.testing.assert_array_equal(out.k_LxBxSxKxH, before)
  traces = compiled.TRACE_COUNTS["copy_rows"]
  some = none.copy()
  some[:, :3] = [[0, 1, 2], [5, 4, 3]]
  out = compiled.copy_rows_jit(out, src, some)
  assert compiled.TRACE_COUNTS["copy_rows"] == traces
  np.testing.assert_array_equal(np.array(out.k_LxBxSxKxH)[:, 2], np.array(src.k_LxBxSxKxH)[:, 3])
