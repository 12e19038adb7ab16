"""Dispatch for tree-verification attention: Pallas TPU, Pallas GPU, or the dense reference.

Same arguments as the ATTENTION CONTRACT (rhyme_jax.models.attention.tree_attention), plus
kernel-only keywords, so the engine can switch by passing impl=:
  impl="auto"       TPU backend -> "tpu", GPU backend -> "gpu", anything else -> "reference".
  impl="tpu"|"gpu"  that kernel (on CPU only with interpret=True).
  impl="reference"  the dense plain-JAX reference.
When the chosen kernel cannot take the shapes/dtypes (see each kernel's unsupported_reason), the
call falls back to the reference and logs the reason once (this happens at trace time, so a
compiled step never re-decides).
max_q_len (static) must bound every q_len_B[b]; it sizes the per-row query tile. Default:
min(32 * W, P), safe under the contract's bound q_len_B[b] <= 32 * W; the engine passes 1 for
decode and tree budget + 1 for verification so decode tiles stay small.
layer (static): k and v are a stacked per-layer cache [L, B, S, K, H] and layer `layer` is the
one attended. The kernels read it in place; slicing the layer out first would make XLA copy the
whole layer (every row's S positions) before each kernel call.
"""

from __future__ import annotations

import logging

import jax

from pallas_kernels import gpu, reference, tpu

IMPLS = ("auto", "reference", "tpu", "gpu")
_log = logging.getLogger(__name__)
_logged_reasons: set[str] = set()


def resolve_impl(impl: str) -> str:
  """The concrete implementation "auto" stands for on the default backend."""
  if impl not in IMPLS:
    raise ValueError(f"tree_attention: impl={impl!r} is not one of {IMPLS}")
  if impl != "auto":
    return impl
  return {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")


def _fall_back(reason: str) -> None:
  if reason not in _logged_reasons:
    _logged_reasons.add(reason)
    _log.warning("tree_attention falls back to the reference: %s", reason)


def check_shapes(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW,
                 layer: int | None = None) -> None:
  """Raise one clear line naming the tensor whose shape breaks the contract."""
  k_dims = "[B,S,K,H]" if layer is None else "[L,B,S,K,H] (with layer=)"
  if q_PxNxH.ndim != 3 or k_BxSxKxH.ndim != (4 if layer is None else 5):
    raise ValueError(f"tree_attention: q must be [P,N,H] and k {k_dims}; got q{q_PxNxH.shape} "
                     f"k{k_BxSxKxH.shape}")
  if layer is not None and not 0 <= layer < k_BxSxKxH.shape[0]:
    raise ValueError(f"tree_attention: layer={layer} is outside the cache's "
                     f"{k_BxSxKxH.shape[0]} layers")
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  batch, _, num_kv_heads, k_head_dim = k_BxSxKxH.shape[-4:]
  if v_BxSxKxH.shape != k_BxSxKxH.shape:
    raise ValueError(f"tree_attention: v{v_BxSxKxH.shape} must match k{k_BxSxKxH.shape}")
  if k_head_dim != head_dim or num_heads % num_kv_heads:
    raise ValueError(f"tree_attention: q{q_PxNxH.shape} does not fit k{k_BxSxKxH.shape} "
                     "(head dims must agree and N must be a multiple of K)")
  for name, x in (("kv_len_B", kv_len_B), ("q_start_B", q_start_B), ("q_len_B", q_len_B)):
    if x.shape != (batch,):
      raise ValueError(f"tree_attention: {name} has shape {x.shape}, expected ({batch},)")
  if mask_PxW.ndim != 2 or mask_PxW.shape[0] != num_tokens:
    raise ValueError(f"tree_attention: mask_PxW has shape {mask_PxW.shape}, expected "
                     f"({num_tokens}, W)")


def tree_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, *,
                   max_kv_len: int | None = None, sm_scale: float | None = None,
                   max_q_len: int | None = None, impl: str = "auto", interpret=False,
                   block_kv: int | None = None, layer: int | None = None):
  """Tree-verification attention per the contract; see the module docstring for impl and layer.

  interpret: False, True, or (TPU) a pltpu.InterpretParams, to run a kernel without hardware.
  block_kv: KV positions per block (default 512 on TPU, 64 on GPU).
  """
  check_shapes(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW, layer)
  head_dim = q_PxNxH.shape[-1]
  sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  if max_q_len is None:
    max_q_len = min(32 * mask_PxW.shape[1], q_PxNxH.shape[0])
  args = (q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW)

  def run_reference():  # on the one layer
    one = args if layer is None else (q_PxNxH, k_BxSxKxH[layer], v_BxSxKxH[layer], *args[3:])
    return reference.tree_attention(*one, max_kv_len=max_kv_len, sm_scale=sm_scale)

  chosen = resolve_impl(impl)
  if chosen == "reference":
    return run_reference()
  kernel = {"tpu": tpu, "gpu": gpu}[chosen]
  block_kv = block_kv or kernel.DEFAULT_BLOCK_KV
  reason = kernel.unsupported_reason(q_PxNxH, k_BxSxKxH, block_kv=block_kv)
  if reason is None and max_q_len < 1:
    reason = f"max_q_len={max_q_len} < 1"
  if reason is not None:
    _fall_back(reason)
    return run_reference()
  return kernel.tree_attention(*args, max_q_len=max_q_len, sm_scale=sm_scale, block_kv=block_kv,
                               interpret=interpret, layer=layer)
