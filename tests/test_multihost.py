"""rhyme_jax.multihost and the multi-process half of rhyme_jax.parallel, with two real
`jax.distributed` processes on localhost (2 CPU devices each, gloo collectives).

The file re-runs itself as two child processes (`python tests/test_multihost.py --child I
PORT`); each checks from its side and prints a JSON report that the test compares:

* `shard_batch` turns each process's rows into one global batch (rows of process 0 then 1 on
  the FSDP mesh), a global computation sees all of them, `host_rows` gives each its own back;
  a mesh whose tensor axis spans the processes is refused (they would share rows);
* `host_local_mesh` is the process's block of the training mesh; `HostPolicy.replica` gives
  each process the full parameter values on its own devices, sharded by the local rules, and
  a computation on it runs on one process while the other does something else;
* `allgather_json` exchanges values of different sizes exactly, `any_process` and
  `max_over_processes` agree everywhere.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
from jax.sharding import PartitionSpec as P

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(index: int, port: int) -> dict:
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rhyme_jax import multihost, parallel
  assert parallel.maybe_initialize_distributed(f"localhost:{port}", 2, index, env={})
  report = {"process": jax.process_index(), "count": jax.process_count()}
  mesh = parallel.make_mesh(1, 4, 1)  # FSDP over both processes, like the v5p config

  # Per-process rows -> one global batch -> each process's rows back.
  rows = np.arange(6, dtype=np.float32).reshape(3, 2) + 100 * index
  rows = np.concatenate([rows, rows + 10])  # 6 rows: not a multiple of 4 on its own
  batch = parallel.shard_batch({"x": rows[:4]}, mesh)["x"]
  total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(batch)
  report["batch_shape"] = list(batch.shape)
  report["batch_sum"] = float(total)
  report["rows_back"] = parallel.host_rows(jax.jit(lambda a: a * 2)(batch)).tolist()
  try:
    parallel.shard_batch({"x": rows[:3]}, mesh)
  except ValueError as e:
    report["odd_rows"] = str(e)
  try:
    parallel.check_process_rows(parallel.make_mesh(1, 1, 4))
  except ValueError as e:
    report["tensor_across"] = str(e)
  parallel.check_process_rows(parallel.make_mesh(2, 1, 2))  # tensor within a process: fine

  # The policy replica: full values on this process's devices, local sharding.
  local = multihost.host_local_mesh(mesh)
  report["local_mesh"] = {k: int(v) for k, v in local.shape.items()}
  report["local_devices"] = sorted(d.process_index for d in local.devices.flat)
  w = jax.jit(lambda: jnp_arange(), out_shardings=NamedSharding(mesh, P("fsdp", None)))()
  b = jax.jit(lambda: jnp_arange()[0, 0] * 0 + 7, out_shardings=NamedSharding(mesh, P()))()
  params = {"w": w, "b": b}
  shardings = {"w": NamedSharding(local, P("fsdp", None)), "b": NamedSharding(local, P())}
  policy = multihost.HostPolicy(mesh, shardings)
  replica = policy.replica(params)
  report["replica_addressable"] = bool(replica["w"].is_fully_addressable)
  report["replica_spec"] = str(replica["w"].sharding.spec)
  report["replica_w"] = np.asarray(replica["w"]).tolist()
  report["replica_b"] = np.asarray(replica["b"]).tolist()
  # A host-local program, a different number of times per process: no cross-host lockstep.
  f = jax.jit(lambda a: (a @ a.T).sum())
  for _ in range(1 + 3 * index):
    value = f(replica["w"])
  report["local_compute"] = float(value)

  # Host exchange.
  mine = {"i": index, "text": "x" * (10 + 500 * index), "f": 0.1 + index / 3}
  report["gathered"] = multihost.allgather_json(mine)
  report["any"] = [multihost.any_process(index == 1), multihost.any_process(False)]
  report["max"] = multihost.max_over_processes(5 - index * 3)
  multihost.check_agree({"num_steps": 10, "run_dir": "runs/x"})  # the same everywhere: passes
  try:
    multihost.check_agree({"num_steps": 10, "balance_hosts": index == 1})
  except ValueError as e:
    report["disagree"] = str(e)
  return report


def jnp_arange():
  import jax.numpy as jnp
  return jnp.arange(32, dtype=jnp.float32).reshape(8, 4)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes():
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")]
                                                  if p]))
  procs = [subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  reports = [json.loads(next(l for l in out.splitlines() if l.startswith("REPORT "))[7:])
             for out, _ in outs]
  r0, r1 = reports
  assert (r0["process"], r1["process"], r0["count"]) == (0, 1, 2)

  rows = lambda i: np.concatenate([np.arange(6).reshape(3, 2) + 100 * i,
                                   np.arange(6).reshape(3, 2) + 100 * i + 10])[:4]
  everything = float(rows(0).sum() + rows(1).sum())
  for i, r in enumerate(reports):
    assert r["batch_shape"] == [8, 2] and r["batch_sum"] == everything
    assert r["rows_back"] == (rows(i) * 2).tolist()
    assert "a batch of 6 rows (3 per process) cannot be split over data*fsdp = 4" in r["odd_rows"]
    assert "the tensor axis spans processes" in r["tensor_across"]
    assert r["local_mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert r["local_devices"] == [i, i]
    assert r["replica_addressable"] and r["replica_spec"] == str(P("fsdp", None))
    assert r["replica_w"] == np.arange(32).reshape(8, 4).tolist() and r["replica_b"] == 7.0
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert r["local_compute"] == float((w @ w.T).sum())
    assert r["gathered"] == [{"i": 0, "text": "x" * 10, "f": 0.1},
                             {"i": 1, "text": "x" * 510, "f": 0.1 + 1 / 3}]
    assert r["any"] == [True, False] and r["max"] == 5
    # Every process names the same flag (each raises, none waits in a later collective).
    assert r["disagree"] == ("--balance_hosts: processes of one run must pass the same value "
                             "(process 0: False, process 1: True)")


def test_one_process_is_the_identity():
  import jax
  from rhyme_jax import multihost, parallel
  mesh = parallel.make_mesh()
  assert multihost.host_local_mesh(mesh) is mesh
  params = {"w": jax.numpy.ones(3)}
  policy = multihost.HostPolicy(mesh, {"w": jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec())})
  assert policy.replica(params) is params  # the engine shares the learner's arrays
  assert multihost.allgather_json({"a": [1]}) == [{"a": [1]}]
  assert multihost.any_process(True) and not multihost.any_process(False)
  assert multihost.max_over_processes(4) == 4
  multihost.check_agree({"balance_hosts": True})  # nothing to disagree with


if __name__ == "__main__" and sys.argv[1] == "--child":
  print("REPORT " + json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
