"""Attention pieces: the packed tree attention of decoding, and the dense path of prefill.

Decoding (plain and speculative) runs `tree_attention`: every row's new tokens (its root and
its draft nodes) lie packed on one token axis P, each with its ancestor bits; the caller has
written their K/V into the cache after the row's prefix. This is the ATTENTION CONTRACT the
Pallas kernels implement too; `resolve_attention` turns the engine's choice (xla | pallas |
pallas_interpret) into the implementation its compiled step uses. Prefill and training keep the
dense `attend` with a B×T×S mask.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_math
from pallas_kernels import gpu as gpu_kernel
from pallas_kernels import tpu as tpu_kernel
from pallas_kernels import tree_attention as kernel_dispatch
from rhyme_jax.config import ATTENTIONS
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


class Packed(NamedTuple):
  """Where packed tokens go (the tree_attention arguments besides q, k, v)."""

  kv_len_B: jax.Array  # int32 committed prefix per row
  q_start_B: jax.Array  # int32 first packed index of each row (non-decreasing)
  q_len_B: jax.Array  # int32 new tokens per row (0 = the row has none)
  mask_PxW: jax.Array  # uint32 ancestor bits (bit j: sees the row's new token j)
  max_kv_len: int | None = None  # static cache-length bucket >= kv_len + q_len
  max_q_len: int | None = None  # static bound of q_len
  impl: str = "xla"  # static: one of IMPLS (resolve_attention's answer)


def unpack_rows(x_PxX: jax.Array, q_start_B: jax.Array, q_len_B: jax.Array, t: int
                ) -> tuple[jax.Array, jax.Array]:
  """Row-major view of packed tokens: (x_BxTxX, valid_BxT), row b's i-th token at [b, i]."""
  idx_BxT = q_start_B[:, None] + jnp.arange(t)[None, :]
  valid_BxT = jnp.arange(t)[None, :] < q_len_B[:, None]
  idx_BxT = jnp.where(valid_BxT, idx_BxT, 0)
  return x_PxX[idx_BxT], valid_BxT


def packed_rows(q_start_B: jax.Array, q_len_B: jax.Array, p: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """For each packed index: (row_P, index within the row_P, valid_P); padding is invalid.

  The row is a count of row starts at or before the index (searchsorted's "compare_all": P x B
  comparisons, no loop). Its default binary search is a while loop, which XLA:GPU runs from the
  host, launching the body's kernels once per iteration, in every step."""
  idx_P = jnp.arange(p, dtype=jnp.int32)
  row_P = (jnp.searchsorted(q_start_B, idx_P, side="right", method="compare_all") - 1
           ).astype(jnp.int32)
  row_P = jnp.clip(row_P, 0, q_start_B.shape[0] - 1)
  i_P = idx_P - q_start_B[row_P]
  return row_P, i_P, (i_P >= 0) & (i_P < q_len_B[row_P])


# The implementations a compiled step can use: the XLA path, or a Pallas kernel (TPU: Mosaic,
# GPU: Triton), compiled or interpreted.
IMPLS = ("xla", "tpu", "gpu", "tpu_interpret", "gpu_interpret")
_KERNELS = {"tpu": tpu_kernel, "gpu": gpu_kernel}
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    _log.warning(message)


def kernel_unsupported(kernel: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                       cache_len: int, dtype) -> str | None:
  """Why the `kernel` ("tpu" | "gpu") cannot take these decode shapes, or None if it can."""
  q = jax.ShapeDtypeStruct((1, num_heads, head_dim), dtype)
  k = jax.ShapeDtypeStruct((1, cache_len, num_kv_heads, head_dim), dtype)
  module = _KERNELS[kernel]
  return module.unsupported_reason(q, k, block_kv=module.DEFAULT_BLOCK_KV)


def _fallback_message(choice: str, why: str) -> str:
  return f"attention={choice!r} uses the XLA path: {why}"


def resolve_attention(choice: str, cfg: ModelConfig, cache_len: int,
                      platform: str | None = None) -> str:
  """The implementation (one of IMPLS) that the engine's `choice` (one of config.ATTENTIONS)
  stands for, given the model's heads, the cache length S and the backend.

  "pallas" is the backend's kernel (tpu or gpu); "pallas_interpret" that kernel interpreted
  (on CPU the TPU kernel: the Mosaic interpreter models its DMAs and takes any head dim). On CPU
  (for "pallas") or for shapes the kernel cannot take, the answer is "xla" and one warning is
  logged with the reason, e.g. "the gpu kernel cannot take head dim 64, cache length 74".
  """
  if choice not in ATTENTIONS:
    raise ValueError(f"attention={choice!r}: expected one of {', '.join(ATTENTIONS)}")
  if choice == "xla":
    return "xla"
  platform = platform or jax.default_backend()
  kernel = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform)
  if kernel is None and choice == "pallas":
    _warn_once(_fallback_message(choice, f"no Pallas kernel for the {platform!r} backend "
                                 "(attention='pallas_interpret' runs one interpreted)"))
    return "xla"
  kernel = kernel or "tpu"
  dtype = cfg.jnp_dtype
  why = kernel_unsupported(kernel, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, cache_len=cache_len, dtype=dtype)
  if why is not None:
    _warn_once(_fallback_message(
        choice, f"the {kernel} kernel cannot take head dim {cfg.head_dim}, cache length "
        f"{cache_len}, {jnp.dtype(dtype).name} ({why})"))
    return "xla"
  return kernel + ("_interpret" if choice == "pallas_interpret" else "")


