"""Pallas GPU (Triton lowering) kernel for tree-verification attention (the ATTENTION CONTRACT).

One program per (row, KV head): grid (B, K). The program reads its row's kv_len and q_len,
then loops over cdiv(kv_len + q_len, C) blocks of C cache positions only, loading [C, H] slices
of K and V straight from the cache (pointer arithmetic, no copy of the cache), with a float32
online softmax. The G query heads of all T tokens of the row form one [R, H] tile (R = T*G
rounded up to a power of two >= 16, as tl.dot needs), so every KV block is loaded once per KV
head (GQA). Blocks wholly inside the committed prefix are unmasked; the last one or two get the
tree bit tests and have dead V rows zeroed, so NaN garbage past the live length cannot leak. A
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


def _kernel(kv_len_ref, q_len_ref, q_ref, mask_ref, k_ref, v_ref, o_ref, *, block: int,
            num_words: int, sm_scale: float):
  b = pl.program_id(0)
  h = pl.program_id(1)
  kv_len = kv_len_ref[b]
  q_len = q_len_ref[b]
  live_len = kv_len + q_len
  num_blocks = jnp.where(q_len > 0, pl.cdiv(live_len, block), 0)
  num_clean = jnp.minimum(kv_len // block, num_blocks)
  num_rows, head_dim = q_ref.shape
  q_RxH = q_ref[...]
  words_Rx1 = [mask_ref[:, w][:, None] for w in range(num_words)]

  def step(i, state, *, masked: bool):
    start = pl.multiple_of(i * block, block)
    k_CxH = k_ref[b, pl.ds(start, block), h, :]
    v_CxH = v_ref[b, pl.ds(start, block), h, :]
    s_RxC = plgpu.dot(q_RxH, k_CxH, trans_b=True).astype(jnp.float32) * sm_scale
    if masked:
      allowed_RxC = block_math.allowed_positions(start, block, kv_len, q_len, words_Rx1)
      s_RxC = jnp.where(allowed_RxC, s_RxC, -jnp.inf)
      live_CxH = block_math.live_rows(start, block, head_dim, live_len)
      v_CxH = jnp.where(live_CxH, v_CxH, jnp.zeros_like(v_CxH))
    return block_math.online_update(*state, s_RxC, v_CxH)

  state = (jnp.full((num_rows, 1), block_math.NEG_BIG, jnp.float32),
           jnp.zeros((num_rows, 1), jnp.float32),
           jnp.zeros((num_rows, head_dim), jnp.float32))
  state = jax.lax.fori_loop(0, num_clean, functools.partial(step, masked=False), state)
  state = jax.lax.fori_loop(num_clean, num_blocks, functools.partial(step, masked=True), state)
  o_ref[...] = block_math.finish(state[1], state[2], o_ref.dtype)


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
  if pick_block(k_BxSxKxH.shape[1], block_kv) is None:
    return (f"gpu kernel: cache length S={k_BxSxKxH.shape[1]} has no power-of-two block in "
            f"[{MIN_DOT}, {block_kv}] dividing it")
  return None


def tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, *,
                   max_q_len: int, sm_scale: float, block_kv: int = DEFAULT_BLOCK_KV,
                   interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
  """Contract tree attention on GPU; max_q_len (static) bounds every q_len_B[b]."""
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  batch, cache_len, num_kv_heads, _ = k_BxSxKxH.shape
  block = pick_block(cache_len, block_kv)
  num_rows = layout.rows_per_tile(max_q_len, num_heads // num_kv_heads, MIN_DOT, pow2=True)
  num_words = layout.next_pow2(mask_PxW.shape[1])
  mask_PxW = jnp.pad(mask_PxW, ((0, 0), (0, num_words - mask_PxW.shape[1])))
  q_BxKxRxH, mask_BxRxW = layout.gather_rows(
      q_PxNxH, mask_PxW, q_start_B, q_len_B, max_q_len=max_q_len, num_kv_heads=num_kv_heads,
      num_rows=num_rows)

  kernel = functools.partial(_kernel, block=block, num_words=num_words, sm_scale=sm_scale)
  whole = pl.no_block_spec
  out_BxKxRxH = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads),
      in_specs=[
          whole, whole,
          pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h: (b, h, 0, 0)),
          pl.BlockSpec((None, num_rows, num_words), lambda b, h: (b, 0, 0)),
          whole, whole,
      ],
      out_specs=pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h: (b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows, head_dim), q_PxNxH.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=bool(interpret),
      name="tree_attention_gpu",
  )(kv_len_B.astype(jnp.int32), q_len_B.astype(jnp.int32), q_BxKxRxH, mask_BxRxW,
    k_BxSxKxH, v_BxSxKxH)
  return layout.scatter_rows(out_BxKxRxH, q_start_B, q_len_B, num_tokens=num_tokens,
                             max_q_len=max_q_len, num_heads=num_heads)
