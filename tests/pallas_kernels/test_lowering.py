"""Each kernel lowers for its hardware on this CPU-only jaxlib (jax.export cross-lowering).

Exporting runs the Pallas -> Mosaic / Triton lowering in full, so an op without a lowering rule,
a bad block shape or a non-power-of-two Triton load fails here; only the backend compilers'
own passes (Mosaic layout, ptxas) are left for the hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import tree_attention as dispatch

TRITON_CALL = "__gpu$xla.gpu.triton"
HEADS = {  # name: (query heads N, KV heads K, head dim H)
    "smollm2": (9, 3, 64),
    "qwen2.5-7b": (28, 4, 128),
}


def _export(impl, platform, heads, dtype, *, batch=8, cache_len=4096, tokens=8 * 17,
            max_q_len=17, layers=None):
  """layers: a stacked [L, B, S, K, H] cache of which the kernel reads layer L - 1."""
  num_heads, num_kv_heads, head_dim = heads
  sd = jax.ShapeDtypeStruct
  i32 = sd((batch,), jnp.int32)
  cache = (batch, cache_len, num_kv_heads, head_dim)
  cache = cache if layers is None else (layers, *cache)
  args = (sd((tokens, num_heads, head_dim), dtype), sd(cache, dtype), sd(cache, dtype), i32, i32,
          i32, sd((tokens, 1), jnp.uint32))
  layer = None if layers is None else layers - 1
  fn = jax.jit(lambda *a: dispatch.tree_attention(*a, impl=impl, max_q_len=max_q_len,
                                                  layer=layer))
  # Triton custom calls carry no serialization-compatibility guarantee; we only lower here.
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)] if platform == "cuda" else []
  exported = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
  return exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_tpu_kernel_lowers_for_tpu(heads, dtype):
  module = _export("tpu", "tpu", HEADS[heads], dtype)
  assert "tpu_custom_call" in module and "tree_attention_tpu" in module


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_gpu_kernel_lowers_for_cuda(heads, dtype):
  module = _export("gpu", "cuda", HEADS[heads], dtype)
  assert TRITON_CALL in module


def test_decode_tiles_lower_for_both():
  """max_q_len=1 (decode): the smallest query tiles the backends allow."""
  assert "tpu_custom_call" in _export("tpu", "tpu", HEADS["qwen2.5-7b"], jnp.bfloat16,
                                      tokens=8, max_q_len=1)
  assert TRITON_CALL in _export("gpu", "cuda", HEADS["qwen2.5-7b"], jnp.bfloat16, tokens=8,
                                max_q_len=1)


def test_stacked_cache_lowers_for_both():
  """The engine's call: the whole [L, B, S, K, H] cache and a static layer (read in place)."""
  assert "tpu_custom_call" in _export("tpu", "tpu", HEADS["qwen2.5-7b"], jnp.bfloat16,
                                      cache_len=4352, layers=28)
  assert TRITON_CALL in _export("gpu", "cuda", HEADS["qwen2.5-7b"], jnp.bfloat16,
                                cache_len=4352, layers=28)
