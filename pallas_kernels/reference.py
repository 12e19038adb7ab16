"""Dense plain-JAX reference of the ATTENTION CONTRACT (tree-verification attention).

Obviously correct rather than fast: every packed token is matched to its row, sees that row's
whole cache, and a boolean "allowed" matrix decides which cache positions it attends to. Tests
compare the Pallas kernels against this function; it materialises [P, S, K, H] gathers, so it is
meant for small shapes (the engine's efficient XLA path lives in rhyme_jax.models.attention).

Contract (shared with the engine and the kernels):
  tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW,
                 *, max_kv_len=None, sm_scale=None) -> out_PxNxH
  Token i of row b sits at packed index q_start_B[b] + i (i < q_len_B[b]); it attends to cache
  positions [0, kv_len_B[b]) and to position kv_len_B[b] + j iff bit j of its mask words is set.
  Packed indices covered by no row are padding and get zeros. Softmax in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_rows(q_start_B: jax.Array, q_len_B: jax.Array, num_tokens: int):
  """Row of each packed token, its index inside the row, and whether any row covers it.

  Returns (row_P int32, t_P int32, covered_P bool). Zero-length rows cover nothing, wherever
  their q_start points.
  """
  p_P = jnp.arange(num_tokens, dtype=jnp.int32)
  start_B = q_start_B.astype(jnp.int32)
  in_row_BxP = (p_P[None, :] >= start_B[:, None]) & (
      p_P[None, :] < (start_B + q_len_B.astype(jnp.int32))[:, None])
  covered_P = jnp.any(in_row_BxP, axis=0)
  row_P = jnp.argmax(in_row_BxP, axis=0).astype(jnp.int32)
  t_P = jnp.where(covered_P, p_P - start_B[row_P], 0)
  return row_P, t_P, covered_P


def mask_bit(mask_xW: jax.Array, j_x: jax.Array) -> jax.Array:
  """Bit j of a token's uint32 mask words (False for j outside [0, 32 * W))."""
  num_words = mask_xW.shape[-1]
  j_c = jnp.clip(j_x, 0, 32 * num_words - 1).astype(jnp.uint32)
  word_x = jnp.take_along_axis(mask_xW, (j_c // 32).astype(jnp.int32), axis=-1)
  bit_x = (word_x >> (j_c % 32)) & jnp.uint32(1)
  return (bit_x == 1) & (j_x >= 0) & (j_x < 32 * num_words)


def tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, *,
                   max_kv_len: int | None = None, sm_scale: float | None = None):
  """Reference tree-verification attention (see module docstring); max_kv_len is ignored."""
  del max_kv_len
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  _, cache_len, num_kv_heads, _ = k_BxSxKxH.shape
  group = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale

  row_P, t_P, covered_P = token_rows(q_start_B, q_len_B, num_tokens)
  kv_len_P = kv_len_B.astype(jnp.int32)[row_P]
  s_S = jnp.arange(cache_len, dtype=jnp.int32)
  j_PxS = s_S[None, :] - kv_len_P[:, None]          # index among the row's new tokens
  in_tree_PxS = (j_PxS >= 0) & (j_PxS < q_len_B.astype(jnp.int32)[row_P][:, None])
  tree_bit_PxS = mask_bit(jnp.broadcast_to(mask_PxW[:, None, :], (num_tokens, cache_len,
                                                                   mask_PxW.shape[-1])),
                          j_PxS[..., None])[..., 0]
  allowed_PxS = (j_PxS < 0) | (in_tree_PxS & tree_bit_PxS)

  k_PxSxKxH = k_BxSxKxH[row_P].astype(jnp.float32)
  v_PxSxKxH = v_BxSxKxH[row_P].astype(jnp.float32)
  # Dead positions may hold garbage (NaN): drop them from both operands, not just the weights.
  k_PxSxKxH = jnp.where(allowed_PxS[:, :, None, None], k_PxSxKxH, 0.0)
  v_PxSxKxH = jnp.where(allowed_PxS[:, :, None, None], v_PxSxKxH, 0.0)
  q_PxKxGxH = q_PxNxH.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)

  logits_PxKxGxS = jnp.einsum("pkgh,pskh->pkgs", q_PxKxGxH, k_PxSxKxH,
                              precision=jax.lax.Precision.HIGHEST) * scale
  logits_PxKxGxS = jnp.where(allowed_PxS[:, None, None, :], logits_PxKxGxS, -jnp.inf)
  probs_PxKxGxS = jax.nn.softmax(logits_PxKxGxS, axis=-1)
  out_PxKxGxH = jnp.einsum("pkgs,pskh->pkgh", probs_PxKxGxS, v_PxSxKxH,
                           precision=jax.lax.Precision.HIGHEST)
  out_PxNxH = out_PxKxGxH.reshape(num_tokens, num_heads, head_dim)
  out_PxNxH = jnp.where(covered_P[:, None, None], out_PxNxH, 0.0)
  return out_PxNxH.astype(q_PxNxH.dtype)
