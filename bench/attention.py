"""Tree-verification attention: Pallas kernel vs an XLA baseline, and achieved HBM bandwidth.

For each (heads, mode, rows B, live length L): every row holds L committed positions; "decode"
adds 1 new token per row (zero draft tokens), "verify" adds a draft tree of `--tree` tokens
(random tree, one mask word). The cache has S = L + tokens rounded up to 512 positions.
- kernel: pallas_kernels.tree_attention with impl="auto" (TPU -> Mosaic, GPU -> Triton).
- xla: the engine's XLA path, rhyme_jax.models.attention.tree_attention, when that module has
  it (max_kv_len = S, max_q_len = tokens); otherwise the bench's own row-dense formulation
  (each row's tokens gathered into a [T] tile, scores against all S cache positions of the row,
  bit-tested tree mask, softmax, dense PV). Both read all S positions of every row.
- GB/s: bytes the kernel must move (live K and V of every row, q in, out back) / kernel time;
  "% copy" compares it with the device's measured copy bandwidth (read+write of a large array).
Timings: compiled and run once untimed, then the median of `--reps` runs (block_until_ready).
Outputs of the two paths are compared (max |diff|). The table is printed and appended to
bench/RESULTS.md. The engine's whole plain and speculative steps with the kernel vs the XLA
path: bench/engine_attention.py.

  python bench/attention.py                           # GPU/TPU: 1.5B and 7B heads, 1K-16K, 1-256 rows
  python bench/attention.py --smoke                   # CPU: tiny sizes, kernels in interpret mode
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from pallas_kernels import layout, reference  # noqa: E402
from pallas_kernels import tree_attention as dispatch  # noqa: E402

HEADS = {  # name: (query heads N, KV heads K, head dim H)
    "qwen2.5-1.5b": (12, 2, 128),
    "qwen2.5-7b": (28, 4, 128),
    "smollm2-135m": (9, 3, 64),
}


def xla_rows_attention(q_PxNxH, k_BxSxKxH, v_BxSxKxH, kv_len_B, q_start_B, q_len_B, mask_PxW,
                       *, max_q_len: int):
  """Row-dense XLA baseline: every row's tokens against all S cache positions of the row."""
  num_tokens, num_heads, head_dim = q_PxNxH.shape
  batch, cache_len, num_kv_heads, _ = k_BxSxKxH.shape
  group = num_heads // num_kv_heads
  q_BxKxRxH, mask_BxRxW = layout.gather_rows(
      q_PxNxH, mask_PxW, q_start_B, q_len_B, max_q_len=max_q_len, num_kv_heads=num_kv_heads,
      num_rows=max_q_len * group)
  scores_BxKxRxS = jnp.einsum("bkrh,bskh->bkrs", q_BxKxRxH, k_BxSxKxH,
                              preferred_element_type=jnp.float32) * head_dim ** -0.5
  j_BxS = jnp.arange(cache_len, dtype=jnp.int32)[None, :] - kv_len_B[:, None]
  mask_BxRxW = jax.lax.bitcast_convert_type(mask_BxRxW, jnp.uint32)
  bit_BxRxS = reference.mask_bit(
      jnp.broadcast_to(mask_BxRxW[:, :, None, :], (*mask_BxRxW.shape[:2], cache_len,
                                                   mask_BxRxW.shape[2])),
      jnp.broadcast_to(j_BxS[:, None, :, None], (batch, mask_BxRxW.shape[1], cache_len, 1)))[..., 0]
  live_BxS = j_BxS < q_len_B[:, None]
  seen_BxRxS = (j_BxS < 0)[:, None, :] | (bit_BxRxS & live_BxS[:, None, :])
  scores_BxKxRxS = jnp.where(seen_BxRxS[:, None], scores_BxKxRxS, -jnp.inf)
  probs_BxKxRxS = jax.nn.softmax(scores_BxKxRxS, axis=-1)
  v_BxSxKxH = jnp.where(live_BxS[:, :, None, None], v_BxSxKxH, 0)
  out_BxKxRxH = jnp.einsum("bkrs,bskh->bkrh", probs_BxKxRxS.astype(v_BxSxKxH.dtype), v_BxSxKxH,
                           preferred_element_type=jnp.float32).astype(q_PxNxH.dtype)
  return layout.scatter_rows(out_BxKxRxH, q_start_B, q_len_B, num_tokens=num_tokens,
                             max_q_len=max_q_len, num_heads=num_heads)


def xla_baseline():
  """(name, fn(*args, max_q_len)) of the XLA path to compare against."""
  try:
    from rhyme_jax.models.attention import tree_attention as engine_attention
  except ImportError:
    return "bench row-dense XLA", xla_rows_attention
  return "rhyme_jax.models.attention.tree_attention", lambda *a, max_q_len: engine_attention(
      *a, max_kv_len=a[1].shape[1], max_q_len=max_q_len)


