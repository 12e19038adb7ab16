"""The decode state of B slots and the pure functions that advance it.

`verify_step` is the only decode step: it feeds each slot's root token plus a draft tree of
static budget T (T = 0 is plain one-token decoding), samples every node with its
position-keyed key, walks the tree, compacts the accepted path's KV and returns the emitted
tokens. `prefill_chunk` writes one chunk of one slot's prompt. Both are pure functions of
(graphdef, params, state, inputs), jitted once per (bucket, budget) by the engine.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from rhyme_jax.models.attention import KVCache
from rhyme_jax.rollout import accept, kv_cache, sampling


@flax.struct.dataclass
class DecodeState:
  """Everything on device about B slots. A slot's cache holds its first `length` tokens; its
  root (the last emitted token) is not in the cache yet and is the next step's first input."""

  cache: KVCache
  length_B: jax.Array  # int32
  root_B: jax.Array  # int32
  request_B: jax.Array  # int32 request id (keys the random draws)
  temperature_B: jax.Array  # float32, 0 = greedy
  top_p_B: jax.Array  # float32
  top_k_B: jax.Array  # int32, 0 = off

  @classmethod
  def empty(cls, cache: KVCache) -> "DecodeState":
    b = cache.batch
    zi = lambda: jnp.zeros((b,), jnp.int32)  # distinct buffers: the state is donated
    return cls(cache, zi(), zi(), zi(), jnp.ones((b,), jnp.float32), jnp.ones((b,), jnp.float32),
               zi())

  @property
  def batch(self) -> int:
    return self.length_B.shape[0]


class StepOutput(NamedTuple):
  tokens_BxN: jax.Array  # int32 emitted tokens (first num_emitted valid), N = T+1
  logprobs_BxN: jax.Array  # float32 their log-probabilities under the sampling distribution
  num_emitted_B: jax.Array  # int32 in [1, T+1]


def verify_step(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState,
                tree: accept.TreeBatch, seed: jax.Array, filters: bool
                ) -> tuple[DecodeState, StepOutput]:
  """One forward over root + draft tree per slot, lossless acceptance, KV compaction."""
  model = nnx.merge(graphdef, params)
  b, t = tree.tokens_BxT.shape
  n = t + 1
  tokens_BxN = jnp.concatenate([state.root_B[:, None], tree.tokens_BxT], axis=1)
  depth_BxN = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depth_BxT], axis=1)
  positions_BxN = state.length_B[:, None] + depth_BxN
  out = model(tokens_BxN, positions_BxN, cache=state.cache, cache_len_B=state.length_B,
              mask_BxTxT=tree.mask_BxNxN)
  # Node i samples the token at position (its position + 1).
  keys = sampling.sample_keys(seed, jnp.repeat(state.request_B, n), (positions_BxN + 1).reshape(-1))
  rep = lambda x: jnp.repeat(x, n)
  sampled, logp = sampling.sample(out.logits_BxTxV.reshape(b * n, -1), keys,
                                  rep(state.temperature_B), rep(state.top_p_B),
                                  rep(state.top_k_B), filters)
  sampled_BxN, logp_BxN = sampled.reshape(b, n), logp.reshape(b, n)
  if t == 0:  # plain decoding: the root's sample is the one emitted token
    num_acc_B = jnp.zeros((b,), jnp.int32)
    emitted_BxN, emitted_logp_BxN, cache = sampled_BxN, logp_BxN, out.cache
  else:
    acc = accept.accept_walk(sampled_BxN, tree.tokens_BxT, tree.parents_BxT, tree.valid_BxT)
    nodes_BxN = accept.emitted_nodes(acc)
    emitted_BxN = jnp.take_along_axis(sampled_BxN, nodes_BxN, axis=1)
    emitted_logp_BxN = jnp.take_along_axis(logp_BxN, nodes_BxN, axis=1)
    num_acc_B = acc.num_accepted_B
    cache = kv_cache.compact_accepted(out.cache, state.length_B, acc.path_BxT, num_acc_B)
  num_B = num_acc_B + 1
  new_root_B = jnp.take_along_axis(emitted_BxN, num_acc_B[:, None], axis=1)[:, 0]
  new_state = state.replace(cache=cache, length_B=state.length_B + num_B, root_B=new_root_B)
  return new_state, StepOutput(emitted_BxN, emitted_logp_BxN, num_B)


def prefill_chunk(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, slot: jax.Array,
                  tokens_C: jax.Array, start: jax.Array) -> KVCache:
  """Writes the KV of one prompt chunk at `[start, start + C)` of one slot.

  Padding past the prompt writes entries beyond the slot's length, which are never seen.
  """
  model = nnx.merge(graphdef, params)
  c = tokens_C.shape[0]
  one = kv_cache.read_slot(cache, slot)
  positions = (start + jnp.arange(c))[None, :]
  out = model(tokens_C[None, :], positions, cache=one, cache_len_B=start[None])
  return kv_cache.write_slot(cache, slot, out.cache)


def load_slots(state: DecodeState, new_B: jax.Array, length_B: jax.Array, root_B: jax.Array,
               request_B: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
               top_k_B: jax.Array) -> DecodeState:
  """Points the slots where `new_B` is set at freshly prefilled requests (others unchanged)."""
  pick = lambda fresh, old: jnp.where(new_B, fresh, old)
  return state.replace(
      length_B=pick(length_B, state.length_B), root_B=pick(root_B, state.root_B),
      request_B=pick(request_B, state.request_B),
      temperature_B=pick(temperature_B, state.temperature_B),
      top_p_B=pick(top_p_B, state.top_p_B), top_k_B=pick(top_k_B, state.top_k_B))


def regroup(state: DecodeState, slots_B: jax.Array) -> DecodeState:
  """A new state whose rows are `slots_B` of the old one (bucket change; B may differ)."""
  take = lambda x: x[slots_B]
  return DecodeState(kv_cache.gather_slots(state.cache, slots_B), take(state.length_B),
                     take(state.root_B), take(state.request_B), take(state.temperature_B),
                     take(state.top_p_B), take(state.top_k_B))
