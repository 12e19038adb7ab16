"""The decode state of B slots and the pure functions that advance it.

`verify_step` is the only decode step: it feeds the slots' roots and draft nodes packed on one
token axis (accept.PackedTrees; a plain step packs roots alone), samples every token with its
position-keyed key, accepts in closed form, compacts the accepted path's KV and returns the
emitted tokens. `prefill_chunk` writes one chunk of one slot's prompt. Both are pure functions
of (graphdef, params, state, inputs), jitted once per static shape by the engine.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rhyme_jax.models import attention
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
  tokens_BxT: jax.Array  # int32 emitted tokens (first num_emitted valid), T = max_q_len
  logprobs_BxT: jax.Array  # float32 their log-probabilities under the sampling distribution
  num_emitted_B: jax.Array  # int32 in [1, T] for rows with tokens, 0 for empty slots


def to_wire(out: StepOutput) -> jax.Array:
  """The three as one int32 array of shape (B, 2T + 1), [tokens | log-probs bit-cast | count]
  per row, so the host reads a step in one device-to-host copy (`from_wire`)."""
  return jnp.concatenate([out.tokens_BxT,
                          jax.lax.bitcast_convert_type(out.logprobs_BxT, jnp.int32),
                          out.num_emitted_B[:, None]], axis=1)


def from_wire(wire: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens_BxT, logprobs_BxT, num_emitted_B) of `to_wire`'s array on the host."""
  t = (wire.shape[1] - 1) // 2
  return wire[:, :t], wire[:, t:2 * t].view(np.float32), wire[:, 2 * t]


def verify_step(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState,
                trees: accept.PackedTrees, seed: jax.Array, *, filters: bool, max_kv_len: int,
                max_q_len: int, attention_impl: str = "xla") -> tuple[DecodeState, StepOutput]:
  """One forward over the packed roots and draft nodes, lossless acceptance, KV compaction.

  Static shape: B rows, P packed tokens (trees.tokens_P), at most `max_q_len` tokens per row,
  attention over the first `max_kv_len` cache positions (>= every row's length + q_len).
  `max_q_len == 1` is plain decoding (every row its root alone). `attention_impl` (static, one
  of models.attention.IMPLS) is the XLA path or a Pallas kernel.
  """
  model = nnx.merge(graphdef, params)
  b, p = state.batch, trees.tokens_P.shape[0]
  row_P, i_P, valid_P = attention.packed_rows(trees.q_start_B, trees.q_len_B, p)
  is_root_P = i_P == 0
  # A draft token outside the vocabulary (a drafter's garbage, `accept.NEVER`) is embedded as
  # one inside it, since an embedding lookup out of range gives NaN; matching reads the raw
  # token, which no sample equals, so such a node is never accepted.
  draft_P = jnp.clip(trees.tokens_P, 0, model.cfg.vocab_size - 1)
  tokens_P = jnp.where(is_root_P, state.root_B[row_P], draft_P)
  positions_P = state.length_B[row_P] + trees.depth_P
  pk = attention.Packed(state.length_B, trees.q_start_B, trees.q_len_B, trees.mask_PxW,
                        max_kv_len, max_q_len, attention_impl)
  logits_PxV, cache = model.decode_packed(tokens_P, positions_P, state.cache, pk)
  # A token samples the token at (its position + 1).
  keys = sampling.sample_keys(seed, state.request_B[row_P], positions_P + 1)
  sampled_P, logp_P = sampling.sample(logits_PxV, keys, state.temperature_B[row_P],
                                      state.top_p_B[row_P], state.top_k_B[row_P], filters)
  acc = accept.accept_packed(sampled_P, logp_P, trees, b, max_q_len)
  if max_q_len > 1:  # plain decoding has nothing to move
    cache = kv_cache.compact_accepted(cache, state.length_B, row_P, i_P, trees.depth_P,
                                      acc.on_path_P & ~is_root_P)
  live_B = trees.q_len_B > 0
  num_B = jnp.where(live_B, acc.num_accepted_B + 1, 0)
  last_B = jnp.take_along_axis(acc.emitted_BxT, acc.num_accepted_B[:, None], axis=1)[:, 0]
  new_state = state.replace(cache=cache, length_B=state.length_B + num_B,
                            root_B=jnp.where(live_B, last_B, state.root_B))
  return new_state, StepOutput(acc.emitted_BxT, acc.logprobs_BxT, num_B)