def make_inputs(rng, *, heads, rows, live_len, tokens, dtype, cache_multiple):
  num_heads, num_kv_heads, head_dim = heads
  cache_len = layout.round_up(live_len + tokens, cache_multiple)
  key_q, key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  q = jax.random.normal(key_q, (rows * tokens, num_heads, head_dim), dtype)
  k = jax.random.normal(key_k, (rows, cache_len, num_kv_heads, head_dim), dtype)
  v = jax.random.normal(key_v, (rows, cache_len, num_kv_heads, head_dim), dtype)
  parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, tokens)])
  bits = np.zeros((tokens, 32), bool)
  for i, parent in enumerate(parents):  # ancestors-or-self, root token first
    bits[i] = bits[parent] if parent >= 0 else bits[i]
    bits[i, i] = True
  words = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(1).astype(np.uint32)
  mask = jnp.asarray(np.tile(words[:, None], (rows, 1)))
  kv_len = jnp.full((rows,), live_len, jnp.int32)
  q_start = jnp.arange(rows, dtype=jnp.int32) * tokens
  q_len = jnp.full((rows,), tokens, jnp.int32)
  return (q, k, v, kv_len, q_start, q_len, mask)


def copy_bandwidth(num_bytes: int, reps: int) -> float:
  """Bytes/s of a device copy (read + write) of a num_bytes array."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a * 1.0 + 0.0)  # not elided; one read and one write pass
  copy(x).block_until_ready()
  return 2 * x.nbytes / common.median_time(lambda: copy(x).block_until_ready(), reps)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--heads", default="qwen2.5-1.5b,qwen2.5-7b")
  parser.add_argument("--lengths", default="1024,4096,16384")
  parser.add_argument("--rows", default="1,16,64,256")
  parser.add_argument("--modes", default="decode,verify")
  parser.add_argument("--tree", type=int, default=17, help="verify tokens per row (root + draft)")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--max_cache_gib", type=float, default=24.0,
                      help="skip configurations whose K+V cache exceeds this")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes, kernels in interpret mode (CPU check that it runs)")
  common.add_results_args(parser, note=False)
  args = parser.parse_args(argv)

  if args.smoke:
    args.heads, args.lengths, args.rows, args.reps = "smollm2-135m", "40,100", "1,3", 2
    args.tree = 5
  interpret = args.smoke or jax.default_backend() not in ("tpu", "gpu")
  impl = dispatch.resolve_impl("auto") if not interpret else (
      "gpu" if args.smoke else "reference")
  block_kv = 16 if args.smoke else None
  dtype = jnp.dtype(args.dtype)
  cache_multiple = 16 if args.smoke else 512
  rng = np.random.default_rng(0)
  copy_bw = copy_bandwidth((1 << 22) if args.smoke else (1 << 31), args.reps)
  xla_name, xla_fn = xla_baseline()
  print(f"device: {common.device_description()}; kernel impl: {impl}"
        f"{' (interpret)' if interpret else ''}; xla: {xla_name}; "
        f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")

  rows_out = []
  for heads_name in args.heads.split(","):
    heads = HEADS[heads_name]
    for mode in args.modes.split(","):
      tokens = 1 if mode == "decode" else args.tree
      for rows in map(int, args.rows.split(",")):
        for live_len in map(int, args.lengths.split(",")):
          cache_bytes = (2 * rows * layout.round_up(live_len + tokens, cache_multiple)
                         * heads[1] * heads[2] * dtype.itemsize)
          if cache_bytes > args.max_cache_gib * (1 << 30):
            continue
          inputs = make_inputs(rng, heads=heads, rows=rows, live_len=live_len, tokens=tokens,
                               dtype=dtype, cache_multiple=cache_multiple)
          kernel = jax.jit(lambda *a, t=tokens: dispatch.tree_attention(
              *a, impl=impl, interpret=interpret, max_q_len=t, block_kv=block_kv))
          xla = jax.jit(lambda *a, t=tokens: xla_fn(*a, max_q_len=t))
          out_kernel = kernel(*inputs).block_until_ready()
          out_xla = xla(*inputs).block_until_ready()
          diff = float(jnp.max(jnp.abs(out_kernel.astype(jnp.float32)
                                       - out_xla.astype(jnp.float32))))
          t_kernel = common.median_time(lambda: kernel(*inputs).block_until_ready(), args.reps)
          t_xla = common.median_time(lambda: xla(*inputs).block_until_ready(), args.reps)
          moved = (2 * rows * (live_len + tokens) * heads[1] * heads[2]
                   + 2 * inputs[0].size) * dtype.itemsize
          bw = moved / t_kernel
          rows_out.append([heads_name, mode, rows, live_len, f"{t_kernel * 1e3:.3f}",
                           f"{t_xla * 1e3:.3f}", f"{t_xla / t_kernel:.2f}x",
                           f"{bw / 1e9:.1f}", f"{100 * bw / copy_bw:.0f}%", f"{diff:.1e}"])
          print(" | ".join(map(str, rows_out[-1])), flush=True)

  table = common.markdown_table(
      ["heads", "mode", "rows", "live len", "kernel ms", "xla ms", "xla/kernel", "kernel GB/s",
       "% copy", "max abs diff"], rows_out)
  print(table)
  if not args.no_append:
    notes = [f"kernel impl {impl}{' in interpret mode' if interpret else ''}, dtype {args.dtype}, "
             f"verify tree {args.tree} tokens, reps {args.reps} (median); xla = {xla_name}",
             f"measured copy bandwidth {copy_bw / 1e9:.1f} GB/s"]
    if args.smoke:
      notes.append("SMOKE RUN on CPU: interpret-mode timings are meaningless; this only checks "
                   "that the bench runs and both paths agree. The GPU/TPU run is pending.")
    common.append_results("Tree attention: Pallas kernel vs XLA (bench/attention.py)", table,
                          notes)


if __name__ == "__main__":
  main()
