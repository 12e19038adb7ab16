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
  """Each column's source row lands in its destination row; a repeated last pair (how a pass
  of fewer rows fills its size) writes the same again; other rows keep their values."""
  dst, src = _cache(6, 0), _cache(4, 1)
  rows = np.array([[4, 0, 2, 2], [1, 3, 1, 1]], np.int32)
  want_k = np.array(dst.k_LxBxSxKxH)
  want_v = np.array(dst.v_LxBxSxKxH)
  for d, s in [(4, 1), (0, 3), (2, 1)]:
    want_k[:, d] = np.array(src.k_LxBxSxKxH)[:, s]
    want_v[:, d] = np.array(src.v_LxBxSxKxH)[:, s]
  out = kv_cache.copy_rows(dst, src, rows)
  np.testing.assert_array_equal(out.k_LxBxSxKxH, want_k)
  np.testing.assert_array_equal(out.v_LxBxSxKxH, want_v)


def test_copy_rows_compiles_once_per_size_and_moves_only_its_rows():
  """Another pass of the same size, other rows, reuses the compilation; XLA's cost analysis
  of a pass of K rows counts about K rows read and K written, not the caches (in place)."""
  dst, src = _cache(6, 2), _cache(6, 3)
  out = compiled.copy_rows_jit(dst, src, np.array([[0, 1], [5, 4]], np.int32))
  traces = compiled.TRACE_COUNTS["copy_rows"]
  out = compiled.copy_rows_jit(out, src, np.array([[2, 3], [3, 0]], np.int32))
  assert compiled.TRACE_COUNTS["copy_rows"] == traces
  np.testing.assert_array_equal(np.array(out.k_LxBxSxKxH)[:, 2], np.array(src.k_LxBxSxKxH)[:, 3])
  np.testing.assert_array_equal(np.array(out.k_LxBxSxKxH)[:, 1], np.array(src.k_LxBxSxKxH)[:, 4])
  row_bytes = 2 * np.array(src.k_LxBxSxKxH)[:, 0].nbytes  # K and V
  big_dst, big_src = _cache(64, 4), _cache(64, 5)
  for k in (1, 4):
    rows = np.tile(np.arange(k, dtype=np.int32), (2, 1))
    cost = compiled.copy_rows_jit.lower(big_dst, big_src, rows).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["bytes accessed"] <= 2 * k * row_bytes * 1.01 + 1024
