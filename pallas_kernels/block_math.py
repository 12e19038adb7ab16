"""In-kernel math shared by the TPU and GPU kernels: tree-mask bit tests and the online softmax.

Everything here runs on one KV block of one (row, KV head) program: scores_RxC are the R query
rows (T tokens x G heads, row-major) against C cache positions starting at `block_start`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity" for the running max: rows that see nothing yet keep exp(...) == 0
# instead of exp(-inf - -inf) == NaN.
NEG_BIG = -1e30


def allowed_positions(block_start, num_cols: int, kv_len, q_len, words_Rx1):
  """Bool [R, C]: may query row r attend to cache position block_start + c?

  Positions below kv_len are the row's committed prefix (always visible); position kv_len + j is
  new token j, visible iff bit j of the row's mask words is set; everything from kv_len + q_len
  on is dead. words_Rx1 is the list of the rows' W mask words (uint32 bitcast to int32), each
  [R, 1], loaded column by column by the caller (value slicing is not lowered everywhere).
  """
  num_rows = words_Rx1[0].shape[0]
  pos_RxC = block_start + jax.lax.broadcasted_iota(jnp.int32, (num_rows, num_cols), 1)
  j_RxC = pos_RxC - kv_len
  word_RxC = jnp.zeros((num_rows, num_cols), jnp.int32)
  for w, word_Rx1 in enumerate(words_Rx1):  # W is a handful of words: select by comparison
    word_RxC = jnp.where(jax.lax.shift_right_arithmetic(j_RxC, 5) == w, word_Rx1, word_RxC)
  bit_RxC = jax.lax.shift_right_logical(word_RxC, j_RxC & 31) & 1
  return (j_RxC < 0) | ((j_RxC < q_len) & (bit_RxC == 1))


def live_rows(block_start, num_cols: int, width: int, live_len):
  """Bool [C, width]: is cache position block_start + c below live_len (for zeroing V)?"""
  pos_CxX = block_start + jax.lax.broadcasted_iota(jnp.int32, (num_cols, width), 0)
  return pos_CxX < live_len


def dot_precision(dtype):
  """float32 inputs get full-precision matmuls (no bf16 passes / tf32), matching the reference."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def online_update(m_Rx1, l_Rx1, acc_RxH, scores_RxC, v_CxH):
  """One flash-attention step: fold a block of (already masked, float32) scores into the state."""
  m_new_Rx1 = jnp.maximum(m_Rx1, jnp.max(scores_RxC, axis=1, keepdims=True))
  p_RxC = jnp.exp(scores_RxC - m_new_Rx1)
  alpha_Rx1 = jnp.exp(m_Rx1 - m_new_Rx1)
  l_new_Rx1 = alpha_Rx1 * l_Rx1 + jnp.sum(p_RxC, axis=1, keepdims=True)
  pv_RxH = jax.lax.dot_general(p_RxC.astype(v_CxH.dtype), v_CxH, (((1,), (0,)), ((), ())),
                               precision=dot_precision(v_CxH.dtype),
                               preferred_element_type=jnp.float32)
  return m_new_Rx1, l_new_Rx1, alpha_Rx1 * acc_RxH + pv_RxH


def finish(l_Rx1, acc_RxH, dtype):
  """acc / l, with rows that saw nothing (padding) giving 0 rather than NaN."""
  return (acc_RxH / jnp.where(l_Rx1 == 0.0, 1.0, l_Rx1)).astype(dtype)
