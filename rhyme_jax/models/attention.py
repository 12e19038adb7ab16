"""Attention pieces shared by prefill, one-token decode and tree verification.

A single masked-attention function serves all three: the caller writes the T new tokens' K/V
into the cache at `[cache_len, cache_len + T)` and builds a B×T×S visibility mask in which
each new token sees the committed prefix `[0, cache_len)` plus whichever new tokens its
`mask_BxTxT` allows (causal for prefill, ancestors-only for a draft tree). The Pallas kernel
for tree verification plugs in behind `attend`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rhyme_jax.models.config import ModelConfig

_MASKED = -0.7 * float(np.finfo(np.float32).max)


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values for B slots of S positions each (L×B×S×K×H)."""

  k_LxBxSxKxH: jax.Array
  v_LxBxSxKxH: jax.Array

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.jnp_dtype
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def batch(self) -> int:
    return self.k_LxBxSxKxH.shape[1]

  @property
  def max_len(self) -> int:
    return self.k_LxBxSxKxH.shape[2]


def causal_mask(t: int) -> jax.Array:
  return jnp.tril(jnp.ones((t, t), dtype=bool))


def cache_visibility(cache_len_B: jax.Array, mask_BxTxT: jax.Array, s: int) -> jax.Array:
  """B×T×S mask: the prefix `[0, cache_len)` plus new tokens at `cache_len + j` per mask_BxTxT."""
  t = mask_BxTxT.shape[-1]
  rel_BxS = jnp.arange(s)[None, :] - cache_len_B[:, None]
  in_prefix_BxS = rel_BxS < 0
  in_new_BxS = (rel_BxS >= 0) & (rel_BxS < t)
  idx_BxTxS = jnp.broadcast_to(jnp.clip(rel_BxS, 0, t - 1)[:, None, :],
                               (mask_BxTxT.shape[0], t, s))
  new_BxTxS = jnp.take_along_axis(mask_BxTxT, idx_BxTxS, axis=2)
  return in_prefix_BxS[:, None, :] | (in_new_BxS[:, None, :] & new_BxTxS)


def write_cache(cache: KVCache, layer: int, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                start_B: jax.Array) -> KVCache:
  """Writes layer `layer`'s T new entries per row at `[start_B[b], start_B[b] + T)`.

  A scatter into the stacked cache, so a donated cache is updated in place. Entries past S are
  dropped (the engine sizes S so that never happens for live slots).
  """
  b, t = k_BxTxKxH.shape[:2]
  rows_BxT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  cols_BxT = start_B[:, None] + jnp.arange(t)[None, :]
  k = cache.k_LxBxSxKxH.at[layer, rows_BxT, cols_BxT].set(
      k_BxTxKxH.astype(cache.k_LxBxSxKxH.dtype), mode="drop")
  v = cache.v_LxBxSxKxH.at[layer, rows_BxT, cols_BxT].set(
      v_BxTxKxH.astype(cache.v_LxBxSxKxH.dtype), mode="drop")
  return KVCache(k, v)


def attend(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
           mask_BxTxS: jax.Array) -> jax.Array:
  """Grouped-query attention with an arbitrary visibility mask; softmax in float32.

  Every query must see at least one key (a token always sees itself).
  """
  b, t, n, h = q_BxTxNxH.shape
  k = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, n // k, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                      preferred_element_type=jnp.float32) * (h ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH, preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies (float32, like HF), with Llama-3 scaling when configured."""
  d = config.head_dim
  inv = (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
         ).astype(np.float32)
  rs = config.rope_scaling
  if rs is None:
    return inv
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * np.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
            / (rs.high_freq_factor - rs.low_freq_factor))
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding, HF "rotate half" layout (llama.cpp's interleaved layout is undone at load)."""
  freqs_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x = x_BxTxNxH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)
