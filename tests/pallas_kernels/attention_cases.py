"""Random inputs for the ATTENTION CONTRACT: ragged rows, draft trees, NaN past live lengths."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  q_PxNxH: jnp.ndarray
  k_BxSxKxH: jnp.ndarray
  v_BxSxKxH: jnp.ndarray
  kv_len_B: jnp.ndarray
  q_start_B: jnp.ndarray
  q_len_B: jnp.ndarray
  mask_PxW: jnp.ndarray

  @property
  def args(self):
    return (self.q_PxNxH, self.k_BxSxKxH, self.v_BxSxKxH, self.kv_len_B, self.q_start_B,
            self.q_len_B, self.mask_PxW)


def tree_masks(parents_T: np.ndarray, num_words: int) -> np.ndarray:
  """uint32[T, W] ancestor-or-self bits of a tree given parents (-1 = child of the root)."""
  num_nodes = len(parents_T)
  bits_TxT = np.zeros((num_nodes, 32 * num_words), bool)
  for i, parent in enumerate(parents_T):
    if parent >= 0:
      bits_TxT[i] = bits_TxT[parent]
    bits_TxT[i, i] = True
  weights = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint64)
  words = bits_TxT.reshape(num_nodes, num_words, 32).astype(np.uint64) @ weights
  return words.astype(np.uint32)


def random_parents(rng: np.random.Generator, num_nodes: int, shape: str) -> np.ndarray:
  """Parents of a 'chain' (each node the child of the previous), 'bushy' or 'random' tree."""
  if shape == "chain":
    return np.arange(num_nodes) - 1
  if shape == "bushy":  # root's child 0, then wide fan-outs near the top
    return np.array([-1] + [int(rng.integers(0, max(1, min(i, 3)))) for i in range(1, num_nodes)])[
        :num_nodes]
  return np.array([int(rng.integers(-1, i)) for i in range(num_nodes)])


def make_case(seed: int, *, q_lens, kv_lens, cache_len: int, num_kv_heads: int, group: int,
              head_dim: int, num_words: int = 1, dtype=jnp.float32, tree: str = "random",
              gap: int = 0, tail_pad: int = 0, garbage: float = np.nan) -> Case:
  """Rows with the given q/kv lengths; `gap` padding tokens between rows, `tail_pad` at the end.

  Cache positions past kv_len + q_len of each row are filled with `garbage` (NaN by default), and
  so is everything of padding query tokens.
  """
  rng = np.random.default_rng(seed)
  q_lens = np.asarray(q_lens, np.int32)
  kv_lens = np.asarray(kv_lens, np.int32)
  batch = len(q_lens)
  assert np.all(kv_lens + q_lens <= cache_len) and np.all(q_lens <= 32 * num_words)
  q_start = np.zeros(batch, np.int32)
  pos = 0
  for b in range(batch):
    q_start[b] = pos
    pos += q_lens[b] + gap
  num_tokens = max(1, pos + tail_pad)
  num_heads = num_kv_heads * group

  q = np.full((num_tokens, num_heads, head_dim), garbage, np.float32)
  mask = np.full((num_tokens, num_words), 0xFFFFFFFF, np.uint32)  # padding: junk bits
  k = rng.standard_normal((batch, cache_len, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((batch, cache_len, num_kv_heads, head_dim)).astype(np.float32)
  for b in range(batch):
    k[b, kv_lens[b] + q_lens[b]:] = garbage
    v[b, kv_lens[b] + q_lens[b]:] = garbage
    n = q_lens[b]
    q[q_start[b]:q_start[b] + n] = rng.standard_normal((n, num_heads, head_dim))
    mask[q_start[b]:q_start[b] + n] = tree_masks(random_parents(rng, n, tree), num_words)
  return Case(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
              jnp.asarray(kv_lens), jnp.asarray(q_start), jnp.asarray(q_lens), jnp.asarray(mask))
