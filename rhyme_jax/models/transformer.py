"""The decoder: Llama / Qwen2 / Qwen3 in Flax NNX, one forward for prefill, decode and tree verify.

Parameter names follow the HF layout (`layers[i].attn.q_proj.kernel`, ...) with kernels stored
input-major (`[in, out]`), so loaders only transpose and partition rules read naturally.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rhyme_jax.models import attention
from rhyme_jax.models.attention import KVCache
from rhyme_jax.models.config import ModelConfig


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=cfg.jnp_dtype,
                    param_dtype=cfg.jnp_param_dtype,
                    kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = _linear(cfg, d, n * h, cfg.attention_bias, rngs)
    self.k_proj = _linear(cfg, d, k * h, cfg.attention_bias, rngs)
    self.v_proj = _linear(cfg, d, k * h, cfg.attention_bias, rngs)
    self.o_proj = _linear(cfg, n * h, d, False, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
      self.k_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxT, cache, layer, cache_len_B):
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    q = self.q_proj(x_BxTxD).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = attention.rope_inv_freq(cfg)  # a trace-time constant
    q = attention.apply_rope(q, positions_BxT, inv_freq)
    k = attention.apply_rope(k, positions_BxT, inv_freq)
    if cache is None:
      out = attention.attend(q, k, v, mask_BxTxT)
    else:
      cache = attention.write_cache(cache, layer, k, v, cache_len_B)
      mask_BxTxS = attention.cache_visibility(cache_len_B, mask_BxTxT, cache.max_len)
      out = attention.attend(q, cache.k_LxBxSxKxH[layer], cache.v_LxBxSxKxH[layer], mask_BxTxS)
    return self.o_proj(out.reshape(b, t, -1)), cache

  def packed(self, x_PxD, positions_P, cache: KVCache, layer: int, pk: attention.Packed):
    """Decoding over packed tokens: writes their K/V after each row's prefix, tree attention."""
    cfg = self.cfg
    p = x_PxD.shape[0]
    q = self.q_proj(x_PxD).reshape(1, p, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x_PxD).reshape(1, p, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(x_PxD).reshape(p, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = attention.rope_inv_freq(cfg)
    q = attention.apply_rope(q, positions_P[None], inv_freq)[0]
    k = attention.apply_rope(k, positions_P[None], inv_freq)[0]
    cache = attention.write_packed(cache, layer, k, v, pk.kv_len_B, pk.q_start_B, pk.q_len_B)
    out = attention.tree_attention(q, cache.k_LxBxSxKxH, cache.v_LxBxSxKxH,
                                   pk.kv_len_B, pk.q_start_B, pk.q_len_B, pk.mask_PxW,
                                   max_kv_len=pk.max_kv_len, max_q_len=pk.max_q_len,
                                   impl=pk.impl, layer=layer)
    return self.o_proj(out.reshape(p, -1)), cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(cfg, d, f, False, rngs)
    self.up_proj = _linear(cfg, d, f, False, rngs)
    self.down_proj = _linear(cfg, f, d, False, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                  param_dtype=cfg.jnp_param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions_BxT, mask_BxTxT, cache, layer, cache_len_B):
    h, cache = self.attn(self.input_norm(x), positions_BxT, mask_BxTxT, cache, layer, cache_len_B)
    x = x + h
    return x + self.mlp(self.post_attn_norm(x)), cache

  def packed(self, x_PxD, positions_P, cache, layer, pk):
    h, cache = self.attn.packed(self.input_norm(x_PxD), positions_P, cache, layer, pk)
    x = x_PxD + h
    return x + self.mlp(self.post_attn_norm(x)), cache


class Output(NamedTuple):
  logits_BxTxV: jax.Array  # float32
  cache: KVCache | None


class Transformer(nnx.Module):
  """Decoder-only LM. `__call__` covers training (no cache), prefill, decode and tree verify."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                           param_dtype=cfg.jnp_param_dtype,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, *,
               cache: KVCache | None = None, cache_len_B: jax.Array | None = None,
               mask_BxTxT: jax.Array | None = None, remat: bool = False) -> Output:
    """Runs T new tokens per row.

    Without a cache the T tokens attend among themselves (`mask_BxTxT`, causal by default).
    With a cache their K/V are written at `[cache_len_B, cache_len_B + T)` and each token
    sees the prefix `[0, cache_len_B)` plus the new tokens `mask_BxTxT` allows: a causal mask
    for prefill chunks and chains, an ancestor mask for draft trees. `positions_BxT` are the
    RoPE positions (prefix length + tree depth for tree tokens).

    `remat` (training, no cache): each layer's activations are recomputed in the backward
    pass instead of kept (`jax.checkpoint` per layer), so a gradient keeps one B×T×D input
    per layer and one layer's working set at a time, for about a third more compute. The
    same values to float rounding.
    """
    hidden, cache = self.trunk(tokens_BxT, positions_BxT, cache=cache, cache_len_B=cache_len_B,
                               mask_BxTxT=mask_BxTxT, remat=remat)
    return Output(self.logits(hidden), cache)

  def trunk(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, *,
            cache: KVCache | None = None, cache_len_B: jax.Array | None = None,
            mask_BxTxT: jax.Array | None = None, remat: bool = False
            ) -> tuple[jax.Array, KVCache | None]:
    """`__call__` up to the head: the final-normed hidden states hidden_BxTxD (the model's
    dtype) and the cache. The learner applies the head (`logits`) a chunk of positions at a
    time under --remat (rl/learner.py), so the B x T x V logits are never live at once."""
    b, t = tokens_BxT.shape
    if mask_BxTxT is None:
      mask_BxTxT = jnp.broadcast_to(attention.causal_mask(t), (b, t, t))
    if cache is not None and cache_len_B is None:
      raise ValueError("cache_len_B is required with a cache")
    if remat and cache is not None:
      raise ValueError("remat is for training: it takes no cache")
    x = self.embed(tokens_BxT)
    if remat:
      x = _remat_layers(self.layers, x, positions_BxT, mask_BxTxT)
    else:
      for i, layer in enumerate(self.layers):
        x, cache = layer(x, positions_BxT, mask_BxTxT, cache, i, cache_len_B)
    return self.final_norm(x), cache

  def logits(self, hidden):
    """float32 logits of final-normed hidden states ([..., D] -> [..., V])."""
    if self.cfg.tie_word_embeddings:
      return self.embed.attend(hidden).astype(jnp.float32)
    return self.lm_head(hidden).astype(jnp.float32)

  def decode_packed(self, tokens_P: jax.Array, positions_P: jax.Array, cache: KVCache,
                    pk: attention.Packed) -> tuple[jax.Array, KVCache]:
    """Runs the packed new tokens of all rows (roots and draft nodes) against the cache:
    (float32 logits_PxV, cache with their K/V written at each row's kv_len + index)."""
    x = self.embed(tokens_P)
    for i, layer in enumerate(self.layers):
      x, cache = layer.packed(x, positions_P, cache, i, pk)
    return self.logits(self.final_norm(x)), cache


def _remat_layers(layers, x, positions_BxT, mask_BxTxT):
  """Training blocks (no cache) whose activations the backward pass recomputes, one layer at
  a time: a `lax.scan` over the layers' stacked states whose body is the block as a pure
  function of its state under `jax.checkpoint` (nnx.remat writes the state back, which the
  learner's scanned, differentiated micro-batches cannot take). The scan is what keeps one
  layer's working set live: checkpointed blocks in a Python loop left XLA free to schedule
  every layer's recomputation at once, and on CPU it did (the compiled gradient held every
  layer's working set, with remat or without). The stacked states are one more copy of the
  layers' parameters while the step runs (rl/memory.py counts it)."""
  graphdefs, states = zip(*(nnx.split(layer) for layer in layers))
  graphdef = graphdefs[0]
  if any(g != graphdef for g in graphdefs[1:]):
    raise ValueError("remat: the layers differ in structure and cannot be scanned as one")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

  @jax.checkpoint
  def block(state, x):
    return nnx.merge(graphdef, state)(x, positions_BxT, mask_BxTxT, None, 0, None)[0]

  x, _ = jax.lax.scan(lambda x, state: (block(state, x), None), x, stacked)
  return x


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model (tests, tiny experiments)."""
  return Transformer(cfg, rngs=nnx.Rngs(seed))