def plain_steps(one_step, state: DecodeState, steps: int) -> tuple[DecodeState, StepOutput]:
  """`steps` plain decode steps in one call: `one_step(state) -> (state, StepOutput)` (a
  `verify_step` over the roots alone, T = 1) scanned, its outputs laid side by side as one
  step's of T = `steps` (row b's tokens in order; every live row emits `steps`). Each step
  draws with its own position's key, so the tokens are those of `steps` separate calls; a row
  that ends inside the call keeps stepping, and the host drops what follows its end."""
  state, outs = jax.lax.scan(lambda s, _: one_step(s), state, None, length=steps)
  return state, StepOutput(outs.tokens_BxT[:, :, 0].T, outs.logprobs_BxT[:, :, 0].T,
                           outs.num_emitted_B.sum(axis=0))


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


# Rows of `load_slots`' integer argument (its float one holds temperature, then top-p).
LOAD_NEW, LOAD_LENGTH, LOAD_ROOT, LOAD_REQUEST, LOAD_TOP_K = range(5)


def load_slots(state: DecodeState, ints_5xB: jax.Array, floats_2xB: jax.Array) -> DecodeState:
  """Points the slots whose `ints_5xB[LOAD_NEW]` is set at freshly admitted requests (others
  unchanged): their cached length, root, request id and top-k (the LOAD_* rows), temperature
  and top-p (`floats_2xB`). Two arrays, so an admission crosses to the device in two transfers
  rather than seven."""
  new_B = ints_5xB[LOAD_NEW] != 0
  pick = lambda fresh, old: jnp.where(new_B, fresh, old)
  return state.replace(
      length_B=pick(ints_5xB[LOAD_LENGTH], state.length_B),
      root_B=pick(ints_5xB[LOAD_ROOT], state.root_B),
      request_B=pick(ints_5xB[LOAD_REQUEST], state.request_B),
      temperature_B=pick(floats_2xB[0], state.temperature_B),
      top_p_B=pick(floats_2xB[1], state.top_p_B), top_k_B=pick(ints_5xB[LOAD_TOP_K], state.top_k_B))


def park_resume_load(state: DecodeState, pool: KVCache, ints_N: jax.Array, floats_2xB: jax.Array
                     ) -> tuple[DecodeState, KVCache]:
  """A pass of divided rollout in one call: the KV rows of requests that yield their slots go
  into the park pool, parked rows come back into the slots of the requests that resume, and
  `load_slots` points the admitted slots at their requests. In that order, so a slot a request
  leaves is saved before another request's row is written into it. One dispatch and two
  transfers, as slot loading alone makes, where three calls made three dispatches and four
  transfers.

  `ints_N` is `pass_ints`' one int32 array: the parks' (pool row, slot) pairs as a 2 x W
  array, the resumes' (slot, pool row) pairs likewise, then load_slots' 5 x B (W static, a
  pass size; kv_cache.padded_pairs pads a pass by repeating a pair)."""
  b = state.batch
  w = (ints_N.shape[0] - 5 * b) // 4
  park_2xW, resume_2xW = ints_N[:2 * w].reshape(2, w), ints_N[2 * w:4 * w].reshape(2, w)
  pool = kv_cache.copy_rows(pool, state.cache, park_2xW)
  cache = kv_cache.copy_rows(state.cache, pool, resume_2xW)
  return load_slots(state.replace(cache=cache), ints_N[4 * w:].reshape(5, b), floats_2xB), pool


def pass_ints(park_2xW: np.ndarray, resume_2xW: np.ndarray, ints_5xB: np.ndarray) -> np.ndarray:
  """`park_resume_load`'s int32 argument (one host-to-device transfer)."""
  return np.concatenate([park_2xW.ravel(), resume_2xW.ravel(), ints_5xB.ravel()]).astype(
      np.int32)


def regroup(state: DecodeState, slots_B: jax.Array) -> DecodeState:
  """A new state whose rows are `slots_B` of the old one (bucket change; B may differ)."""
  take = lambda x: x[slots_B]
  return DecodeState(kv_cache.gather_slots(state.cache, slots_B), take(state.length_B),
                     take(state.root_B), take(state.request_B), take(state.temperature_B),
                     take(state.top_p_B), take(state.top_k_B))
