"""Both Pallas kernels, in interpret mode on CPU, equal the dense reference.

Each case mixes what a batch really holds: an empty prefix, a prefix ending mid-block, a row
filling the cache to its last position, rows with no tokens, padding tokens between and after
rows, and NaN in every cache position past a row's live length and in padding queries (none of
it may reach an output). The cache is 64 positions in blocks of 16.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from attention_cases import make_case
from pallas_kernels import gpu, reference
from pallas_kernels import tree_attention as dispatch

CACHE, BLOCK = 64, 16
CASES = {
    # name: (make_case kwargs, max_q_len or None)
    "f32_gqa1_chain": (dict(q_lens=[3, 0, 5, 1, 4], kv_lens=[0, 7, 16, 40, 60], group=1,
                            tree="chain", gap=1, tail_pad=2), None),
    "f32_gqa3_bushy_2words": (dict(q_lens=[37, 0, 9], kv_lens=[11, 30, 55], group=3,
                                   num_words=2, tree="bushy", tail_pad=1), 40),
    "bf16_gqa8_random": (dict(q_lens=[6, 2, 0, 7], kv_lens=[33, 0, 5, 57], group=8,
                              dtype=jnp.bfloat16, gap=2), 8),
    "decode_no_draft_tokens": (dict(q_lens=[1, 1, 0, 1], kv_lens=[0, 17, 20, 63], group=3), 1),
    # three words of ancestor bits: the GPU kernel pads them to four (gpu.py)
    "f32_gqa2_bushy_3words": (dict(q_lens=[40, 0, 21], kv_lens=[3, 10, 30], group=2,
                                   num_words=3, tree="bushy"), 48),
}


def _case(name):
  kwargs, max_q_len = CASES[name]
  return make_case(7, cache_len=CACHE, num_kv_heads=2, head_dim=16, **kwargs), max_q_len


def _check(out, case):
  ref = np.asarray(reference.tree_attention(*case.args).astype(jnp.float32))
  out = np.asarray(out.astype(jnp.float32))
  assert out.shape == ref.shape and out.dtype == np.float32
  assert not np.isnan(out).any()
  # about one rounding step of the output (magnitude 1-2) in bfloat16 / float16
  atol = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3}.get(case.q_PxNxH.dtype.type, 2e-5)
  np.testing.assert_allclose(out, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(impl, name):
  case, max_q_len = _case(name)
  # Eager DMAs interpret faster; the race test below keeps the stricter copy-on-wait mode.
  interpret = pltpu.InterpretParams(dma_execution_mode="eager") if impl == "tpu" else True
  out = dispatch.tree_attention(*case.args, impl=impl, interpret=interpret, block_kv=BLOCK,
                                max_q_len=max_q_len)
  assert out.dtype == case.q_PxNxH.dtype
  _check(out, case)


def test_gpu_kernel_in_float16():
  """float16 is the GPU kernel's alone (the TPU one refuses it: tpu.unsupported_reason)."""
  case = make_case(7, cache_len=CACHE, num_kv_heads=2, head_dim=16, q_lens=[6, 0, 9],
                   kv_lens=[20, 3, 41], group=4, dtype=jnp.float16, tree="bushy")
  out = dispatch.tree_attention(*case.args, impl="gpu", interpret=True, block_kv=BLOCK,
                                max_q_len=9)
  assert out.dtype == jnp.float16
  _check(out, case)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_reads_one_layer_of_a_stacked_cache(impl):
  """layer=1 of a [3, B, S, K, H] cache whose other layers are NaN: the kernel reads that layer
  in place and equals the reference on it (the engine passes its whole cache this way)."""
  case, max_q_len = _case("f32_gqa3_bushy_2words")
  nan = jnp.full_like(case.k_BxSxKxH, jnp.nan)
  k = jnp.stack([nan, case.k_BxSxKxH, nan])
  v = jnp.stack([nan, case.v_BxSxKxH, nan])
  interpret = pltpu.InterpretParams(dma_execution_mode="eager") if impl == "tpu" else True
  out = dispatch.tree_attention(case.q_PxNxH, k, v, *case.args[3:], impl=impl,
                                interpret=interpret, block_kv=BLOCK, max_q_len=max_q_len,
                                layer=1)
  _check(out, case)
  ref = dispatch.tree_attention(case.q_PxNxH, k, v, *case.args[3:], impl="reference", layer=1)
  _check(ref, case)
  with pytest.raises(ValueError, match="layer=3 is outside the cache's 3 layers"):
    dispatch.tree_attention(case.q_PxNxH, k, v, *case.args[3:], impl=impl, layer=3)


def test_tpu_kernel_race_free_with_nan_scratch():
  """Race detector over the double-buffered DMAs; copies land only at their wait (a read before
  the wait would see the NaN the scratch starts with)."""
  case, max_q_len = _case("f32_gqa1_chain")
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                                 dma_execution_mode="on_wait")
  out = dispatch.tree_attention(*case.args, impl="tpu", interpret=params, block_kv=BLOCK,
                                max_q_len=max_q_len)
  _check(out, case)
  assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


@pytest.mark.parametrize("kv_splits", [3, 8])
def test_gpu_kernel_split_kv_matches_reference(kv_splits):
  """Flash-decoding splits (uneven shares, some splits empty) merge to the same result."""
  case, max_q_len = _case("f32_gqa3_bushy_2words")
  out = gpu.tree_attention(*case.args, max_q_len=max_q_len, sm_scale=16 ** -0.5,
                           block_kv=BLOCK, kv_splits=kv_splits, interpret=True)
  _check(out, case)


def random_config(seed: int):
  """A random batch: 1-5 rows, GQA 1/3/8, 1-2 mask words, f32 or bf16, any lengths that fit."""
  rng = np.random.default_rng(seed)
  batch = int(rng.integers(1, 6))
  num_words = int(rng.integers(1, 3))
  max_q_len = int(rng.integers(1, 32 * num_words + 1))
  q_lens = rng.integers(0, max_q_len + 1, batch)
  kv_lens = [int(rng.integers(0, CACHE - n + 1)) for n in q_lens]
  return dict(q_lens=q_lens, kv_lens=kv_lens, group=int(rng.choice([1, 3, 8])),
              num_words=num_words, dtype=[jnp.float32, jnp.bfloat16][seed % 2],
              tree=str(rng.choice(["chain", "bushy", "random"])), gap=int(rng.integers(0, 2)),
              tail_pad=int(rng.integers(0, 3))), max_q_len


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_kernel_random_batches(impl, seed):
  kwargs, max_q_len = random_config(seed)
  case = make_case(seed, cache_len=CACHE, num_kv_heads=2, head_dim=16, **kwargs)
  interpret = pltpu.InterpretParams(dma_execution_mode="eager") if impl == "tpu" else True
  out = dispatch.tree_attention(*case.args, impl=impl, interpret=interpret, block_kv=BLOCK,
                                max_q_len=max_q_len)
  _check(out, case)