def tree_attention(q_PxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                   kv_len_B: jax.Array, q_start_B: jax.Array, q_len_B: jax.Array,
                   mask_PxW: jax.Array, *, max_kv_len: int | None = None,
                   max_q_len: int | None = None, sm_scale: float | None = None,
                   impl: str = "xla", layer: int | None = None) -> jax.Array:
  """Attention of packed tree tokens over their rows' caches (the ATTENTION CONTRACT).

  Row b's tokens sit at packed indices [q_start_B[b], q_start_B[b] + q_len_B[b]); its i-th
  token's K/V are already in the cache at kv_len_B[b] + i. A token sees its row's prefix
  [0, kv_len_B[b]) and new token j iff bit j of its mask words is set. Every q_len_B[b] is at
  most 32 * W (the bits that can name its tokens) and at most a static `max_q_len` where one is
  given (the engine's tokens per row T; `accept.pack` refuses more): the tiles are that tall,
  so a row past them would get wrong outputs, not an error.

  `impl` (static, one of IMPLS) picks the XLA path below or a Pallas kernel, which reads only
  each row's live KV (max_kv_len is then unused: nothing past kv_len + q_len is read). A kernel
  that cannot take the traced shapes falls back to the XLA path with one logged warning.
  With `layer` (static), k and v are the stacked L×B×S×K×H cache and that layer is attended: the
  kernels read it in place (slicing a layer out for them would copy all of it every step).
  """
  if impl not in IMPLS:
    raise ValueError(f"tree_attention: impl={impl!r} is not one of {IMPLS}")
  if impl != "xla":
    kernel, _, interpret = impl.partition("_")
    p, n, h = q_PxNxH.shape
    why = kernel_unsupported(kernel, num_heads=n, num_kv_heads=k_BxSxKxH.shape[-2], head_dim=h,
                             cache_len=k_BxSxKxH.shape[-3], dtype=q_PxNxH.dtype)
    if why is None and jnp.dtype(k_BxSxKxH.dtype) != jnp.dtype(q_PxNxH.dtype):
      why = f"cache dtype {k_BxSxKxH.dtype} differs from query dtype {q_PxNxH.dtype}"
    if why is None:
      w = mask_PxW.shape[1]
      t = min(max_q_len or 32 * w, 32 * w, p)
      return kernel_dispatch.tree_attention(
          q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW,
          sm_scale=sm_scale, max_q_len=t, impl=kernel, interpret=bool(interpret), layer=layer)
    _warn_once(_fallback_message(impl, why))
  if layer is not None:
    k_BxSxKxH, v_BxSxKxH = k_BxSxKxH[layer], v_BxSxKxH[layer]
  return _xla_tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B,
                             mask_PxW, max_kv_len=max_kv_len, max_q_len=max_q_len,
                             sm_scale=sm_scale)


