"""Packed <-> per-row query layout shared by the Pallas kernels.

The contract packs every row's new tokens on one axis P. A kernel program works on one row, so
the wrappers gather each row's (at most T) tokens into a dense tile first, with the G query heads
of a KV head side by side (GQA: one KV block serves G*T query rows), and scatter the result back.
Both moves touch only the P query tokens (kilobytes), never the KV cache.

Within a row tile, query row r = t * G + g is head g of token t; rows past T * G are padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import token_rows


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def rows_per_tile(max_q_len: int, group: int, multiple: int, pow2: bool = False) -> int:
  """Query rows R of one (row, KV head) tile: T * G rounded up for the backend's tiling."""
  rows = max_q_len * group
  return max(multiple, next_pow2(rows) if pow2 else round_up(rows, multiple))


def gather_rows(q_PxNxH, mask_PxW, q_start_B, q_len_B, *, max_q_len: int, num_kv_heads: int,
                num_rows: int):
  """Packed queries and masks -> q_BxKxRxH and mask_BxRxW (zeros past a row's tokens).

  R = num_rows >= max_q_len * G. Mask words are bitcast to int32 (kernels shift logically).
  """
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  group = num_heads // num_kv_heads
  batch = q_start_B.shape[0]
  t_T = jnp.arange(max_q_len, dtype=jnp.int32)
  live_BxT = t_T[None, :] < q_len_B.astype(jnp.int32)[:, None]
  idx_BxT = jnp.clip(q_start_B.astype(jnp.int32)[:, None] + t_T[None, :], 0, num_tokens - 1)

  q_BxTxNxH = jnp.where(live_BxT[..., None, None], q_PxNxH[idx_BxT], 0)
  q_BxKxTGxH = q_BxTxNxH.reshape(batch, max_q_len, num_kv_heads, group, head_dim).transpose(
      0, 2, 1, 3, 4).reshape(batch, num_kv_heads, max_q_len * group, head_dim)
  pad = num_rows - max_q_len * group
  q_BxKxRxH = jnp.pad(q_BxKxTGxH, ((0, 0), (0, 0), (0, pad), (0, 0)))

  mask_BxTxW = jnp.where(live_BxT[..., None], mask_PxW[idx_BxT], 0)
  mask_BxTGxW = jnp.repeat(mask_BxTxW, group, axis=1)
  mask_BxRxW = jnp.pad(mask_BxTGxW, ((0, 0), (0, pad), (0, 0)))
  return q_BxKxRxH, jax.lax.bitcast_convert_type(mask_BxRxW, jnp.int32)


def scatter_rows(out_BxKxRxH, q_start_B, q_len_B, *, num_tokens: int, max_q_len: int,
                 num_heads: int):
  """Per-row outputs -> packed out_PxNxH; tokens covered by no row get zeros."""
  batch, num_kv_heads, _, head_dim = out_BxKxRxH.shape
  group = num_heads // num_kv_heads
  out_BxTxNxH = out_BxKxRxH[:, :, :max_q_len * group].reshape(
      batch, num_kv_heads, max_q_len, group, head_dim).transpose(0, 2, 1, 3, 4).reshape(
          batch, max_q_len, num_heads, head_dim)
  row_P, t_P, covered_P = token_rows(q_start_B, q_len_B, num_tokens)
  t_P = jnp.clip(t_P, 0, max_q_len - 1)
  return jnp.where(covered_P[:, None, None], out_BxTxNxH[row_P, t_P], 0)
