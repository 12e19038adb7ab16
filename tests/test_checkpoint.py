"""Tests for rhyme_jax.checkpoint: round trips, keep-last-N, atomicity, corrupt-checkpoint fallback."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rhyme_jax import checkpoint as ckpt

# Subprocesses run in the checkout, so they import this copy of the package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "embed": {"embedding": jax.random.normal(k1, (16, 8), jnp.float32)},
      "layers": [{"mlp": {"kernel": jax.random.normal(k2, (8, 8), jnp.bfloat16)}}],
  }


def _host_state(step):
  rng = np.random.default_rng(step)
  return {
      "step": step,
      "data": {"epoch": 2, "index": 17 * step, "order": (3, 1, 2)},
      "numpy_rng": rng.bit_generator.state,
      "seed": np.int64(1234),
      "history": {
          "tokens": np.arange(10 * step, dtype=np.int32).reshape(step, 10),
          "logps": np.full((3,), -0.5, np.float32),
          "empty": np.zeros((0, 4), np.int32),
          "jax_key": jax.random.key_data(jax.random.key(step)),
      },
      "note": None,
  }


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_params_adamw_and_host_state(tmp_path):
  params = _params()
  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  host = _host_state(3)

  with ckpt.RunCheckpointer(tmp_path, keep_last=2) as cp:
    assert cp.save(3, params=params, opt_state=opt_state, host_state=host)
    cp.wait()
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract_opt = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt_state)
    state = cp.restore(abstract_params=abstract_params,
                       abstract_opt_state=abstract_opt)

  assert state.step == 3
  _assert_tree_equal(state.params, params)
  _assert_tree_equal(state.opt_state, opt_state)
  assert type(state.opt_state[0]).__name__ == "ScaleByAdamState"
  assert int(state.opt_state[0].count) == 1
  # Host state: JSON parts exact; numpy parts exact incl. dtype; tuples -> lists.
  h = state.host_state
  assert h["step"] == 3 and h["note"] is None and h["seed"] == 1234
  assert h["data"] == {"epoch": 2, "index": 51, "order": [3, 1, 2]}
  assert h["numpy_rng"] == host["numpy_rng"]
  restored_rng = np.random.default_rng()
  restored_rng.bit_generator.state = h["numpy_rng"]
  np.testing.assert_array_equal(restored_rng.integers(0, 1 << 30, 5),
                                np.random.default_rng(3).integers(0, 1 << 30, 5))
  for key in ("tokens", "logps", "empty"):
    assert isinstance(h["history"][key], np.ndarray)
    assert h["history"][key].dtype == host["history"][key].dtype
    np.testing.assert_array_equal(h["history"][key], host["history"][key])
  np.testing.assert_array_equal(h["history"]["jax_key"],
                                np.asarray(host["history"]["jax_key"]))
  # The arrays live in a separate array item, not inside the JSON.
  host_json = (tmp_path / "checkpoints" / "3" / "host" / "metadata").read_text()
  assert '"__ndarray__"' in host_json and "arr_0" in host_json
  assert (tmp_path / "checkpoints" / "3" / "host_arrays").is_dir()


def test_keep_last_and_save_every_and_latest(tmp_path):
  params = _params()
  cp = ckpt.RunCheckpointer(tmp_path, keep_last=2, save_every=2, async_save=False)
  saved = [s for s in range(1, 8)
           if cp.save(s, params=jax.tree.map(lambda x: x + s, params),
                      host_state={"step": s})]
  assert saved == [2, 4, 6]
  assert cp.save(7, params=params, host_state={"step": 7}, force=True)
  assert not cp.save(7, params=params, host_state={"step": 7}, force=True)
  assert cp.all_steps() == [6, 7]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()
                if p.name.isdigit()) == ["6", "7"]
  cp.close()

  # A fresh checkpointer (as after a restart) sees the same steps.
  cp2 = ckpt.RunCheckpointer(tmp_path, keep_last=2, save_every=2)
  assert cp2.latest_step() == 7
  st = cp2.restore()
  assert st.host_state == {"step": 7} and st.opt_state is None
  st6 = cp2.restore(6)
  np.testing.assert_allclose(
      np.asarray(st6.params["embed"]["embedding"], np.float32),
      np.asarray(params["embed"]["embedding"] + 6, np.float32))
  with pytest.raises(FileNotFoundError, match="step 2 .*available steps: \\[6, 7\\]"):
    cp2.restore(2)
  cp2.close()


def test_restore_with_no_checkpoint_names_directory(tmp_path):
  cp = ckpt.RunCheckpointer(tmp_path / "run")
  assert cp.latest_step() is None
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "run" / "checkpoints")):
    cp.restore()
  cp.close()


def test_bad_host_state_names_field(tmp_path):
  cp = ckpt.RunCheckpointer(tmp_path)
  with pytest.raises(TypeError, match=r"host_state\['data'\]\['it'\]"):
    cp.save(1, params=_params(), host_state={"data": {"it": object()}})
  with pytest.raises(TypeError, match=r"host_state\['names'\].*dtype <U"):
    cp.save(1, params=_params(), host_state={"names": np.array(["a", "b"])})
  cp.close()


def test_leftover_tmp_directory_is_ignored(tmp_path):
  params = _params()
  with ckpt.RunCheckpointer(tmp_path, async_save=False) as cp:
    cp.save(1, params=params, host_state={"step": 1})
  # A half-written step as a killed orbax save leaves it.
  tmp_dir = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
  (tmp_dir / "params").mkdir(parents=True)
  (tmp_dir / "params" / "garbage").write_bytes(b"\0" * 10)
  with ckpt.RunCheckpointer(tmp_path) as cp:
    assert cp.all_steps() == [1]
    assert cp.restore().host_state == {"step": 1}
    assert not tmp_dir.exists()  # Cleaned up on open.


_KILL_MID_SAVE = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from rhyme_jax import checkpoint as ckpt
    run_dir = sys.argv[1]
    cp = ckpt.RunCheckpointer(run_dir, async_save=False)
    cp.save(1, params={"w": np.ones((4,), np.float32)}, host_state={"step": 1})
    tmp = os.path.join(run_dir, "checkpoints", "2.orbax-checkpoint-tmp")
    def killer():
      while not os.path.exists(tmp):
        time.sleep(0.0005)
      os._exit(17)
    threading.Thread(target=killer, daemon=True).start()
    big = np.random.default_rng(0).standard_normal((64, 1024, 1024), np.float32)
    cp.save(2, params={"w": big}, host_state={"step": 2})
    os._exit(0)  # Only reached when the save beat the killer.
""")


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _KILL_MID_SAVE, str(tmp_path)],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 17, proc.stderr[-2000:]
  ckdir = tmp_path / "checkpoints"
  assert (ckdir / "2.orbax-checkpoint-tmp").exists()
  assert not (ckdir / "2").exists()
  with ckpt.RunCheckpointer(tmp_path) as cp:
    assert cp.latest_step() == 1
    st = cp.restore()
    assert st.step == 1 and st.host_state == {"step": 1}
    np.testing.assert_array_equal(st.params["w"], np.ones((4,), np.float32))


