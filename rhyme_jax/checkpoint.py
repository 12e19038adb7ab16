"""Whole-run checkpoints (orbax) and the run-directory config fingerprint.

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

Layout: `RUN_DIR/checkpoints/<step>/{params,opt_state,host,host_arrays}` and
`RUN_DIR/run_config.json`.

Atomicity: orbax writes each step into `<step>.orbax-checkpoint-tmp` and
renames it when complete, so a process killed mid-save leaves the previous
step as the latest usable one; leftover tmp directories are ignored and
removed the next time a `RunCheckpointer` opens the directory.

Multi-host note: JSON host state is written by the primary process only;
per-host iterator state must be gathered into it by the caller.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pathlib
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_SUBDIR = "checkpoints"
RUN_CONFIG_FILE = "run_config.json"
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
    self.run_dir = pathlib.Path(run_dir)
    self.directory = self.run_dir / CHECKPOINT_SUBDIR
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last,
        save_interval_steps=save_every,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
        create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory.absolute(),
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
    host = self._manager.restore(
        step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]
    if host.get("format_version") != _HOST_FORMAT_VERSION:
      raise ValueError(
          f"{self.directory / str(step) / 'host'}: unsupported format_version "
          f"{host.get('format_version')!r} (expected {_HOST_FORMAT_VERSION})")
    items = {"params": ocp.args.StandardRestore(
        None if abstract_params is None else _to_abstract(abstract_params))}
    if host["has_opt_state"]:
      items["opt_state"] = ocp.args.StandardRestore(
          None if abstract_opt_state is None else _to_abstract(abstract_opt_state))
    if host["num_host_arrays"]:
      items["host_arrays"] = ocp.args.StandardRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    arrays = restored["host_arrays"] if host["num_host_arrays"] else {}
    return RunState(
        step=step,
        params=restored["params"],
        opt_state=restored["opt_state"] if host["has_opt_state"] else None,
        host_state=_decode_host(host["host_state"], arrays),
    )

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


# ---------------------------------------------------------------------------
# Run config fingerprint


class RunConfigMismatchError(ValueError):
  """The run directory was created by a different configuration."""


def _normalize(value: Any, path: str) -> Any:
  """Canonical JSON form of a config value (dataclasses -> dicts, etc.)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
  if isinstance(value, enum.Enum):
    value = value.value
  if isinstance(value, os.PathLike):
    return os.fspath(value)
  if isinstance(value, np.generic):
    return value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise TypeError(f"config{path}: key {k!r} is not a str")
      out[k] = _normalize(v, f"{path}.{k}" if path else k)
    return out
  if isinstance(value, (list, tuple)):
    return [_normalize(v, f"{path}[{i}]") for i, v in enumerate(value)]
  raise TypeError(f"config field {path or '<root>'!r}: value of type "
                  f"{type(value).__name__} is not JSON-able")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1}; lists stay as leaf values."""
  if isinstance(value, dict) and value:
    out = {}
    for k, v in value.items():
      out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out
  return {prefix: value}


def config_fingerprint(config: Any) -> str:
  """sha256 of the canonical JSON form of `config`."""
  canon = json.dumps(_normalize(config, ""), sort_keys=True,
                     separators=(",", ":"))
  return hashlib.sha256(canon.encode()).hexdigest()


def _config_path(run_dir: str | os.PathLike) -> pathlib.Path:
  return pathlib.Path(run_dir) / RUN_CONFIG_FILE


def _write_atomic(path: pathlib.Path, text: str) -> None:
  tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
  tmp.write_text(text)
  os.replace(tmp, path)


def write_run_config(run_dir: str | os.PathLike, config: Any, *,
                     overwrite: bool = False) -> pathlib.Path:
  """Writes `run_dir/run_config.json` (config + fingerprint), atomically.

  Refuses to replace an existing file unless `overwrite=True`.
  """
  path = _config_path(run_dir)
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} already exists; use check_run_config to "
                          "compare against it")
  normalized = _normalize(config, "")
  path.parent.mkdir(parents=True, exist_ok=True)
  _write_atomic(path, json.dumps(
      {"fingerprint": config_fingerprint(normalized), "config": normalized},
      indent=2, sort_keys=True) + "\n")
  return path


def read_run_config(run_dir: str | os.PathLike) -> dict:
  path = _config_path(run_dir)
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
  if not isinstance(data, dict) or "config" not in data:
    raise ValueError(f"{path}: missing 'config' entry")
  return data["config"]


def _allowed(key: str, allow_changed: Iterable[str]) -> bool:
  return any(key == a or key.startswith(a + ".") for a in allow_changed)


def check_run_config(run_dir: str | os.PathLike, config: Any, *,
                     allow_changed: Iterable[str] = ()) -> list[str]:
  """Compares `config` with the one stored in `run_dir`; never writes.

  Fields are compared by dotted name ('rollout.temperature'). Names (or
  dotted prefixes) in `allow_changed` may differ, e.g. total steps or logging
  frequency. Returns the allowed fields that changed; raises
  `RunConfigMismatchError` naming every other differing field.
  """
  allow_changed = tuple(allow_changed)
  stored = _flatten(read_run_config(run_dir))
  new = _flatten(_normalize(config, ""))
  missing = object()
  diffs, allowed = [], []
  for key in sorted(set(stored) | set(new)):
    a, b = stored.get(key, missing), new.get(key, missing)
    if a == b and type(a) is type(b):
      continue
    if _allowed(key, allow_changed):
      allowed.append(key)
      continue
    fmt = lambda v: "<absent>" if v is missing else json.dumps(v)
    diffs.append(f"  {key}: run dir has {fmt(a)}, new config has {fmt(b)}")
  if diffs:
    raise RunConfigMismatchError(
        f"{_config_path(run_dir)} was written by a different config; "
        f"differing fields:\n" + "\n".join(diffs) +
        "\nUse a new run directory, or allow the fields to change on resume.")
  return allowed


def ensure_run_config(run_dir: str | os.PathLike, config: Any, *,
                      allow_changed: Iterable[str] = ()) -> list[str]:
  """Writes the config for a new run dir, or checks it for an existing one.

  When only allowed fields changed the stored config is updated to the new
  one (after the check passed); returns the changed allowed fields.
  """
  if not _config_path(run_dir).exists():
    write_run_config(run_dir, config)
    return []
  changed = check_run_config(run_dir, config, allow_changed=allow_changed)
  if changed:
    write_run_config(run_dir, config, overwrite=True)
  return changed
