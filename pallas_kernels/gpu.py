"""Pallas GPU (Triton lowering) kernel for tree-verification attention (the ATTENTION CONTRACT).

One program per (row, KV head, KV split): grid (B, K, J). The program reads its row's kv_len
and q_len, then loops over its share of the cdiv(kv_len + q_len, C) live blocks of C cache
positions only, loading [C, H] slices of K and V straight from the cache (pointer arithmetic,
no copy of the cache), with a float32 online softmax. The G query heads of all T tokens of the
row form one [R, H] tile (R = T*G rounded up to a power of two >= 16, as tl.dot needs), so each
KV block is loaded once per KV head (GQA). With few rows (decode at small batch) a row's live
blocks are split over J programs (flash-decoding) whose partial softmaxes are merged in a small
XLA step. Blocks wholly inside the committed prefix are unmasked; those from kv_len // C on get
the tree bit tests and have dead V rows zeroed, so NaN garbage past the live length cannot leak. A
row with no tokens runs zero blocks and writes zeros.

Triton wants power-of-two loads: H must be a power of two >= 16, C a power of two dividing S,
and the mask words are padded to a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import block_math, layout

DEFAULT_BLOCK_KV = 64
MIN_DOT = 16


def pick_block(cache_len: int, block_kv: int) -> int | None:
  """Largest power-of-two KV block in [16, block_kv] dividing S."""
  block = 1 << (max(block_kv, 1).bit_length() - 1)
  while block >= MIN_DOT:
    if cache_len % block == 0:
      return block
    block //= 2
  return None


def _kernel(kv_len_ref, q_len_ref, q_ref, mask_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *,
            block: int, num_words: int, num_splits: int, sm_scale: float, layer: int):
  b = pl.program_id(0)
  h = pl.program_id(1)
  split = pl.program_id(2)
  kv_len = kv_len_ref[b]
  q_len = q_len_ref[b]
  live_len = kv_len + q_len
  num_blocks = jnp.where(q_len > 0, pl.cdiv(live_len, block), 0)
  per_split = pl.cdiv(num_blocks, num_splits)
  lo = jnp.minimum(split * per_split, num_blocks)
  hi = jnp.minimum(lo + per_split, num_blocks)
  num_clean = kv_len // block              # blocks wholly inside the committed prefix
  num_rows, head_dim = q_ref.shape
  q_RxH = q_ref[...]
  words_Rx1 = [mask_ref[:, w][:, None] for w in range(num_words)]

  def step(i, state, *, masked: bool):
    start = pl.multiple_of(i * block, block)
    k_CxH = k_ref[layer, b, pl.ds(start, block), h, :]
    v_CxH = v_ref[layer, b, pl.ds(start, block), h, :]
    s_RxC = plgpu.dot(q_RxH, k_CxH, trans_b=True,
                      precision=block_math.dot_precision(k_CxH.dtype))
    s_RxC = s_RxC.astype(jnp.float32) * sm_scale
    if masked:
      allowed_RxC = block_math.allowed_positions(start, block, kv_len, q_len, words_Rx1)
      s_RxC = jnp.where(allowed_RxC, s_RxC, -jnp.inf)
      live_CxH = block_math.live_rows(start, block, head_dim, live_len)
      v_CxH = jnp.where(live_CxH, v_CxH, jnp.zeros_like(v_CxH))
    return block_math.online_update(*state, s_RxC, v_CxH)

  state = (jnp.full((num_rows, 1), block_math.NEG_BIG, jnp.float32),
           jnp.zeros((num_rows, 1), jnp.float32),
           jnp.zeros((num_rows, head_dim), jnp.float32))
  mid = jnp.clip(num_clean, lo, hi)
  state = jax.lax.fori_loop(lo, mid, functools.partial(step, masked=False), state)
  state = jax.lax.fori_loop(mid, hi, functools.partial(step, masked=True), state)
  m_ref[...] = state[0][:, 0]
  l_ref[...] = state[1][:, 0]
  acc_ref[...] = state[2]


def combine_splits(m_BxKxJxR, l_BxKxJxR, acc_BxKxJxRxH, dtype):
  """Merge the J partial softmaxes of each (row, KV head) into normalised outputs."""
  peak_BxKx1xR = jnp.max(m_BxKxJxR, axis=2, keepdims=True)
  weight_BxKxJxR = jnp.exp(m_BxKxJxR - peak_BxKx1xR)
  l_BxKxR = jnp.sum(weight_BxKxJxR * l_BxKxJxR, axis=2)
  acc_BxKxRxH = jnp.sum(weight_BxKxJxR[..., None] * acc_BxKxJxRxH, axis=2)
  return block_math.finish(l_BxKxR[..., None], acc_BxKxRxH, dtype)


def default_splits(batch: int, num_kv_heads: int, cache_len: int, block: int) -> int:
  """Split each row's KV range so that B*K*splits programs fill a large GPU (~132 SMs x 2),
  keeping at least 4 blocks of the cache per split."""
  programs = batch * num_kv_heads
  return max(1, min(64, -(-264 // programs), cache_len // (4 * block)))


def unsupported_reason(q_PxNxH, k_BxSxKxH, *, block_kv: int) -> str | None:
  """Why this kernel cannot take these shapes/dtypes (None when it can)."""
  dtype = jnp.dtype(q_PxNxH.dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"gpu kernel: q dtype {dtype} is not float32/bfloat16/float16"
  if jnp.dtype(k_BxSxKxH.dtype) != dtype:
    return f"gpu kernel: k dtype {k_BxSxKxH.dtype} differs from q dtype {dtype}"
  head_dim = q_PxNxH.shape[-1]
  if head_dim < MIN_DOT or head_dim & (head_dim - 1):
    return f"gpu kernel: head dim H={head_dim} is not a power of two >= {MIN_DOT}"
  if pick_block(k_BxSxKxH.shape[-3], block_kv) is None:
    return (f"gpu kernel: cache length S={k_BxSxKxH.shape[-3]} has no power-of-two block in "
            f"[{MIN_DOT}, {block_kv}] dividing it")
  return None


def tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, *,
                   max_q_len: int, sm_scale: float, block_kv: int = DEFAULT_BLOCK_KV,
                   kv_splits: int | None = None, interpret: bool = False, num_warps: int = 4,
                   num_stages: int = 2, layer: int | None = None):
  """Contract tree attention on GPU; max_q_len (static) bounds every q_len_B[b]. With `layer`
  (static), k and v are a stacked [L, B, S, K, H] cache, read in place (a sliced-out layer
  would be copied whole before the kernel runs).

  kv_splits (static, flash-decoding): programs per (row, KV head), each folding a contiguous
  share of the row's live blocks; their partial softmaxes are merged afterwards. Default: enough
  to fill the GPU when B*K is small, 1 when there are many rows.
  """
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  batch, cache_len, num_kv_heads, _ = k_BxSxKxH.shape[-4:]
  stacked = layer is not None
  k_LxBxSxKxH = k_BxSxKxH if stacked else k_BxSxKxH[None]  # free reshapes to [1, B, S, K, H]
  v_LxBxSxKxH = v_BxSxKxH if stacked else v_BxSxKxH[None]
  block = pick_block(cache_len, block_kv)
  num_splits = kv_splits or default_splits(batch, num_kv_heads, cache_len, block)
  num_rows = layout.rows_per_tile(max_q_len, num_heads // num_kv_heads, MIN_DOT, pow2=True)
  num_words = layout.next_pow2(mask_PxW.shape[1])
  mask_PxW = jnp.pad(mask_PxW, ((0, 0), (0, num_words - mask_PxW.shape[1])))
  q_BxKxRxH, mask_BxRxW = layout.gather_rows(
      q_PxNxH, mask_PxW, q_start_B, q_len_B, max_q_len=max_q_len, num_kv_heads=num_kv_heads,
      num_rows=num_rows)

  kernel = functools.partial(_kernel, block=block, num_words=num_words, num_splits=num_splits,
                             sm_scale=sm_scale, layer=layer or 0)
  whole = pl.no_block_spec
  part = (batch, num_kv_heads, num_splits, num_rows)
  m_BxKxJxR, l_BxKxJxR, acc_BxKxJxRxH = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_splits),
      in_specs=[
          whole, whole,
          pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h, j: (b, h, 0, 0)),
          pl.BlockSpec((None, num_rows, num_words), lambda b, h, j: (b, 0, 0)),
          whole, whole,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, num_rows), lambda b, h, j: (b, h, j, 0)),
          pl.BlockSpec((None, None, None, num_rows), lambda b, h, j: (b, h, j, 0)),
          pl.BlockSpec((None, None, None, num_rows, head_dim), lambda b, h, j: (b, h, j, 0, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct(part, jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32),
                 jax.ShapeDtypeStruct((*part, head_dim), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=bool(interpret),
      name="tree_attention_gpu",
  )(kv_len_B.astype(jnp.int32), q_len_B.astype(jnp.int32), q_BxKxRxH, mask_BxRxW,
    k_LxBxSxKxH, v_LxBxSxKxH)
  out_BxKxRxH = combine_splits(m_BxKxJxR, l_BxKxJxR, acc_BxKxJxRxH, q_PxNxH.dtype)
  return layout.scatter_rows(out_BxKxRxH, q_start_B, q_len_B, num_tokens=num_tokens,
                             max_q_len=max_q_len, num_heads=num_heads)
