"""The run directory's config fingerprint: `RUN_DIR/run_config.json`.

A new run directory gets the run's config (canonical JSON) and its sha256, and optionally a
fingerprint of its data (`data`: what the flags cannot show, e.g. the contents of the dataset
file they name); a rerun in the same directory is compared field by field, and by that
fingerprint, so a resumed run is the run it claims to continue. Only fields named as
resumable (e.g. the total step count) may differ. The run directory may be a
local path or a `gs://` URI (`etils.epath`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from typing import Any, Iterable, Mapping

import numpy as np
from etils import epath

RUN_CONFIG_FILE = "run_config.json"


class RunConfigError(ValueError):
  """The run directory's run_config.json cannot be read."""


class RunConfigMismatchError(RunConfigError):
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


def fingerprint_without(config: Any, exclude: Iterable[str]) -> str:
  """sha256 of `config` less the fields named (dotted names or prefixes) in `exclude`."""
  flat = _flatten(_normalize(config, ""))
  return config_fingerprint({k: v for k, v in flat.items() if not _allowed(k, exclude)})


def _config_path(run_dir: str | os.PathLike) -> epath.Path:
  return epath.Path(run_dir) / RUN_CONFIG_FILE


def _write_atomic(path: epath.Path, text: str) -> None:
  """Written aside, then renamed over `path` (atomic on a local disk; on GCS each object write
  is atomic anyway)."""
  tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
  tmp.write_text(text)
  tmp.replace(path)


def write_run_config(run_dir: str | os.PathLike, config: Any, *, data: Any = None,
                     overwrite: bool = False) -> epath.Path:
  """Writes `run_dir/run_config.json` (config + fingerprint, and `data` if given), atomically.

  Refuses to replace an existing file unless `overwrite=True`.
  """
  path = _config_path(run_dir)
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} already exists; use check_run_config to "
                          "compare against it")
  normalized = _normalize(config, "")
  entry = {"fingerprint": config_fingerprint(normalized), "config": normalized}
  if data is not None:
    entry["data"] = _normalize(data, "data")
  path.parent.mkdir(parents=True, exist_ok=True)
  _write_atomic(path, json.dumps(entry, indent=2, sort_keys=True) + "\n")
  return path


def _read(run_dir: str | os.PathLike) -> dict:
  path = _config_path(run_dir)
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise RunConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
  except UnicodeDecodeError as e:
    raise RunConfigError(f"{path}: not UTF-8") from e
  if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
    raise RunConfigError(f"{path}: missing 'config' entry")
  return data


def read_run_config(run_dir: str | os.PathLike) -> dict:
  return _read(run_dir)["config"]


def _allowed(key: str, allow_changed: Iterable[str]) -> bool:
  return any(key == a or key.startswith(a + ".") for a in allow_changed)


def check_run_config(run_dir: str | os.PathLike, config: Any, *, data: Any = None,
                     allow_changed: Iterable[str] = ()) -> list[str]:
  """Compares `config` (and `data`) with what `run_dir` stores; never writes.

  Fields are compared by dotted name ('rollout.temperature'). Names (or
  dotted prefixes) in `allow_changed` may differ, e.g. total steps or logging
  frequency. Returns the allowed fields that changed; raises
  `RunConfigMismatchError` naming every other differing field, or where `data` differs
  from the stored data fingerprint (a run directory written without one is not compared).
  """
  allow_changed = tuple(allow_changed)
  entry = _read(run_dir)
  if data is not None and "data" in entry and entry["data"] != _normalize(data, "data"):
    raise RunConfigMismatchError(
        f"{_config_path(run_dir)}: the run's data changed (run dir has "
        f"{json.dumps(entry['data'], sort_keys=True)}, now "
        f"{json.dumps(_normalize(data, 'data'), sort_keys=True)}): resuming would skip or "
        "repeat examples; restore the data the run started with, or use a new run directory")
  stored = _flatten(entry["config"])
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


def ensure_run_config(run_dir: str | os.PathLike, config: Any, *, data: Any = None,
                      allow_changed: Iterable[str] = ()) -> list[str]:
  """Writes the config (and `data`) for a new run dir, or checks them for an existing one.

  When only allowed fields changed the stored config is updated to the new
  one (after the check passed), as is a run dir written without a data fingerprint;
  returns the changed allowed fields.
  """
  if not _config_path(run_dir).exists():
    write_run_config(run_dir, config, data=data)
    return []
  changed = check_run_config(run_dir, config, data=data, allow_changed=allow_changed)
  if changed or (data is not None and "data" not in _read(run_dir)):
    write_run_config(run_dir, config, data=data, overwrite=True)
  return changed
