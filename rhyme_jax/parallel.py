"""Device mesh, multi-host start-up and batch placement: the bottom of the import graph.

One mesh with three named axes serves every step of the stack:

- `data`:   pure data parallelism (batch rows split, parameters replicated along it);
- `fsdp`:   batch rows split *and* parameters sharded along it (ZeRO-3 style: XLA all-gathers
            a layer's weights just before it is used);
- `tensor`: Megatron-style model parallelism inside a layer (attention heads, MLP columns,
            vocabulary).

This module knows nothing about models: the parameter partition rules live next to the
models (`rhyme_jax.models.sharding`) and build on `fit_spec` / `path_str` from here. A spec is
fitted to the actual mesh by replicating any dimension the mesh cannot split evenly (see
`fit_spec`), so odd shapes still run, only with less sharding.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # batch rows are split over both data-parallel axes

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


# ----------------------------------------------------------------------------- spec helpers


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


# ----------------------------------------------------------------------------- activations


def batch_spec(rank: int = 2) -> P:
  """Rows over ('data', 'fsdp'), everything else replicated: tokens, positions, masks."""
  return P(BATCH, *([None] * (rank - 1)))


def shard_batch(x: Any, mesh: Mesh) -> Any:
  """Puts each array of `x` (a pytree) on the mesh, rows split over ('data', 'fsdp').

  An array whose leading dimension is not divisible by data*fsdp is replicated instead.
  """
  def put(a):
    spec = fit_spec(batch_spec(np.ndim(a)), np.shape(a), mesh) if np.ndim(a) else P()
    return jax.device_put(a, NamedSharding(mesh, spec))
  return jax.tree.map(put, x)


