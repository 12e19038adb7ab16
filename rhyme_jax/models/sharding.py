"""Parameter partition rules of the models and sharded model creation.

Parameters get their `PartitionSpec` from an ordered list of (regex, spec) rules matched
against the parameter's path written with slashes (`layers/3/attn/q_proj/kernel`); the first
rule that matches wins and a parameter no rule matches is an error naming its path. Specs are
then fitted to the mesh (`rhyme_jax.parallel.fit_spec`: a dimension the mesh cannot split
evenly is replicated), so SmolLM2's 9 heads / 3 KV heads and tiny test configs still run. With
a `ModelConfig` the fit is head-aware: attention projections are split over `tensor` only when
the head count is divisible by it, so no head is cut in two.

The rules work on anything shaped like the model's state: an `nnx.State` of arrays or of
`jax.ShapeDtypeStruct`s (from `nnx.eval_shape`), or nested / flat dicts of numpy arrays as a
checkpoint loader holds them.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rhyme_jax.models.attention import KVCache
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import Transformer
from rhyme_jax.parallel import BATCH, fit_spec, path_str

# Ordered (regex over the slash path, spec). Kernels are stored [in, out].
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed/embedding$", P("tensor", "fsdp")),  # [V, D]
    (r"(^|/)attn/(q|k|v)_proj/kernel$", P("fsdp", "tensor")),  # [D, N*H] (q) or [D, K*H] (k, v)
    (r"(^|/)attn/(q|k|v)_proj/bias$", P("tensor")),  # [N*H] or [K*H]
    (r"(^|/)attn/o_proj/kernel$", P("tensor", "fsdp")),  # [N*H, D]
    (r"(^|/)mlp/(gate|up)_proj/kernel$", P("fsdp", "tensor")),  # [D, F]
    (r"(^|/)mlp/down_proj/kernel$", P("tensor", "fsdp")),  # [F, D]
    (r"(^|/)lm_head/kernel$", P("fsdp", "tensor")),  # [D, V]
    (r"(^|/)(input_norm|post_attn_norm|final_norm|q_norm|k_norm)/scale$", P()),
    (r"(^|/)attn/inv_freq$", P()),  # RoPE constant carried in the module state
)

# Head-aware fitting: (regex, dim, ModelConfig field giving the number of heads in that dim).
_HEAD_DIMS: tuple[tuple[str, int, str], ...] = (
    (r"attn/q_proj/kernel$", 1, "num_heads"),
    (r"attn/q_proj/bias$", 0, "num_heads"),
    (r"attn/(k|v)_proj/kernel$", 1, "num_kv_heads"),
    (r"attn/(k|v)_proj/bias$", 0, "num_kv_heads"),
    (r"attn/o_proj/kernel$", 0, "num_heads"),
)



def spec_for(path: str, shape: Sequence[int], mesh=None, cfg: ModelConfig | None = None,
             rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
  """The spec of one parameter: the first matching rule, fitted to `mesh` when given."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      break
  else:
    raise ValueError(f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); "
                     f"add one to rhyme_jax.models.sharding.PARAM_RULES")
  if mesh is None:
    return spec
  units = {}
  if cfg is not None:
    for pattern, dim, field in _HEAD_DIMS:
      if re.search(pattern, path):
        units[dim] = getattr(cfg, field)
  return fit_spec(spec, shape, mesh, units)


def _is_leaf(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def param_specs(state: Any, mesh=None, cfg: ModelConfig | None = None,
                rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """A pytree of `PartitionSpec` shaped like `state` (an `nnx.State`, or dicts of arrays).

  Leaves may be jax/numpy arrays or `ShapeDtypeStruct`s. With `mesh` (a `Mesh` or
  `AbstractMesh`) each spec is fitted to it (non-divisible dims replicated; head-aware with
  `cfg`); without, the raw rule spec is returned. Raises naming the path of any parameter
  that no rule matches.
  """
  return jax.tree_util.tree_map_with_path(
      lambda p, x: spec_for(path_str(p), x.shape, mesh, cfg, rules), state, is_leaf=_is_leaf)


def param_shardings(state: Any, mesh: Mesh, cfg: ModelConfig | None = None,
                    rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """A pytree of `NamedSharding` shaped like `state`: the target of `jax.device_put` / jit."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(state, mesh, cfg, rules),
                      is_leaf=lambda x: isinstance(x, P))


def kv_cache_spec(cfg: ModelConfig, mesh, batch: int | None = None) -> P:
  """L×B×S×K×H cache: rows over data+fsdp (when `batch` divides), KV heads over `tensor`
  when `num_kv_heads` divides. Without `batch` the rows are assumed divisible."""
  rows = batch if batch is not None else math.prod(dict(mesh.shape).get(a, 1) for a in BATCH)
  shape = (cfg.num_layers, rows, 1, cfg.num_kv_heads, cfg.head_dim)
  return fit_spec(P(None, BATCH, None, "tensor", None), shape, mesh)


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh, batch: int | None = None):
  """A `KVCache` whose two fields are `NamedSharding`s: pass it to `jax.device_put` or jit."""
  sh = NamedSharding(mesh, kv_cache_spec(cfg, mesh, batch))
  return KVCache(sh, sh)


# ----------------------------------------------------------------------------- models


def create_sharded_model(cfg: ModelConfig, mesh: Mesh, seed: int = 0):
  """A randomly initialised `Transformer` whose parameters are created already sharded.

  The model is traced abstractly (`nnx.eval_shape`) to get its state's shapes, then the init
  runs under `jax.jit` with `out_shardings`, so each device materialises only its shards and
  no full copy of the weights ever lands on one device. The values equal `init_model(cfg, seed)`'s
  up to float rounding (jit vs eager initialisers, ~1e-8).
  Returns a `rhyme_jax.models.transformer.Transformer`.
  """
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = param_shardings(abstract_state, mesh, cfg)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

  return nnx.merge(graphdef, init())


def shard_model(model, mesh: Mesh):
  """Moves an existing (host / single-device) model's state onto the mesh, in place.

  Each array is `device_put` with its rule's sharding; the model is returned for chaining.
  """
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, param_shardings(state, mesh, model.cfg)))
  return model
