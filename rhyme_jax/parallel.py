"""Device mesh, partition rules and multi-host start-up: how one SPMD program spreads over devices.

One mesh with three named axes serves every step of the stack:

- `data`:   pure data parallelism (batch rows split, parameters replicated along it);
- `fsdp`:   batch rows split *and* parameters sharded along it (ZeRO-3 style: XLA all-gathers
            a layer's weights just before it is used);
- `tensor`: Megatron-style model parallelism inside a layer (attention heads, MLP columns,
            vocabulary).

Parameters get their `PartitionSpec` from an ordered list of (regex, spec) rules matched
against the parameter's path written with slashes (`layers/3/attn/q_proj/kernel`); the first
rule that matches wins and a parameter no rule matches is an error naming its path. Specs are
then fitted to the actual mesh: any dimension whose size is not divisible by the mesh axes it
would be split over is replicated instead (see `fit_spec`), so odd shapes (SmolLM2's 9 heads /
3 KV heads, tiny test configs) still run, only with less sharding. With a `ModelConfig` the
fit is head-aware: attention projections are split over `tensor` only when the head count is
divisible by it, so no head is cut in two.

The rules work on anything shaped like the model's state: an `nnx.State` of arrays or of
`jax.ShapeDtypeStruct`s (from `nnx.eval_shape`), or nested / flat dicts of numpy arrays as a
checkpoint loader holds them.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rhyme_jax.models.config import ModelConfig

# The model modules are imported inside the two functions that build models / caches, so this
# module stays at the bottom of the import graph (loaders and the engine import it).

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # batch rows are split over both data-parallel axes

# Ordered (regex over the slash path, spec). Kernels are stored [in, out].
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed/embedding$", P("tensor", "fsdp")),  # [V, D]
    (r"(^|/)attn/(q|k|v)_proj/kernel$", P("fsdp", "tensor")),  # [D, heads*Dh]
    (r"(^|/)attn/(q|k|v)_proj/bias$", P("tensor")),  # [heads*Dh]
    (r"(^|/)attn/o_proj/kernel$", P("tensor", "fsdp")),  # [N*Dh, D]
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


# ----------------------------------------------------------------------------- mesh / init


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh; at most one size may be -1 ("all remaining devices")."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  flags = ", ".join(f"{k}={v}" for k, v in sizes.items())
  free = [k for k, v in sizes.items() if v == -1]
  bad = [k for k, v in sizes.items() if v != -1 and v < 1]
  if bad or len(free) > 1:
    raise ValueError(f"mesh flags {flags}: each size must be >= 1, or -1 for at most one axis")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if n % fixed:
      raise ValueError(f"mesh flags {flags}: {n} devices are not divisible by the fixed axes' "
                       f"product {fixed}")
    sizes[free[0]] = n // fixed
  if math.prod(sizes.values()) != n:
    raise ValueError(f"mesh flags {flags}: data*fsdp*tensor = {math.prod(sizes.values())} but "
                     f"there are {n} devices")
  shape = tuple(sizes[a] for a in AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


# Environment variables that mean "this process is one of several launched together".
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def _launched_multi_process(env: Mapping[str, str]) -> bool:
  if any(env.get(k) for k in _MULTI_PROCESS_ENV):
    return True
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")  # set on every worker of a multi-host TPU slice
  if "," in hosts:
    return True
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if env.get(key, "1").isdigit() and int(env.get(key, "1")) > 1:
      return True
  return False


def maybe_initialize_distributed(force: bool | None = None, **kwargs) -> bool:
  """Calls `jax.distributed.initialize(**kwargs)` when this is one process of several.

  Multi-process is detected from the launcher's environment (`JAX_COORDINATOR_ADDRESS`,
  several `TPU_WORKER_HOSTNAMES`, SLURM / Open MPI world size > 1); `force=True` initialises
  regardless (jax then auto-detects the cluster), `force=False` never does. A single process
  is a no-op. Must run before anything touches a device. Returns whether it initialised.
  """
  if force is False:
    return False
  if force is None and not _launched_multi_process(os.environ):
    return False
  if jax.distributed.is_initialized():
    return False
  jax.distributed.initialize(**kwargs)
  return True


# ----------------------------------------------------------------------------- param specs


def _key_str(k) -> str | None:
  if isinstance(k, jax.tree_util.DictKey):
    key = k.key
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
  if isinstance(k, jax.tree_util.SequenceKey):
    return str(k.idx)
  if isinstance(k, jax.tree_util.GetAttrKey):
    return None if k.name in ("value", "raw_value") else k.name  # step through nnx.Variable
  if isinstance(k, jax.tree_util.FlattenedIndexKey):
    return None
  return str(k)


def path_str(path) -> str:
  """`('layers', 3, 'attn', 'q_proj', 'kernel')`-like key path -> 'layers/3/attn/q_proj/kernel'."""
  return "/".join(s for s in map(_key_str, path) if s is not None)


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def fit_spec(spec: P, shape: Sequence[int], mesh, units: Mapping[int, int] | None = None) -> P:
  """Replicates every dimension of `spec` that the mesh cannot split evenly.

  A dimension of size d split over mesh axes of total size m keeps its sharding only when
  `units[dim] % m == 0`, where `units[dim]` defaults to d (e.g. the head count for a fused
  heads*head_dim dimension, so that heads are never cut). Axes missing from the mesh or of
  size 1 are dropped. The spec is padded with None to the array's rank.
  """
  sizes = _mesh_sizes(mesh)
  if len(spec) > len(shape):
    raise ValueError(f"PartitionSpec {spec} has more entries than the array's rank {len(shape)}")
  out = []
  for dim, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = tuple(a for a in _axes_of(entry) if sizes.get(a, 1) > 1)
    m = math.prod(sizes[a] for a in axes) if axes else 1
    unit = (units or {}).get(dim, shape[dim])
    if not axes or unit % m or shape[dim] % m:
      out.append(None)
    else:
      out.append(axes[0] if len(axes) == 1 else axes)
  return P(*out)


def spec_for(path: str, shape: Sequence[int], mesh=None, cfg: ModelConfig | None = None,
             rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
  """The spec of one parameter: the first matching rule, fitted to `mesh` when given."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      break
  else:
    raise ValueError(f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); "
                     f"add one to rhyme_jax.parallel.PARAM_RULES")
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