_SHARDED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from rhyme_jax import checkpoint as ckpt
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                       NamedSharding(mesh, P("d", None)))
    with ckpt.RunCheckpointer(sys.argv[1]) as cp:
      cp.save(5, params={"x": x}, host_state={})
      target = {"x": jax.ShapeDtypeStruct((8, 4), np.float32,
                                          sharding=NamedSharding(mesh, P(None, "d")))}
      st = cp.restore(abstract_params=target)
    y = st.params["x"]
    assert y.sharding == target["x"].sharding, y.sharding
    assert len(y.addressable_shards) == 2
    assert y.addressable_shards[0].data.shape == (8, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    print("OK")
""")


def test_sharded_restore_uses_target_sharding(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path)],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_nnx_state_round_trip(tmp_path):
  from flax import nnx
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  with ckpt.RunCheckpointer(tmp_path) as cp:
    cp.save(1, params=state, host_state={})
    fresh = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            nnx.state(fresh, nnx.Param))
    restored = cp.restore(abstract_params=abstract).params
  nnx.update(fresh, restored)
  np.testing.assert_array_equal(np.asarray(fresh.kernel[...]),
                                np.asarray(model.kernel[...]))


def _big_params(seed):
  """Large enough (1 MiB) that orbax writes the array as its own data chunk."""
  return {"w": jax.random.normal(jax.random.key(seed), (4096, 64), jnp.float32)}


def _three_steps(tmp_path, params=_params):
  with ckpt.RunCheckpointer(tmp_path, keep_last=3, async_save=False) as cp:
    for step in (1, 2, 3):
      cp.save(step, params=params(step), host_state=_host_state(step))
  return tmp_path / "checkpoints"


@pytest.mark.parametrize("which", ["all", "chunks"])
def test_truncated_latest_checkpoint_falls_back_with_a_warning(tmp_path, which):
  params = _params if which == "all" else _big_params
  ckdir = _three_steps(tmp_path, params)
  data = [p for p in (ckdir / "3" / "params").rglob("*") if p.is_file() and p.stat().st_size]
  if which == "chunks":  # only the largest array chunk cut short: the metadata still reads
    data = [max(data, key=lambda p: p.stat().st_size)]
  for p in data:  # cut short, as a copy interrupted half-way leaves it
    os.truncate(p, p.stat().st_size // 2)
  warnings = []
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    st = cp.restore_latest(abstract_params=params(0), warn=warnings.append)
    assert st.step == 2
    _assert_tree_equal(st.params, params(2))
    assert len(warnings) == 1 and "checkpoint step 3 is unreadable" in warnings[0]
    assert str(ckdir / "3") in warnings[0] and "\n" not in warnings[0]
    # Moved aside, so the rerun of step 3 saves afresh instead of skipping an existing step.
    assert cp.all_steps() == [1, 2] and (tmp_path / "corrupt_checkpoints" / "3").is_dir()
    assert cp.save(3, params=params(3), host_state={}, force=True)
    cp.wait()
    _assert_tree_equal(cp.restore(3, abstract_params=params(0)).params, params(3))


def test_garbage_host_metadata_names_the_file(tmp_path):
  ckdir = _three_steps(tmp_path)
  for p in (ckdir / "3" / "host").rglob("*"):
    if p.is_file():
      p.write_text("garbage{{")
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoints/3/host: unreadable host metadata"):
      cp.restore(3)
    warnings = []
    assert cp.restore_latest(warn=warnings.append).step == 2
    assert "checkpoints/3/host" in warnings[0]


def test_a_host_state_the_caller_cannot_use_falls_back_like_a_corrupt_one(tmp_path):
  """`validate` (the trainer's checks: data order, iterator state, history arrays) refusing
  the newest step's host state: the step before is restored, the refused one moved aside."""
  _three_steps(tmp_path)

  def validate(state):
    if state.host_state["data"]["index"] > 34:  # step 3's
      raise ckpt.CheckpointError("checkpoint 3: history lengths sum to 9 but tokens has 8")

  warnings = []
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    st = cp.restore_latest(abstract_params=_params(0), warn=warnings.append, validate=validate)
    assert st.step == 2 and cp.all_steps() == [1, 2]
  assert len(warnings) == 1 and "history lengths sum to 9" in warnings[0]
  assert (tmp_path / "corrupt_checkpoints" / "3").is_dir()


def test_no_readable_checkpoint_is_one_error_naming_the_directory(tmp_path):
  ckdir = _three_steps(tmp_path)
  for step in (1, 2, 3):
    for p in (ckdir / str(step) / "host").rglob("*"):
      if p.is_file():
        p.write_text("[")
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    with pytest.raises(ckpt.CheckpointError, match=r"no readable checkpoint among steps "
                       r"\[1, 2, 3\] \(none moved\); newest failure: .*checkpoints/3/host"):
      cp.restore_latest()
    assert cp.all_steps() == [1, 2, 3]  # left in place: the next run finds them again
  assert not (tmp_path / "corrupt_checkpoints").exists()
  with ckpt.RunCheckpointer(tmp_path / "empty") as cp:
    assert cp.restore_latest() is None


def test_a_structure_every_step_fails_moves_nothing(tmp_path):
  """Intact checkpoints that this program cannot read (here an extra parameter, as a changed
  model or optax version gives) all fail alike: an error, and every one stays where it was,
  so a rerun does not find the directory empty and start over."""
  _three_steps(tmp_path)
  wider = lambda s: {**_params(s), "extra": np.zeros(3, np.float32)}
  for _ in range(2):  # and again: the rerun sees the same checkpoints
    with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
      with pytest.raises(ckpt.CheckpointError, match=r"none moved"):
        cp.restore_latest(abstract_params=wider(0), warn=pytest.fail)
      assert cp.all_steps() == [1, 2, 3]
  assert not (tmp_path / "corrupt_checkpoints").exists()
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    assert cp.restore_latest(abstract_params=_params(0)).step == 3


def test_newer_unreadable_steps_move_aside_once_an_older_one_restores(tmp_path):
  ckdir = _three_steps(tmp_path)
  for step in (2, 3):
    for p in (ckdir / str(step) / "host").rglob("*"):
      if p.is_file():
        p.write_text("[")
  warnings = []
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    assert cp.restore_latest(abstract_params=_params(0), warn=warnings.append).step == 1
    assert cp.all_steps() == [1]
  assert [w.split(" is unreadable")[0] for w in warnings] == [
      "warning: checkpoint step 3", "warning: checkpoint step 2"]
  assert all("resuming from step 1" in w for w in warnings)
  assert sorted(p.name for p in (tmp_path / "corrupt_checkpoints").iterdir()) == ["2", "3"]


class _Pod:
  """`agree` as `multihost.allgather_json` answers on process 0 of two, the other process's
  restore outcome given: records what went through it."""

  def __init__(self, other):
    self.other, self.calls = other, []

  def __call__(self, mine):
    self.calls.append(mine)
    return [mine, self.other if mine is not None else None]


def _unreadable(ckdir, *steps):
  for step in steps:
    for p in (ckdir / str(step) / "host").rglob("*"):
      if p.is_file():
        p.write_text("[")


def test_processes_that_restore_different_steps_stop_together_and_move_nothing(tmp_path):
  """Each process reads its own shards: where one could not read step 3 and fell back to 2
  while this one restored 3, all stop (one line) instead of training from different steps."""
  _three_steps(tmp_path)
  pod = _Pod({"step": 2, "failed": [3]})
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    with pytest.raises(ckpt.CheckpointError, match=r"the processes restored different "
                       r"checkpoints \(step by process: \[3, 2\]; unreadable by process: "
                       r"\[\[\], \[3\]\]\); none moved"):
      cp.restore_latest(abstract_params=_params(0), agree=pod, warn=pytest.fail)
    assert cp.all_steps() == [1, 2, 3]
  assert pod.calls == [{"step": 3, "failed": []}]


def test_a_step_unreadable_on_another_process_moves_aside_after_all_agree(tmp_path):
  ckdir = _three_steps(tmp_path)
  _unreadable(ckdir, 3)
  pod, warnings = _Pod({"step": 2, "failed": [3]}), []
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    state = cp.restore_latest(abstract_params=_params(0), agree=pod, warn=warnings.append)
    assert state.step == 2 and cp.all_steps() == [1, 2]
  # the outcome exchanged, then a barrier before any process lists the steps again
  assert pod.calls == [{"step": 2, "failed": [3]}, None]
  assert len(warnings) == 1 and "step 3 is unreadable" in warnings[0]
  # every process sees no readable step: the same one-line error everywhere, nothing moved
  _unreadable(ckdir, 1, 2)
  with ckpt.RunCheckpointer(tmp_path, keep_last=3) as cp:
    with pytest.raises(ckpt.CheckpointError, match="none moved"):
      cp.restore_latest(agree=_Pod({"step": None, "failed": [2, 1]}))
    assert cp.all_steps() == [1, 2]


def test_run_dir_as_epath(tmp_path):
  """The run directory through etils.epath (what a gs:// URI goes through): save, restore and
  moving an unreadable checkpoint aside."""
  from etils import epath
  run_dir = epath.Path(tmp_path) / "run"
  with ckpt.RunCheckpointer(run_dir, keep_last=3) as ck:
    for step in (1, 2):
      ck.save(step, params={"w": np.full(3, step, np.float32)}, host_state={"s": step})
    ck.wait()
    (run_dir / "checkpoints" / "2" / "host").rmtree()
    state = ck.restore_latest(warn=lambda msg: None)
  assert state.step == 1 and state.host_state == {"s": 1}
  np.testing.assert_array_equal(state.params["w"], np.full(3, 1, np.float32))
  assert (run_dir / "corrupt_checkpoints" / "2").is_dir()
