"""KV-cache row moves (rollout/kv_cache.py) and divided rollout's pass call that makes them."""

import jax
import numpy as np

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import compiled, kv_cache


def _cache(rows, seed, positions=5, head_dim=3):
  rng = np.random.default_rng(seed)
  shape = (2, rows, positions, 2, head_dim)  # L x B x S x K x H
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


def test_a_pass_call_compiles_once_per_width_and_moves_only_its_rows():
  """divided rollout's pass call (`step.park_resume_load`): another pass of the same width,
  other rows, reuses the compilation; parks read the old rows before resumes overwrite them;
  XLA's cost analysis of a pass of K rows each way counts about K rows read and K written per
  way, not the caches (both updated in place)."""
  from rhyme_jax.rollout.step import DecodeState, pass_ints
  state, pool = DecodeState.empty(_cache(6, 2)), _cache(4, 3)
  old_cache, old_pool = np.array(state.cache.k_LxBxSxKxH), np.array(pool.k_LxBxSxKxH)
  ints, floats = np.zeros((5, 6), np.int32), np.ones((2, 6), np.float32)
  # slot 5 out to pool row 0 while pool row 3 comes back into slot 5; slot 1 out to row 1
  state, pool = compiled.park_resume_load_jit(
      state, pool, pass_ints(np.array([[0, 1], [5, 1]]), np.array([[5, 5], [3, 3]]), ints),
      floats)
  traces = compiled.TRACE_COUNTS["park_resume_load"]
  got_cache, got_pool = np.array(state.cache.k_LxBxSxKxH), np.array(pool.k_LxBxSxKxH)
  np.testing.assert_array_equal(got_pool[:, 0], old_cache[:, 5])
  np.testing.assert_array_equal(got_pool[:, 1], old_cache[:, 1])
  np.testing.assert_array_equal(got_cache[:, 5], old_pool[:, 3])
  np.testing.assert_array_equal(np.delete(got_cache, 5, axis=1), np.delete(old_cache, 5, axis=1))
  state, pool = compiled.park_resume_load_jit(
      state, pool, pass_ints(np.array([[2, 3], [0, 4]]), np.array([[0, 1], [2, 2]]), ints),
      floats)
  assert compiled.TRACE_COUNTS["park_resume_load"] == traces
  big = DecodeState.empty(_cache(64, 4, positions=64, head_dim=8))  # 16 KiB rows, 1 MiB caches
  big_pool = _cache(64, 5, positions=64, head_dim=8)
  row_bytes = 2 * np.array(big_pool.k_LxBxSxKxH)[:, 0].nbytes  # K and V
  ints, floats = np.zeros((5, 64), np.int32), np.ones((2, 64), np.float32)
  for k in (1, 4):
    rows = np.tile(np.arange(k, dtype=np.int32), (2, 1))
    cost = compiled.park_resume_load_jit.lower(big, big_pool, pass_ints(rows, rows, ints),
                                               floats).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["bytes accessed"] <= 4 * k * row_bytes * 1.01 + 16384  # + the slot vectors
