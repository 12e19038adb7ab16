"""KV-cache moves outside attention: compacting an accepted tree path, moving slots between
batch buckets, and copying whole rows between caches (divided rollout's park pool). All are
gathers/scatters on the stacked L×B×S×K×H cache, done in place when the cache is donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.models.attention import KVCache


def compact_accepted(cache: KVCache, length_B: jax.Array, row_P: jax.Array, index_P: jax.Array,
                     depth_P: jax.Array, move_P: jax.Array) -> KVCache:
  """Moves the accepted draft nodes' entries to follow the root.

  The verify step wrote a row's i-th packed token at `length + i`; the accepted node at depth
  d belongs at `length + d`. Only tokens with `move_P` set move (one gather and one scatter of
  P entries per layer); entries left behind lie past the new length and are never seen.
  """
  src_P = jnp.clip(length_B[row_P] + index_P, 0, cache.max_len - 1)
  dst_P = jnp.where(move_P, length_B[row_P] + depth_P, cache.max_len)

  def move(x_LxBxSxKxH):
    return x_LxBxSxKxH.at[:, row_P, dst_P].set(x_LxBxSxKxH[:, row_P, src_P], mode="drop")

  return KVCache(move(cache.k_LxBxSxKxH), move(cache.v_LxBxSxKxH))


def gather_slots(cache: KVCache, slots_B: jax.Array) -> KVCache:
  """The cache rows of `slots_B`, in that order (moving live requests to another bucket)."""
  return KVCache(cache.k_LxBxSxKxH[:, slots_B], cache.v_LxBxSxKxH[:, slots_B])


def read_slot(cache: KVCache, slot: jax.Array) -> KVCache:
  """One slot's cache as a batch of 1."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=1)
  return KVCache(take(cache.k_LxBxSxKxH), take(cache.v_LxBxSxKxH))


def write_slot(cache: KVCache, slot: jax.Array, one: KVCache) -> KVCache:
  """Writes a batch-of-1 cache back into `slot`."""
  put = lambda x, u: jax.lax.dynamic_update_slice_in_dim(x, u, slot, axis=1)
  return KVCache(put(cache.k_LxBxSxKxH, one.k_LxBxSxKxH), put(cache.v_LxBxSxKxH, one.v_LxBxSxKxH))


def copy_rows(dst: KVCache, src: KVCache, rows: jax.Array) -> KVCache:
  """`dst` with row rows[1, i] of `src` written into its row rows[0, i], for each of the
  (static) columns of the int32 `rows` (shape (2, pairs)), in order.

  One call moves every row a pass needs (divided rollout parks or resumes several requests at
  once): one dispatch and one index transfer for all of them. The number of pairs comes from a
  few sizes (powers of two) so that few shapes compile; a pass of fewer rows repeats its last
  pair, which writes the same values again. An unrolled loop, not one bounded by a device-side
  count: a GPU while loop reads its predicate back to the host every iteration, a blocking
  sync that would stall the step queue behind it.
  """
  rows = jnp.asarray(rows, jnp.int32)
  for i in range(rows.shape[1]):
    dst = write_slot(dst, rows[0, i], read_slot(src, rows[1, i]))
  return dst


def copy_rows_within(cache: KVCache, rows: jax.Array) -> KVCache:
  """`cache` with its row rows[1, i] written into row rows[0, i], for each (static) column of
  the int32 `rows` (shape (2, pairs)), in order: a prompt's KV, prefilled once, into the slots
  of the other requests with that prompt (a GRPO group's samples). Each read is of the cache
  as written so far, so the update stays in place; no source is a destination (a repeated
  pair, which pads a call to a compiled size, writes the same values again)."""
  rows = jnp.asarray(rows, jnp.int32)
  for i in range(rows.shape[1]):
    cache = write_slot(cache, rows[0, i], read_slot(cache, rows[1, i]))
  return cache


def pair_widths(most: int) -> list[int]:
  """The widths (pairs per call) compiled for calls that move up to `most` row pairs: powers of
  two up to the first that holds `most`; none for 0. Few shapes, each compiled at warm-up."""
  return [1 << k for k in range((most - 1).bit_length() + 1)] if most > 0 else []


def padded_pairs(pairs: list[tuple[int, int]], width: int | None = None) -> np.ndarray:
  """`pairs` (destination row, source row) as the (2, width) int32 index array of
  `copy_rows` / `copy_rows_within`, padded by repeating the last pair (which writes the same
  values again); `width` defaults to the smallest power of two that holds them."""
  width = width or 1 << (len(pairs) - 1).bit_length()
  return np.array(pairs + pairs[-1:] * (width - len(pairs)), np.int32).T
