"""KV-cache moves outside attention: compacting an accepted tree path, and moving slots between
batch buckets. Both are gathers/scatters on the stacked L×B×S×K×H cache, done in place when the
cache is donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rhyme_jax.models.attention import KVCache


def compact_accepted(cache: KVCache, length_B: jax.Array, path_BxT: jax.Array,
                     num_accepted_B: jax.Array) -> KVCache:
  """Moves the accepted nodes' entries to follow the root.

  The verify step wrote the root at `length` and draft node j at `length + j`; the k-th
  accepted node belongs at `length + 1 + k`. Entries past the accepted ones are left as they
  are: they lie beyond the new length and are never seen.
  """
  b, t = path_BxT.shape
  k_idx = jnp.arange(t)[None, :]
  src_BxT = length_B[:, None] + jnp.where(k_idx < num_accepted_B[:, None], path_BxT, k_idx + 1)
  dst_BxT = length_B[:, None] + 1 + k_idx
  rows_BxT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  s = cache.max_len
  src_BxT = jnp.clip(src_BxT, 0, s - 1)

  def move(x_LxBxSxKxH):
    moved = x_LxBxSxKxH[:, rows_BxT, src_BxT]
    return x_LxBxSxKxH.at[:, rows_BxT, dst_BxT].set(moved, mode="drop")

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
