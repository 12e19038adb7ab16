"""One process per host: host-local rollout meshes, policy replicas and host data exchange.

How a run spans several hosts (issue 14). Training is one global SPMD program: the learner's
parameters and optimiser state live on the global ('data', 'fsdp', 'tensor') mesh, each process
turns its own rows into global arrays (`parallel.shard_batch`) and every update is the same
compiled program on every process. Rollout is not: each process runs its own `RolloutEngine`
on a *host-local* mesh over its addressable devices, with a replica of the policy taken from
the training mesh after each update (`HostPolicy.replica`). No collective crosses hosts while
decoding, so each host's queue alone decides its buckets, draft budgets and number of steps,
and hosts whose responses differ in length simply finish at different times. They meet again
at the step boundary: the replica transfer, the exchange of what each host sampled
(`allgather_json`) and the update.

Why host-local rollout (option (a) of the issue) and not a global SPMD rollout that agrees on
every shape (option (b)): the engine decides shapes every step from its own queue (bucket
shrinking, the cost model's draft budget, pipelined plain steps read a step late); making each
of those decisions a cross-host agreement would put a host round-trip in the hot loop or force
k-step device loops the engine does not have, and any decision missed hangs a TPU pod instead
of failing. Host-local engines keep the engine a single-process program, unchanged, and the
price is small: one resharding of the parameters per step (an all-gather across hosts of
what each host does not hold, the same traffic an FSDP forward pays) and a policy replica per
host (sharded over the host's own devices). The limit: the policy must fit on one host's
devices, true of the models this stack targets (7B bf16 on a v5p host of 4 x 95 GB).

Sampling stays exact: keys are functions of (seed, request id, position) and request ids are
offset by process (`rl.rollouts.request_base`), so hosts never share noise and a multi-host
run samples what a one-host run with the same global batch would.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

HOSTS = "hosts"  # the leading axis of `hosts_mesh`: one entry per process


def _block(mesh: Mesh, process: int) -> np.ndarray | None:
  """`process`'s devices as a sub-block of the mesh's device array, or None when they do not
  form one (then `_flat_block` is used for every process)."""
  mine = np.vectorize(lambda d: d.process_index == process)(mesh.devices)
  where = np.argwhere(mine)
  lo, hi = where.min(0), where.max(0) + 1
  block = mesh.devices[tuple(slice(a, b) for a, b in zip(lo, hi))]
  return block if block.size == len(where) else None


def _flat_block(mesh: Mesh, process: int) -> np.ndarray:
  """`process`'s devices in mesh order as a (1, n / tensor, tensor) block; tensor groups stay
  together (`parallel.check_process_rows` keeps the tensor axis within a process)."""
  devices = [d for d in mesh.devices.flat if d.process_index == process]
  tensor = dict(mesh.shape).get("tensor", 1)
  tensor = tensor if len(devices) % tensor == 0 else 1
  return np.array(devices).reshape(1, len(devices) // tensor, tensor)


def _blocks(mesh: Mesh) -> list[np.ndarray]:
  """Every process's block, all of one shape."""
  n = jax.process_count()
  blocks = [_block(mesh, p) for p in range(n)]
  if any(b is None for b in blocks) or len({b.shape for b in blocks}) > 1:
    blocks = [_flat_block(mesh, p) for p in range(n)]
  return blocks


def host_local_mesh(mesh: Mesh) -> Mesh:
  """This process's part of the training mesh, same axis names: where its rollout runs."""
  if jax.process_count() == 1:
    return mesh
  return Mesh(_blocks(mesh)[jax.process_index()], mesh.axis_names)


def hosts_mesh(mesh: Mesh) -> Mesh:
  """The training mesh's devices as (hosts, *local axes): a spec over the local axes is one
  copy per process, laid out within each process as on its host-local mesh."""
  return Mesh(np.stack(_blocks(mesh)), (HOSTS,) + tuple(mesh.axis_names))


class HostPolicy:
  """Hands the rollout engine the policy on this host's devices.

  `local_shardings` is the parameter tree's shardings on `host_local_mesh(mesh)` (the model's
  partition rules fitted to the host; its leaves, in order, match the parameters' leaves).
  With one process the engine shares the learner's arrays (no copy); with several, `replica`
  reshards the global parameters to one copy per host (a collective every process runs at the
  same point) and wraps this process's copy as arrays of its host-local mesh.
  """

  def __init__(self, mesh: Mesh, local_shardings: Any):
    self.mesh = mesh
    self.local_mesh = host_local_mesh(mesh)
    self._local = jax.tree.leaves(local_shardings,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    self._multi = jax.process_count() > 1
    if self._multi:
      hm = hosts_mesh(mesh)
      self._hosts = [NamedSharding(hm, s.spec) for s in self._local]

  def replica(self, params: Any) -> Any:
    """The parameters (global arrays on the training mesh) as this host's replica."""
    if not self._multi:
      return params
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(self._local):
      raise ValueError(f"HostPolicy: {len(leaves)} parameters, {len(self._local)} shardings")
    moved = jax.device_put(leaves, self._hosts)
    return jax.tree.unflatten(treedef, [
        jax.make_array_from_single_device_arrays(
            x.shape, s, [shard.data for shard in x.addressable_shards])
        for x, s in zip(moved, self._local)])


# ----------------------------------------------------------------------------- host exchange


def _pow2(n: int, smallest: int = 256) -> int:
  return max(smallest, 1 << max(n - 1, 0).bit_length())


def allgather_json(value: Any) -> list[Any]:
  """Every process's `value` (JSON-able), in process order, on every process; a collective.

  Sent as UTF-8 JSON padded to a power of two, so the few gather shapes compile once; floats
  round-trip exactly. With one process: `[value]`, nothing copied.
  """
  n = jax.process_count()
  if n == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(n)
  padded = np.zeros(_pow2(int(sizes.max())), np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(gathered[p, :sizes[p]].tobytes()) for p in range(n)]


def max_over_processes(value: int) -> int:
  """The largest `value` any process has (a collective; the value itself with one process)."""
  return max(int(v) for v in allgather_json(int(value)))


def any_process(flag: bool) -> bool:
  """Whether any process has `flag` set (a collective)."""
  return any(allgather_json(bool(flag)))


def check_agree(values: dict[str, Any], what: str = "--{}: processes of one run must pass the "
                "same value") -> None:
  """Raises ValueError naming the first of `values` ({flag: this process's value}, JSON-able)
  that differs between processes (a collective; nothing to compare with one process).

  For settings a run may change when it resumes but every process must share: they decide
  which collectives a step enters (an evaluation, a checkpoint's gather, --balance_hosts'
  exchange per round) and how the prompt stream is split, so processes launched with
  different values would hang in different collectives or read other hosts' data. `what`
  words the error for a key (other than flags: fingerprints of the config or the data)."""
  gathered = allgather_json(values)
  for flag in values:
    seen = [g[flag] for g in gathered]
    if any(v != seen[0] for v in seen):
      differ = ", ".join(f"process {p}: {v!r}" for p, v in enumerate(seen))
      raise ValueError(f"{what.format(flag)} ({differ})")
