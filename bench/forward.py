"""Prefill and decode throughput of SmolLM2-135M on the current backend, with the decode roofline.

For each batch size B:
- prefill: B prompts of `--prompt_len` tokens written into an empty KV cache of `--cache_len`
  positions, one jitted call; tokens/s = B * prompt_len / time.
- decode: `--decode_steps` jitted one-token steps (greedy, cache donated and updated in place)
  continuing from the prefilled cache; tokens/s = B * steps / time.
- roofline: a decode step must read every weight once plus the whole KV cache (our attention
  reads all S = cache_len positions, masked, whatever the prefix length), so
  max tokens/s = B * mem_bw / (weight bytes + KV bytes). Decode at small B is memory-bound;
  the ratio measured / roofline says how close the step gets to the memory system's limit.

Each timing: compiled and run once untimed first, then `--reps` timed runs ending in
`block_until_ready`, median reported. The table is printed and appended to bench/RESULTS.md.

  python bench/forward.py                      # real weights if the GGUF package is installed
  python bench/forward.py --batch_sizes 1,8 --weights random --no_append
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.models.attention import KVCache  # noqa: E402
from rhyme_jax.models.config import ModelConfig  # noqa: E402
from rhyme_jax.models.transformer import init_model  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_135M = ModelConfig(
    arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5,
    tie_word_embeddings=True)

# Peak memory bandwidth (GB/s) from vendor datasheets, matched against `device_kind`.
DOCUMENTED_BW_GBS = (
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0), ("L4", 300.0), ("TPU v6", 1640.0), ("TPU v5p", 2765.0),
    ("TPU v5", 819.0), ("TPU v4", 1200.0),
)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch_sizes", default="1,8,32", help="comma-separated batch sizes")
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--cache_len", type=int, default=512, help="KV cache positions per row")
  p.add_argument("--decode_steps", type=int, default=32, help="decode steps per timed run")
  p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="params, activations and cache; default float32 on cpu, else bfloat16")
  p.add_argument("--weights", default="auto", choices=("auto", "real", "random"),
                 help=f"real: load {MODEL_NAME}; random: same config, random values; auto: "
                      "real when it loads, else random (speed does not depend on the values)")
  p.add_argument("--mem_bw_gbs", type=float, default=None,
                 help="device memory bandwidth for the roofline (GB/s); default: datasheet "
                      "figure for known accelerators, else measured with a large copy")
  common.add_results_args(p)
  args = p.parse_args(argv)
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  except ValueError:
    p.error(f"--batch_sizes={args.batch_sizes!r}: expected comma-separated integers")
  if args.prompt_len + args.decode_steps > args.cache_len:
    p.error(f"--prompt_len={args.prompt_len} + --decode_steps={args.decode_steps} exceeds "
            f"--cache_len={args.cache_len}")
  return args


def load(weights: str, dtype: str):
  """(model, cfg, description of the weights)."""
  if weights in ("auto", "real"):
    try:
      from rhyme_jax.models.loading import load_model
      model, cfg = load_model(MODEL_NAME, param_dtype=dtype)
      return model, cfg.replace(dtype=dtype), f"real {MODEL_NAME} weights (GGUF, dequantized)"
    except (ImportError, FileNotFoundError) as e:
      if weights == "real":
        raise
      print(f"[forward] real weights unavailable ({e}); using random weights", flush=True)
  cfg = SMOLLM2_135M.replace(param_dtype=dtype, dtype=dtype)
  return init_model(cfg, 0), cfg, "random weights, SmolLM2-135M config"


def measure_bw_gbs() -> tuple[float, str]:
  """A rough stream bandwidth: a large copy (read + write bytes / time), median of 5."""
  if jax.default_backend() == "cpu":
    src = np.ones(64 * 2**20, np.float32)  # 256 MiB
    dst = np.empty_like(src)
    t = common.median_time(lambda: np.copyto(dst, src), 5)
    return 2 * src.nbytes / t / 1e9, "measured: numpy copy of 256 MiB"
  x = jnp.ones(256 * 2**20, jnp.float32)  # 1 GiB
  copy = jax.jit(lambda a: a + 1)
  copy(x).block_until_ready()
  t = common.median_time(lambda: copy(x).block_until_ready(), 5)
  return 2 * x.nbytes / t / 1e9, "measured: jitted elementwise op on 1 GiB"


def memory_bandwidth(flag: float | None) -> tuple[float, str]:
  if flag is not None:
    return flag, "--mem_bw_gbs"
  kind = jax.devices()[0].device_kind
  for name, bw in DOCUMENTED_BW_GBS:
    if name.lower() in kind.lower():
      return bw, f"datasheet figure for {name}"
  return measure_bw_gbs()


def make_fns(model):
  """Jitted prefill and decode step over the split model state (cache donated)."""
  graphdef, state = nnx.split(model)

  def prefill(state, cache, tokens_BxT):
    b, t = tokens_BxT.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = nnx.merge(graphdef, state)(tokens_BxT, positions, cache=cache,
                                     cache_len_B=jnp.zeros((b,), jnp.int32))
    next_B = jnp.argmax(out.logits_BxTxV[:, -1], axis=-1).astype(jnp.int32)
    return next_B, out.cache

  def decode(state, cache, tok_B, cache_len_B):
    out = nnx.merge(graphdef, state)(tok_B[:, None], cache_len_B[:, None], cache=cache,
                                     cache_len_B=cache_len_B)
    next_B = jnp.argmax(out.logits_BxTxV[:, -1], axis=-1).astype(jnp.int32)
    return next_B, out.cache, cache_len_B + 1

  return state, jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1)


def bench_batch(state, prefill, decode, cfg, b, args, bw_gbs, weight_bytes):
  rng = np.random.default_rng(b)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, args.prompt_len)), jnp.int32)
  dtype = cfg.jnp_dtype

  def prefilled(timings=None):
    empty = jax.block_until_ready(KVCache.zeros(cfg, b, args.cache_len, dtype))  # untimed
    t0 = time.perf_counter()
    out = jax.block_until_ready(prefill(state, empty, tokens))  # donates `empty`
    if timings is not None:
      timings.append(time.perf_counter() - t0)
    return out

  def run_decode(nxt_B, cache, steps):
    clen_B = jnp.full((b,), args.prompt_len, jnp.int32)
    for _ in range(steps):
      nxt_B, cache, clen_B = decode(state, cache, nxt_B, clen_B)
    jax.block_until_ready((nxt_B, cache))

  t0 = time.perf_counter()
  start = prefilled()
  run_decode(*jax.tree.map(jnp.copy, start), 2)  # compiles both functions, warms up
  compile_s = time.perf_counter() - t0
  prefill_times = []
  for _ in range(args.reps):
    prefilled(prefill_times)
  t_prefill = float(np.median(prefill_times))
  times = []
  for _ in range(args.reps):
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, start))  # each run donates its cache
    t0 = time.perf_counter()
    run_decode(*fresh, args.decode_steps)
    times.append(time.perf_counter() - t0)
  t_decode = float(np.median(times))

  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = 2 * cfg.num_layers * b * args.cache_len * cfg.num_kv_heads * cfg.head_dim * itemsize
  step_bytes = weight_bytes + kv_bytes
  step_s = t_decode / args.decode_steps
  roof_tps = b * bw_gbs * 1e9 / step_bytes
  return {
      "batch": b,
      "prefill_ms": t_prefill * 1e3,
      "prefill_tps": b * args.prompt_len / t_prefill,
      "decode_ms_step": step_s * 1e3,
      "decode_tps": b / step_s,
      "step_mb": step_bytes / 1e6,
      "kv_mb": kv_bytes / 1e6,
      "roof_tps": roof_tps,
      "frac": (b / step_s) / roof_tps,
      "warmup_s": compile_s,
  }


def main(argv=None):
  args = parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  print(f"[forward] device: {common.device_description()}", flush=True)
  model, cfg, weights_desc = load(args.weights, dtype)
  bw_gbs, bw_src = memory_bandwidth(args.mem_bw_gbs)
  state, prefill, decode = make_fns(model)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"[forward] {weights_desc}; {n_params / 1e6:.1f}M params, {dtype}, "
        f"{weight_bytes / 1e6:.0f} MB; memory bandwidth {bw_gbs:.1f} GB/s ({bw_src})", flush=True)

  rows = []
  for b in args.batch_sizes:
    r = bench_batch(state, prefill, decode, cfg, b, args, bw_gbs, weight_bytes)
    print(f"[forward] B={b}: prefill {r['prefill_tps']:.0f} tok/s, decode {r['decode_tps']:.1f} "
          f"tok/s (roofline {r['roof_tps']:.1f}), compile+warm-up {r['warmup_s']:.1f}s", flush=True)
    rows.append([b, f"{r['prefill_ms']:.1f}", f"{r['prefill_tps']:.0f}",
                 f"{r['decode_ms_step']:.2f}", f"{r['decode_tps']:.1f}",
                 f"{r['step_mb']:.0f} ({r['kv_mb']:.0f} KV)", f"{r['roof_tps']:.1f}",
                 f"{100 * r['frac']:.0f}%"])

  headers = ["batch", "prefill ms", "prefill tok/s", "decode ms/step", "decode tok/s",
             "MB read/step (KV)", "roofline tok/s", "of roofline"]
  table = common.markdown_table(headers, rows)
  print(table)
  notes = [f"SmolLM2-135M, {weights_desc}, {dtype}, {n_params / 1e6:.1f}M params "
           f"({weight_bytes / 1e6:.0f} MB); prompt {args.prompt_len} tokens, KV cache "
           f"{args.cache_len} positions, {args.decode_steps} greedy decode steps per run, "
           f"median of {args.reps}",
           f"roofline: (weights + full KV cache) bytes per step / {bw_gbs:.1f} GB/s ({bw_src})"]
  notes += args.note
  if not args.no_append:
    common.append_results("Forward throughput (bench/forward.py)", table, notes)
    print(f"[forward] appended to {common.RESULTS_PATH}")


if __name__ == "__main__":
  main()
