"""The dense reference against a per-token NumPy loop written straight from the contract."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import reference
from attention_cases import make_case


def contract_loop(case, sm_scale=None):
  """out[p] for every packed token p, one token and one head at a time."""
  q, k, v, kv_len, q_start, q_len, mask = (np.asarray(a) for a in case.args)
  num_tokens, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  out = np.zeros(q.shape, np.float64)
  for b in range(len(kv_len)):
    for i in range(q_len[b]):
      p = q_start[b] + i
      tree = [j for j in range(q_len[b]) if (int(mask[p, j // 32]) >> (j % 32)) & 1]
      positions = list(range(kv_len[b])) + [kv_len[b] + j for j in tree]
      for n in range(num_heads):
        keys = k[b, positions, n // group].astype(np.float64)
        logits = keys @ q[p, n].astype(np.float64) * scale
        weights = np.exp(logits - logits.max())
        out[p, n] = (weights / weights.sum()) @ v[b, positions, n // group].astype(np.float64)
  return out


@pytest.mark.parametrize("tree", ["chain", "bushy", "random"])
def test_reference_matches_contract_loop(tree):
  case = make_case(1, q_lens=[3, 0, 6, 1, 2], kv_lens=[0, 5, 9, 20, 21], cache_len=23,
                   num_kv_heads=2, group=3, head_dim=8, gap=1, tail_pad=3, tree=tree)
  out = np.asarray(reference.tree_attention(*case.args))
  assert not np.isnan(out).any()  # NaN garbage past live lengths and in padding stays out
  np.testing.assert_allclose(out, contract_loop(case), atol=1e-5)


def test_reference_sm_scale_and_two_mask_words():
  case = make_case(2, q_lens=[40, 33], kv_lens=[3, 0], cache_len=48, num_kv_heads=1, group=2,
                   head_dim=4, num_words=2)
  out = np.asarray(reference.tree_attention(*case.args, sm_scale=0.3))
  np.testing.assert_allclose(out, contract_loop(case, sm_scale=0.3), atol=1e-5)
