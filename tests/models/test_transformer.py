"""models/transformer.py: what a gradient keeps with and without `remat` (--remat)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint prints

from rhyme_jax.models.attention import KVCache
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rl import losses

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
B, T = 2, 48


def _residuals(remat: bool):
  """The arrays the backward pass of the training loss keeps (weights and constants aside)."""
  graphdef, state = nnx.split(init_model(CFG, 0))
  tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(0, 128, (B, T)), jnp.int32)
  positions_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))

  def loss(state):
    model = nnx.merge(graphdef, state)
    logits_BxTxV = model(tokens_BxT, positions_BxT, remat=remat).logits_BxTxV
    return losses.token_logprobs(logits_BxTxV, tokens_BxT).mean()

  return [a for a, why in saved_residuals(loss, state)
          if "argument" not in why and "constant" not in why and "literal" not in why]


def test_remat_keeps_each_layers_input_and_no_attention_arrays():
  kept, remat = _residuals(False), _residuals(True)
  square = lambda res: [a for a in res if a.dtype == jnp.float32 and a.shape.count(T) >= 2]
  assert square(kept)  # without remat every layer keeps its T x T scores and probabilities
  assert not square(remat)
  width = [a for a in remat if a.shape == (B, T, CFG.hidden_size)]
  # each layer's input (the embedding, then the blocks' outputs) and the final norm's few
  assert CFG.num_layers <= len(width) <= CFG.num_layers + 3
  size = lambda res: sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res)
  assert size(remat) < size(kept) / 4


def test_remat_takes_no_cache():
  model = init_model(CFG, 0)
  cache = KVCache.zeros(CFG, 1, 8)
  with pytest.raises(ValueError, match="remat is for training"):
    model(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), cache=cache,
          cache_len_B=jnp.zeros(1, jnp.int32), remat=True)


def _compiled_temp_bytes(num_layers: int, remat: bool) -> int:
  """XLA's temporaries for the gradient of the training loss at T = 256 (4 rows)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(CFG, num_layers=num_layers)
  graphdef, state = nnx.split(init_model(cfg, 0))
  tokens_BxT = jnp.zeros((4, 256), jnp.int32)
  positions_BxT = jnp.broadcast_to(jnp.arange(256), (4, 256))

  def loss(state):
    model = nnx.merge(graphdef, state)
    logits_BxTxV = model(tokens_BxT, positions_BxT, remat=remat).logits_BxTxV
    return losses.token_logprobs(logits_BxTxV, tokens_BxT).mean()

  return jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes


def test_remat_holds_one_layers_working_set_in_the_compiled_gradient():
  """What XLA allocates, not only what JAX saves: checkpointed blocks in a Python loop let XLA
  schedule every layer's recomputation at once, and on CPU the compiled gradient grew by a
  layer's whole working set per layer with remat as without it. Scanned, a layer adds little
  more than its input and its share of the stacked parameters."""
  per_layer = lambda remat: (_compiled_temp_bytes(5, remat) - _compiled_temp_bytes(1, remat)) / 4
  kept, remat = per_layer(False), per_layer(True)
  assert kept > 4 * 4 * 256 * 256 * 4  # a layer's T x T float32 arrays (4 heads, 4 rows)
  assert remat < kept / 5


def test_remat_refuses_layers_it_cannot_stack():
  model = init_model(CFG, 0)
  model.layers[1].extra = nnx.Param(jnp.zeros(3))  # one layer unlike the others
  tokens_BxT = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="layers differ in structure"):
    model(tokens_BxT, jnp.zeros((1, 4), jnp.int32), remat=True)