def _xla_tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW,
                        *, max_kv_len, max_q_len, sm_scale):
  """XLA path: the row's tokens are gathered into a B×T block (T = `max_q_len`, a static bound of
  q_len_B; 32·W without it) so each row's K/V slice is read once for all of its tokens; the
  cache is sliced to the static `max_kv_len` bucket. The visibility test is a bit test computed
  inside the fused score select, never a stored B×T×S mask. Scores are float32; positions past
  a row's kv_len + q_len are excluded, and V there is zeroed so garbage (even NaN) cannot leak.
  """
  p, n, h = q_PxNxH.shape
  b, s_full, k = k_BxSxKxH.shape[:3]
  w = mask_PxW.shape[1]
  t = min(max_q_len or 32 * w, 32 * w)
  s = min(max_kv_len or s_full, s_full)
  g = n // k
  scale = h ** -0.5 if sm_scale is None else sm_scale
  k_BxSxKxH, v_BxSxKxH = k_BxSxKxH[:, :s], v_BxSxKxH[:, :s]
  q_BxTxNxH, valid_BxT = unpack_rows(q_PxNxH, q_start_B, q_len_B, t)
  mask_BxTxW, _ = unpack_rows(mask_PxW, q_start_B, q_len_B, t)
  # float32 at full precision, as the kernels compute it (DEFAULT is bf16 passes on a TPU and
  # TF32 on a GPU): the paths agree to float rounding on every device, not on a CPU alone.
  precision = block_math.dot_precision(k_BxSxKxH.dtype)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxNxH.reshape(b, t, k, g, h), k_BxSxKxH,
                      precision=precision, preferred_element_type=jnp.float32) * scale
  rel_BxS = jnp.arange(s, dtype=jnp.int32)[None, :] - kv_len_B[:, None]
  new_BxTxS = jnp.zeros((b, t, s), bool)
  for word in range(w):  # bit test of the draft positions (W static and small)
    shift_BxS = rel_BxS - 32 * word
    in_word_BxS = (shift_BxS >= 0) & (shift_BxS < 32)
    bits_BxTxS = (mask_BxTxW[:, :, word, None]
                  >> jnp.clip(shift_BxS, 0, 31).astype(jnp.uint32)[:, None, :]) & 1
    new_BxTxS = new_BxTxS | (in_word_BxS[:, None, :] & (bits_BxTxS == 1))
  in_new_BxS = (rel_BxS >= 0) & (rel_BxS < q_len_B[:, None])
  seen_BxTxS = (rel_BxS < 0)[:, None, :] | (new_BxTxS & in_new_BxS[:, None, :])
  seen_BxTxS = seen_BxTxS & valid_BxT[:, :, None]
  scores = jnp.where(seen_BxTxS[:, None, None], scores, -jnp.inf)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
  live_BxS = rel_BxS < q_len_B[:, None]
  v_BxSxKxH = jnp.where(live_BxS[:, :, None, None], v_BxSxKxH, 0)
  out_BxKxGxTxH = jnp.einsum("bkgts,bskh->bkgth", probs.astype(v_BxSxKxH.dtype), v_BxSxKxH,
                             precision=precision, preferred_element_type=jnp.float32)
  out_BxTxNxH = out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b * t, n, h)
  row_P, i_P, valid_P = packed_rows(q_start_B, q_len_B, p)
  out_PxNxH = out_BxTxNxH[row_P * t + jnp.clip(i_P, 0, t - 1)]
  return jnp.where(valid_P[:, None, None], out_PxNxH, 0).astype(q_PxNxH.dtype)


def write_packed(cache: KVCache, layer: int, k_PxKxH: jax.Array, v_PxKxH: jax.Array,
                 kv_len_B: jax.Array, q_start_B: jax.Array, q_len_B: jax.Array) -> KVCache:
  """Writes layer `layer`'s K/V of packed tokens at their rows' kv_len + index (padding
  dropped): a P-entry scatter into the stacked cache, in place when the cache is donated."""
  row_P, i_P, valid_P = packed_rows(q_start_B, q_len_B, k_PxKxH.shape[0])
  col_P = jnp.where(valid_P, kv_len_B[row_P] + i_P, cache.max_len)
  k = cache.k_LxBxSxKxH.at[layer, row_P, col_P].set(
      k_PxKxH.astype(cache.k_LxBxSxKxH.dtype), mode="drop")
  v = cache.v_LxBxSxKxH.at[layer, row_P, col_P].set(
      v_PxKxH.astype(cache.v_LxBxSxKxH.dtype), mode="drop")
  return KVCache(k, v)


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
  """Rotary embedding, HF "rotate half" layout (llama.cpp's interleaved layout is undone at
  load)."""
  freqs_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x = x_BxTxNxH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)
