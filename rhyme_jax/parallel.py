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
import urllib.request
from typing import Any, Callable, Mapping, Sequence

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


_GCE_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


def cloud_tpu_workers(env: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> int:
  """Workers of the Cloud TPU slice this VM is one of (0 where this is no TPU VM).

  A TPU VM started over ssh (`gcloud ... ssh --worker=all`, launch/run.sh) has no launcher
  variables in its environment: its slice's workers are in the GCE metadata server
  (`worker-network-endpoints`, what JAX's own cluster detection reads). Asked only where TPU
  chips sit on this machine's PCI bus, so no other machine makes a request; an unanswered
  request counts as one worker.
  """
  env = os.environ if env is None else env
  if env.get("TPU_SKIP_MDS_QUERY") is not None:
    return 0
  try:
    from jax._src import hardware_utils  # what JAX's TPU start-up counts chips with
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  except Exception:  # a JAX without it: no detection, as before
    return 0
  if not chips:
    return 0
  request = urllib.request.Request(_GCE_METADATA + "worker-network-endpoints",
                                   headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
      endpoints = response.read().decode()
  except (OSError, ValueError):
    return 1
  return max(1, len([w for w in endpoints.split(",") if w.strip()]))


def _launcher(env: Mapping[str, str], tpu_workers: Callable[[], int]) -> str | None:
  """The launcher that started several processes and tells each its place, if any."""
  if env.get("MEGASCALE_COORDINATOR_ADDRESS") or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    return "TPU pod slice"  # TPU_WORKER_HOSTNAMES is set on every worker of a multi-host slice
  for key, name in (("SLURM_NTASKS", "SLURM"), ("OMPI_COMM_WORLD_SIZE", "Open MPI")):
    if env.get(key, "1").isdigit() and int(env.get(key, "1")) > 1:
      return name
  if tpu_workers() > 1:  # a worker of a multi-host Cloud TPU slice started over ssh
    return "TPU pod slice"
  return None


def distributed_settings(coordinator_address: str = "", num_processes: int = 0,
                         process_id: int = -1, env: Mapping[str, str] | None = None,
                         tpu_workers: Callable[[], int] | None = None
                         ) -> dict[str, Any] | None:
  """`jax.distributed.initialize` arguments from the flags and the launcher's environment.

  None: a single process. `{}`: the launcher (TPU pod slice, SLURM, Open MPI) tells JAX
  everything. Otherwise the coordinator (`--coordinator_address`, else
  `JAX_COORDINATOR_ADDRESS`) with the process count and id, which only the flags (or SLURM /
  Open MPI) can give. Raises ValueError, one line naming the flag or variable, when they do not
  add up (e.g. `JAX_COORDINATOR_ADDRESS` set and no process count, which JAX itself reports
  as a bare "Number of processes must be defined").
  """
  env = os.environ if env is None else env
  launcher = _launcher(env, tpu_workers or (lambda: cloud_tpu_workers(env)))
  count = num_processes if num_processes > 0 else None
  index = process_id if process_id >= 0 else None
  address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
  source = (f"--coordinator_address={coordinator_address}" if coordinator_address
            else f"JAX_COORDINATOR_ADDRESS={address}")
  if address:
    if count is None and launcher not in ("SLURM", "Open MPI"):
      raise ValueError(f"{source} is set but the process count is not: pass --num_processes=N "
                       "and --process_id=I to every process (or unset it for one process)")
    if count is not None and index is None:
      raise ValueError(f"{source} --num_processes={count}: pass --process_id=I (0 <= I < "
                       f"{count}) too")
    return {k: v for k, v in (("coordinator_address", address), ("num_processes", count),
                              ("process_id", index)) if v is not None}
  if count is not None:
    if count == 1 and index in (None, 0) and launcher is None:
      return None  # explicitly one process
    if launcher == "TPU pod slice":
      return {"num_processes": count, "process_id": index}
    raise ValueError(f"--num_processes={count}: needs --coordinator_address=HOST:PORT (process "
                     "0's address, the same on every process)")
  return {} if launcher else None


def maybe_initialize_distributed(coordinator_address: str = "", num_processes: int = 0,
                                 process_id: int = -1, *, force: bool | None = None,
                                 env: Mapping[str, str] | None = None) -> bool:
  """Calls `jax.distributed.initialize` when this is one process of several.

  Settings come from `distributed_settings` (the flags, then the launcher's environment);
  `force=True` initialises even for what looks like one process (jax then auto-detects),
  `force=False` never does. Must run before anything touches a device. Returns whether it
  initialised. CPU processes exchange collectives through gloo (jax's default on CPU).
  """
  if force is False:
    return False
  settings = distributed_settings(coordinator_address, num_processes, process_id, env)
  if settings is None and not force:
    return False
  if jax.distributed.is_initialized():
    return False
  jax.distributed.initialize(**(settings or {}))
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
  """This process's rows of a batch (a pytree of arrays) -> global arrays on the mesh, rows split
  over ('data', 'fsdp').

  With several processes every process passes its own rows (the same count on each) and the
  global array holds all of them (`jax.make_array_from_process_local_data`); `host_rows` gives
  a process its rows of a result back. With one process the local batch is the global one, and
  rows not divisible by data*fsdp are replicated instead; with several that is an error (rows
  cannot be replicated across processes that hold different ones). 0-d arrays are replicated
  and must be equal on every process.
  """
  n = jax.process_count()

  def put(a):
    a = np.asarray(a)
    if not a.ndim:
      return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), a, a.shape)
    shape = (a.shape[0] * n,) + a.shape[1:]
    spec = fit_spec(batch_spec(a.ndim), shape, mesh)
    if n > 1 and spec[0] is None:
      sizes = _mesh_sizes(mesh)
      raise ValueError(f"a batch of {shape[0]} rows ({a.shape[0]} per process) cannot be split "
                       f"over data*fsdp = {sizes.get('data', 1) * sizes.get('fsdp', 1)} devices")
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a, shape)
  return jax.tree.map(put, x)


def host_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a global batch array, in the order `shard_batch` took them."""
  if x.is_fully_addressable:
    return np.asarray(x)
  pieces = {}
  for shard in x.addressable_shards:
    start = (shard.index[0].start or 0) if shard.index else 0
    pieces.setdefault(start, shard.data)
  return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)])


def check_process_rows(mesh: Mesh) -> None:
  """Each process must hold its own batch rows: the batch axes split the processes apart and
  no axis the rows are replicated over (tensor) may span two processes. ValueError if not."""
  n = jax.process_count()
  if n == 1:
    return
  sizes = _mesh_sizes(mesh)
  owners: dict[int, set[int]] = {}
  names = mesh.axis_names
  for coords in np.ndindex(mesh.devices.shape):
    where = dict(zip(names, coords))
    row_block = where.get("data", 0) * sizes.get("fsdp", 1) + where.get("fsdp", 0)
    owners.setdefault(row_block, set()).add(mesh.devices[coords].process_index)
  shared = sorted(b for b, procs in owners.items() if len(procs) > 1)
  if shared:
    raise ValueError(f"mesh {sizes} over {n} processes: the tensor axis spans processes, so "
                     "they would share batch rows; keep --mesh_tensor within one process's "
                     f"{jax.local_device_count()} devices")


