"""Whole-run checkpoints (orbax); the run directory's config fingerprint is `run_config`.

A checkpoint at step S holds everything needed to continue a run as if it had
never stopped:

  params      array pytree (possibly sharded); orbax `StandardSave`.
  opt_state   array pytree (e.g. optax state); orbax `StandardSave`.
  host        JSON: step, data-iterator state, RNG seeds/state, history store
              metadata; orbax `JsonSave`.
  host_arrays numpy arrays found inside the host state. They are cut out of the
              JSON (replaced by a `{"__ndarray__": "arr_<n>"}` marker) and
              saved as their own array pytree, so large history buffers are
              written as binary tensorstore chunks rather than as JSON lists
              or base64 text. Zero-size arrays stay inline (shape + dtype).

Layout: `RUN_DIR/checkpoints/<step>/{params,opt_state,host,host_arrays}`.

Atomicity: orbax writes each step into `<step>.orbax-checkpoint-tmp` and
renames it when complete, so a process killed mid-save leaves the previous
step as the latest usable one; leftover tmp directories are ignored and
removed the next time a `RunCheckpointer` opens the directory.

Recovery: `restore_latest` restores the newest checkpoint that reads back whole; a corrupt
or truncated one (disk full, a copy cut short) is reported with a warning naming it and the
next older one is tried. Where none reads back, nothing is moved and the error names the
newest failure. Unreadable host metadata is a `CheckpointError` naming its file.

Multi-host note: JSON host state is written by the primary process only;
per-host iterator state must be gathered into it by the caller.

Paths go through `etils.epath`, so the run directory may be a `gs://` URI (orbax and
tensorstore read and write it; `gcsfs` must be installed) as well as a local path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

CHECKPOINT_SUBDIR = "checkpoints"
CORRUPT_SUBDIR = "corrupt_checkpoints"  # unreadable checkpoints moved aside on restore
_ARRAY_MARKER = "__ndarray__"
_EMPTY_ARRAY_MARKER = "__empty_ndarray__"
_HOST_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------
# Host state <-> (JSON, array dict)


def _encode_host(value: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
  """Returns a JSON-able copy of `value`, moving numpy arrays into `arrays`."""
  if isinstance(value, jax.Array):
    value = np.asarray(value)
  if isinstance(value, np.ndarray):
    if value.dtype.kind not in "biuf" and value.dtype.name != "bfloat16":
      raise TypeError(
          f"host_state{path}: numpy array of dtype {value.dtype} cannot be "
          "checkpointed (only bool/int/uint/float arrays are supported)")
    if value.size == 0:
      return {_EMPTY_ARRAY_MARKER: {"shape": list(value.shape),
                                    "dtype": value.dtype.name}}
    key = f"arr_{len(arrays)}"
    arrays[key] = value
    return {_ARRAY_MARKER: key}
  if isinstance(value, np.generic):
    return value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise TypeError(f"host_state{path}: dict key {k!r} is not a str")
      if k in (_ARRAY_MARKER, _EMPTY_ARRAY_MARKER):
        raise ValueError(f"host_state{path}: key {k!r} is reserved")
      out[k] = _encode_host(v, f"{path}[{k!r}]", arrays)
    return out
  if isinstance(value, (list, tuple)):
    return [_encode_host(v, f"{path}[{i}]", arrays) for i, v in enumerate(value)]
  raise TypeError(
      f"host_state{path}: value of type {type(value).__name__} is not JSON-able "
      "or a numpy array")


def _decode_host(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
  """Inverse of `_encode_host` (tuples come back as lists)."""
  if isinstance(value, dict):
    if set(value) == {_ARRAY_MARKER}:
      return np.asarray(arrays[value[_ARRAY_MARKER]])
    if set(value) == {_EMPTY_ARRAY_MARKER}:
      spec = value[_EMPTY_ARRAY_MARKER]
      return np.zeros(spec["shape"], dtype=spec["dtype"])
    return {k: _decode_host(v, arrays) for k, v in value.items()}
  if isinstance(value, list):
    return [_decode_host(v, arrays) for v in value]
  return value


def _to_abstract(tree: Any) -> Any:
  """Maps concrete arrays to ShapeDtypeStructs (keeping their sharding)."""
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if isinstance(x, (jax.Array, np.ndarray)):
      return ocp.utils.to_shape_dtype_struct(x)
    return x
  return jax.tree.map(one, tree)


def _has_leaves(tree: Any) -> bool:
  return tree is not None and len(jax.tree.leaves(tree)) > 0


# ---------------------------------------------------------------------------
# Checkpointer


class CheckpointError(ValueError):
  """A checkpoint on disk cannot be read back; the message names its directory or file."""


def _one_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  text = text.split(" See full TensorStore details")[0]
  return text if len(text) <= limit else text[:limit] + "..."


@dataclasses.dataclass
class RunState:
  """What `RunCheckpointer.restore` returns."""
  step: int
  params: Any
  opt_state: Any
  host_state: Any


class RunCheckpointer:
  """Saves/restores params, optimizer state and host state of one run.

  Args:
    run_dir: the run directory; checkpoints go to `run_dir/checkpoints`.
    keep_last: number of most recent checkpoints kept (older ones deleted).
    save_every: `save` only writes steps that are multiples of this (unless
      `force=True`).
    async_save: write in a background thread; call `wait()` before reading
      the files from another process. `restore` and `close` wait themselves.
  """

  def __init__(self, run_dir: str | os.PathLike, *, keep_last: int = 3,
               save_every: int = 1, async_save: bool = True):
    if keep_last < 1:
      raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}")
    self.run_dir = epath.Path(run_dir)
    self.directory = self.run_dir / CHECKPOINT_SUBDIR
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last,
        save_interval_steps=save_every,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
        create=True,
    )
    local = "://" not in os.fspath(self.directory)  # a URI is absolute already
    self._manager = ocp.CheckpointManager(self.directory.absolute() if local else self.directory,
                                          options=options)

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Latest complete (or in-flight, in this process) checkpoint step."""
    return self._manager.latest_step()

  def save(self, step: int, *, params: Any, opt_state: Any = None,
           host_state: Any = None, force: bool = False) -> bool:
    """Saves one step; returns False when skipped (off-interval or already saved).

    `host_state` may be any nesting of dicts (str keys), lists/tuples, JSON
    scalars, numpy scalars and numpy/jax arrays; tuples restore as lists.
    """
    if step in self._manager.all_steps():
      return False
    if not force and not self.should_save(step):
      return False
    arrays: dict[str, np.ndarray] = {}
    encoded = _encode_host(host_state, "", arrays)
    if not _has_leaves(params):
      raise ValueError("save: params has no array leaves")
    items = {"params": ocp.args.StandardSave(params)}
    has_opt = _has_leaves(opt_state)
    if has_opt:
      items["opt_state"] = ocp.args.StandardSave(opt_state)
    if arrays:
      items["host_arrays"] = ocp.args.StandardSave(arrays)
    items["host"] = ocp.args.JsonSave({
        "format_version": _HOST_FORMAT_VERSION,
        "step": step,
        "has_opt_state": has_opt,
        "num_host_arrays": len(arrays),
        "host_state": encoded,
    })
    return self._manager.save(step, args=ocp.args.Composite(**items),
                              force=True)

  def restore(self, step: int | None = None, *, abstract_params: Any = None,
              abstract_opt_state: Any = None) -> RunState:
    """Restores `step` (default: latest).

    `abstract_params` / `abstract_opt_state` are pytrees of
    `jax.ShapeDtypeStruct` (or concrete arrays) giving the structure, dtypes
    and shardings to restore into; pass them whenever the tree contains
    namedtuples (optax) or arrays must land sharded. Without a target the
    tree comes back as orbax stored it (dicts/lists, default placement).
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint found under {self.directory}")
    elif step not in self._manager.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} under {self.directory}; "
          f"available steps: {self.all_steps()}")
    host_dir = self.directory / str(step) / "host"
    try:
      host = self._manager.restore(
          step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]
    except (ValueError, OSError, KeyError, TypeError) as e:
      raise CheckpointError(f"{host_dir}: unreadable host metadata ({_one_line(e)})") from e
    if not isinstance(host, dict) or host.get("format_version") != _HOST_FORMAT_VERSION:
      version = host.get("format_version") if isinstance(host, dict) else None
      raise CheckpointError(f"{host_dir}: unsupported format_version {version!r} (expected "
                            f"{_HOST_FORMAT_VERSION})")
    for key in ("has_opt_state", "num_host_arrays", "host_state"):
      if key not in host:
        raise CheckpointError(f"{host_dir}: host metadata lacks {key!r}")
    items = {"params": ocp.args.StandardRestore(
        None if abstract_params is None else _to_abstract(abstract_params))}
    if host["has_opt_state"]:
      items["opt_state"] = ocp.args.StandardRestore(
          None if abstract_opt_state is None else _to_abstract(abstract_opt_state))
    if host["num_host_arrays"]:
      items["host_arrays"] = ocp.args.StandardRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Unreadable data: the usual errors, or the bare `Exception` orbax raises for a
      # truncated tensorstore chunk. Anything more specific is a bug: re-raised.
      if type(e) is not Exception and not isinstance(e, (ValueError, OSError, KeyError,
                                                          TypeError)):
        raise
      raise CheckpointError(f"{self.directory / str(step)}: cannot restore arrays "
                            f"({_one_line(e)})") from e
    arrays = restored["host_arrays"] if host["num_host_arrays"] else {}
    return RunState(
        step=step,
        params=restored["params"],
        opt_state=restored["opt_state"] if host["has_opt_state"] else None,
        host_state=_decode_host(host["host_state"], arrays),
    )

  def restore_latest(self, *, abstract_params: Any = None, abstract_opt_state: Any = None,
                     warn=None, agree=None, validate=None) -> RunState | None:
    """The newest checkpoint that restores whole, or None when there is none.

    Steps are tried newest first. When an older one restores, every newer one that failed
    (truncated or corrupt files, garbage host metadata) is moved aside to
    `RUN_DIR/corrupt_checkpoints/<step>` (kept for inspection; the run saves that step afresh
    when it gets there) and reported through `warn(message)`. When none restores, nothing is
    moved and `CheckpointError` names the directory and the newest failure: a failure of every
    step is more likely a mismatch with this program (a changed model or optimizer structure)
    than corruption of them all, and moving them aside would make the next run start over.

    `agree` (several processes: `multihost.allgather_json`) makes the processes settle on one
    outcome: each reads its own shards, so one may fail a step the others restored. Then
    every process raises `CheckpointError` (nothing moved) rather than train from different
    steps; a step that failed anywhere is moved aside (by process 0) only once all restored
    the same older one, and all of them see the move before they go on.

    `validate(state)` (the caller's checks of what it will load) raising `CheckpointError`
    makes a step that read back count as unreadable too (a host state this program cannot use).
    """
    steps = self.all_steps()
    failed: dict[int, str] = {}
    state = None
    for step in reversed(steps):
      try:
        state = self.restore(step, abstract_params=abstract_params,
                             abstract_opt_state=abstract_opt_state)
        if validate is not None:
          validate(state)
        break
      except CheckpointError as e:
        failed[step] = str(e)
    found = None if state is None else state.step
    bad = sorted(failed, reverse=True)
    if agree is not None:
      views = agree({"step": found, "failed": bad})
      if any(v["step"] != found for v in views):
        raise CheckpointError(
            f"{self.directory}: the processes restored different checkpoints (step by "
            f"process: {[v['step'] for v in views]}; unreadable by process: "
            f"{[v['failed'] for v in views]}); none moved: each process reads its own shards, "
            "so check the files of the steps one of them could not read")
      bad = sorted({s for v in views for s in v["failed"]}, reverse=True)
    if found is None:
      if bad:
        newest = failed.get(bad[0], f"step {bad[0]} is unreadable on another process")
        raise CheckpointError(f"{self.directory}: no readable checkpoint among steps {steps} "
                              f"(none moved); newest failure: {newest}")
      return None
    for step in bad:
      moved = self._quarantine(step)
      if warn is not None:
        why = failed.get(step, "unreadable on another process")
        warn(f"warning: checkpoint step {step} is unreadable (moved to {moved}); resuming "
             f"from step {found}: {why}")
    if bad:
      if agree is not None:
        agree(None)  # a barrier: process 0's moves are done before any process lists again
      self._manager.reload()
    return state

  def _quarantine(self, step: int) -> epath.Path:
    """Moves a step aside (process 0; the others name the same target); no reload."""
    target = self.run_dir / CORRUPT_SUBDIR / str(step)
    if jax.process_index() != 0:
      return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # an earlier quarantine of the same step: keep the newest
      target = target.parent / f"{step}.{len(list(target.parent.iterdir()))}"
    (self.directory / str(step)).rename(target)
    return target

  def wait(self) -> None:
    """Blocks until any in-flight async save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "RunCheckpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
