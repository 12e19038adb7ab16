"""Mosaic TPU kernel for tree-verification attention (the ATTENTION CONTRACT).

One program per row (grid over B): the row's kv_len and q_len come in by scalar prefetch
(SMEM), so the program knows how many KV blocks are live before touching HBM. The cache stays
in HBM (memory_space=ANY) viewed as [L, B, S, K*H] (a free reshape; L = 1 unless a stacked
per-layer cache comes with `layer`, read in place: no layer is sliced out, which would copy the
whole layer before the kernel runs); the kernel copies block i of the row with a manual,
double-buffered DMA (block i+1 is in flight while block i is used), and
loops over cdiv(kv_len + q_len, C) blocks only, so nothing past a row's live length is read.
The last block of a row also starts the next row's first block, so no row waits on its first
copy (the grid is therefore "arbitrary": programs run in order on one core).
Each block is fetched once for all K heads; per KV head the G query heads of all T tokens form
one [R, H] tile (R = T*G padded), so a KV block feeds one MXU matmul per head (GQA).

Blocks entirely inside the committed prefix need no mask; the blocks from kv_len // C on (those
that hold the new tokens and the dead tail) get the tree bit tests and have dead V rows zeroed, so
garbage (even NaN) past the live length cannot leak. A row with no tokens writes zeros.
Softmax state (running max, denominator, accumulator) is float32 in VMEM scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import block_math, layout

LANES = 128
DEFAULT_BLOCK_KV = 512


def sublane_multiple(dtype) -> int:
  """Rows per native tile: 8 for 32-bit, 16 for bf16 (packed sublanes)."""
  return 8 * (4 // jnp.dtype(dtype).itemsize)


def pick_block(cache_len: int, block_kv: int, multiple: int) -> int | None:
  """Largest power-of-two KV block <= block_kv that divides S and is a tiling multiple."""
  block = 1 << (max(block_kv, 1).bit_length() - 1)
  while block >= multiple:
    if cache_len % block == 0:
      return block
    block //= 2
  return None


def _kernel(kv_len_ref, q_len_ref,                  # scalar prefetch (SMEM), [B]
            q_ref, mask_ref, k_hbm, v_hbm,           # [K, R, H], [R, W], [L, B, S, K*H] x2
            o_ref,                                   # [K, R, H]
            k_buf, v_buf, sem, slot_ref, m_scr, l_scr, acc_scr,
            *, block: int, num_kv_heads: int, head_dim: int, num_words: int, sm_scale: float,
            layer: int):
  b = pl.program_id(0)
  last_row = pl.num_programs(0) - 1
  kv_len = kv_len_ref[b]
  q_len = q_len_ref[b]
  live_len = kv_len + q_len
  # lax.div/rem, not // and %: the lengths are non-negative, and floor division lowers via sign,
  # whose Mosaic rule needs a TPU to ask for its chip version.
  num_blocks = jax.lax.div(live_len + block - 1, block)
  num_clean = jax.lax.div(kv_len, block)   # blocks wholly inside the committed prefix

  def copies(row, i, slot):
    start = pl.multiple_of(i * block, block)
    return (pltpu.make_async_copy(k_hbm.at[layer, row, pl.ds(start, block)], k_buf.at[slot],
                                  sem.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[layer, row, pl.ds(start, block)], v_buf.at[slot],
                                  sem.at[1, slot]))

  @pl.when(q_len == 0)
  def _empty_row():
    o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(q_len > 0)
  def _row():
    m_scr[...] = jnp.full_like(m_scr, block_math.NEG_BIG)
    l_scr[...] = jnp.zeros_like(l_scr)
    acc_scr[...] = jnp.zeros_like(acc_scr)
    # Block 0 was prefetched by the previous row's program (into slot_ref[0]) when that row had
    # tokens; otherwise this program starts it itself.
    prefetched = (b > 0) & (q_len_ref[jnp.maximum(b - 1, 0)] > 0)

    @pl.when(jnp.logical_not(prefetched))
    def _first_copy():
      slot_ref[0] = 0
      for c in copies(b, 0, 0):
        c.start()

    first_slot = slot_ref[0]
    words_Rx1 = [mask_ref[:, w:w + 1] for w in range(num_words)]

    def step(i, carry, *, masked: bool):
      slot = jax.lax.rem(first_slot + i, 2)

      @pl.when(i + 1 < num_blocks)
      def _prefetch_next_block():
        for c in copies(b, i + 1, 1 - slot):
          c.start()

      @pl.when((i + 1 == num_blocks) & (b < last_row))
      def _prefetch_next_row():
        @pl.when(q_len_ref[jnp.minimum(b + 1, last_row)] > 0)
        def _start():
          slot_ref[0] = 1 - slot
          for c in copies(b + 1, 0, 1 - slot):
            c.start()

      for c in copies(b, i, slot):
        c.wait()
      start = i * block
      if masked:
        allowed_RxC = block_math.allowed_positions(start, block, kv_len, q_len, words_Rx1)
        live_CxH = block_math.live_rows(start, block, head_dim, live_len)
      for h in range(num_kv_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        k_CxH = k_buf[slot, :, cols]
        v_CxH = v_buf[slot, :, cols]
        s_RxC = jax.lax.dot_general(q_ref[h], k_CxH, (((1,), (1,)), ((), ())),
                                    precision=block_math.dot_precision(k_CxH.dtype),
                                    preferred_element_type=jnp.float32) * sm_scale
        if masked:
          s_RxC = jnp.where(allowed_RxC, s_RxC, -jnp.inf)
          v_CxH = jnp.where(live_CxH, v_CxH, jnp.zeros_like(v_CxH))
        m_Rx1, l_Rx1, acc_RxH = block_math.online_update(
            m_scr[h, :, 0:1], l_scr[h, :, 0:1], acc_scr[h], s_RxC, v_CxH)
        m_scr[h] = jnp.broadcast_to(m_Rx1, m_scr.shape[1:])
        l_scr[h] = jnp.broadcast_to(l_Rx1, l_scr.shape[1:])
        acc_scr[h] = acc_RxH
      return carry

    jax.lax.fori_loop(0, num_clean, functools.partial(step, masked=False), 0)
    jax.lax.fori_loop(num_clean, num_blocks, functools.partial(step, masked=True), 0)
    for h in range(num_kv_heads):
      o_ref[h] = block_math.finish(l_scr[h, :, 0:1], acc_scr[h], o_ref.dtype)


def unsupported_reason(q_PxNxH, k_BxSxKxH, *, block_kv: int) -> str | None:
  """Why this kernel cannot take these shapes/dtypes (None when it can)."""
  dtype = jnp.dtype(q_PxNxH.dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    return f"tpu kernel: q dtype {dtype} is not float32/bfloat16"
  if jnp.dtype(k_BxSxKxH.dtype) != dtype:
    return f"tpu kernel: k dtype {k_BxSxKxH.dtype} differs from q dtype {dtype}"
  if pick_block(k_BxSxKxH.shape[-3], block_kv, sublane_multiple(dtype)) is None:
    return (f"tpu kernel: cache length S={k_BxSxKxH.shape[-3]} has no power-of-two block "
            f"<= {block_kv} that is a multiple of {sublane_multiple(dtype)}")
  return None


def tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, *,
                   max_q_len: int, sm_scale: float, block_kv: int = DEFAULT_BLOCK_KV,
                   interpret=False, layer: int | None = None):
  """Contract tree attention on TPU; max_q_len (static) bounds every q_len_B[b]. With `layer`
  (static), k and v are a stacked [L, B, S, K, H] cache and layer `layer` is attended."""
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  batch, cache_len, num_kv_heads, _ = k_BxSxKxH.shape[-4:]
  num_layers = k_BxSxKxH.shape[0] if layer is not None else 1
  num_words = mask_PxW.shape[1]
  dtype = q_PxNxH.dtype
  block = pick_block(cache_len, block_kv, sublane_multiple(dtype))
  num_rows = layout.rows_per_tile(max_q_len, num_heads // num_kv_heads, sublane_multiple(dtype))

  q_BxKxRxH, mask_BxRxW = layout.gather_rows(
      q_PxNxH, mask_PxW, q_start_B, q_len_B, max_q_len=max_q_len, num_kv_heads=num_kv_heads,
      num_rows=num_rows)
  k_LxBxSxKH = k_BxSxKxH.reshape(num_layers, batch, cache_len, num_kv_heads * head_dim)
  v_LxBxSxKH = v_BxSxKxH.reshape(num_layers, batch, cache_len, num_kv_heads * head_dim)

  kernel = functools.partial(_kernel, block=block, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             num_words=num_words, sm_scale=sm_scale, layer=layer or 0)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch,),
      in_specs=[
          pl.BlockSpec((None, num_kv_heads, num_rows, head_dim), lambda b, *_: (b, 0, 0, 0)),
          pl.BlockSpec((None, num_rows, num_words), lambda b, *_: (b, 0, 0)),
          pl.BlockSpec(memory_space=pl.ANY),
          pl.BlockSpec(memory_space=pl.ANY),
      ],
      out_specs=pl.BlockSpec((None, num_kv_heads, num_rows, head_dim),
                             lambda b, *_: (b, 0, 0, 0)),
      scratch_shapes=[
          pltpu.VMEM((2, block, num_kv_heads * head_dim), k_BxSxKxH.dtype),
          pltpu.VMEM((2, block, num_kv_heads * head_dim), v_BxSxKxH.dtype),
          pltpu.SemaphoreType.DMA((2, 2)),
          pltpu.SMEM((1,), jnp.int32),
          pltpu.VMEM((num_kv_heads, num_rows, LANES), jnp.float32),
          pltpu.VMEM((num_kv_heads, num_rows, LANES), jnp.float32),
          pltpu.VMEM((num_kv_heads, num_rows, head_dim), jnp.float32),
      ])
  if interpret is True:
    interpret = pltpu.InterpretParams()
  out_BxKxRxH = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows, head_dim), dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret or False,
      name="tree_attention_tpu",
  )(kv_len_B.astype(jnp.int32), q_len_B.astype(jnp.int32), q_BxKxRxH, mask_BxRxW,
    k_LxBxSxKH, v_LxBxSxKH)
  return layout.scatter_rows(out_BxKxRxH, q_start_B, q_len_B, num_tokens=num_tokens,
                             max_q_len=max_q_len, num_heads=num_heads)