# ----------------------------------------------------------------------------- activations


def batch_spec(rank: int = 2) -> P:
  """Rows over ('data', 'fsdp'), everything else replicated: tokens, positions, masks."""
  return P(BATCH, *([None] * (rank - 1)))


def logits_spec() -> P:
  """B×T×V logits: rows over the data axes, vocabulary over `tensor` (as the lm head yields)."""
  return P(BATCH, None, "tensor")


def kv_cache_spec(cfg: ModelConfig, mesh, batch: int | None = None) -> P:
  """L×B×S×K×H cache: rows over data+fsdp (when `batch` divides), KV heads over `tensor`
  when `num_kv_heads` divides. Without `batch` the rows are assumed divisible."""
  rows = batch if batch is not None else math.prod(_mesh_sizes(mesh).get(a, 1) for a in BATCH)
  shape = (cfg.num_layers, rows, 1, cfg.num_kv_heads, cfg.head_dim)
  return fit_spec(P(None, BATCH, None, "tensor", None), shape, mesh)


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh, batch: int | None = None):
  """A `KVCache` whose two fields are `NamedSharding`s: pass it to `jax.device_put` or jit."""
  from rhyme_jax.models.attention import KVCache
  sh = NamedSharding(mesh, kv_cache_spec(cfg, mesh, batch))
  return KVCache(sh, sh)


def shard_batch(x: Any, mesh: Mesh) -> Any:
  """Puts each array of `x` (a pytree) on the mesh, rows split over ('data', 'fsdp').

  An array whose leading dimension is not divisible by data*fsdp is replicated instead.
  """
  def put(a):
    spec = fit_spec(batch_spec(np.ndim(a)), np.shape(a), mesh) if np.ndim(a) else P()
    return jax.device_put(a, NamedSharding(mesh, spec))
  return jax.tree.map(put, x)


# ----------------------------------------------------------------------------- models


def create_sharded_model(cfg: ModelConfig, mesh: Mesh, seed: int = 0):
  """A randomly initialised `Transformer` whose parameters are created already sharded.

  The model is traced abstractly (`nnx.eval_shape`) to get its state's shapes, then the init
  runs under `jax.jit` with `out_shardings`, so each device materialises only its shards and
  no full copy of the weights ever lands on one device. The values equal `init_model(cfg, seed)`'s
  up to float rounding (jit vs eager initialisers, ~1e-8).
  Returns a `rhyme_jax.models.transformer.Transformer`.
  """
  from rhyme_jax.models.transformer import Transformer
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
