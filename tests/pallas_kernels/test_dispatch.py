"""impl selection, logged fallbacks and one-line shape errors of the dispatch."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import make_case
from pallas_kernels import reference
from pallas_kernels import tree_attention as dispatch


def _case(cache_len=32, head_dim=16, dtype=jnp.float32):
  return make_case(3, q_lens=[2, 3], kv_lens=[4, 9], cache_len=cache_len, num_kv_heads=1,
                   group=2, head_dim=head_dim, dtype=dtype)


def test_auto_on_cpu_is_the_reference():
  assert dispatch.resolve_impl("auto") == "reference"
  case = _case()
  np.testing.assert_array_equal(dispatch.tree_attention(*case.args),
                                reference.tree_attention(*case.args))


@pytest.mark.parametrize("impl,case_kwargs,reason", [
    ("tpu", dict(cache_len=36), "cache length S=36"),
    ("gpu", dict(head_dim=24, cache_len=32), "head dim H=24"),
    ("gpu", dict(cache_len=40), "cache length S=40"),
    ("tpu", dict(dtype=jnp.float16), "float16"),
])
def test_unsupported_shapes_fall_back_with_reason(impl, case_kwargs, reason, caplog):
  case = _case(**case_kwargs)
  with caplog.at_level(logging.WARNING, logger="pallas_kernels.tree_attention"):
    dispatch._logged_reasons.clear()
    out = dispatch.tree_attention(*case.args, impl=impl, interpret=True)
  assert reason in caplog.text and "falls back to the reference" in caplog.text
  np.testing.assert_array_equal(out, reference.tree_attention(*case.args))


def test_bad_impl_and_bad_shapes_name_the_culprit():
  case = _case()
  with pytest.raises(ValueError, match="impl='cuda'"):
    dispatch.tree_attention(*case.args, impl="cuda")
  args = list(case.args)
  args[5] = args[5][:1]
  with pytest.raises(ValueError, match="q_len_B"):
    dispatch.tree_attention(*args)
  args = list(case.args)
  args[6] = args[6][1:]
  with pytest.raises(ValueError, match="mask_PxW"):
    dispatch.tree_attention(*args)


@pytest.mark.parametrize("backend,expected", [("tpu", "tpu"), ("gpu", "gpu"), ("cpu", "reference")])
def test_auto_picks_by_backend(backend, expected, monkeypatch):
  monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
  assert dispatch.resolve_impl("auto") == expected
  assert dispatch.resolve_impl("reference") == "reference"
