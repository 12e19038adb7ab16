"""Tests for rhyme_jax.run_config: fingerprint, field-by-field comparison, allowed changes."""

import json
import os
import pathlib

import pytest

from rhyme_jax import run_config


_CONFIG = {
    "model": {"name": "smollm2-135m", "dtype": "float32"},
    "rollout": {"temperature": 0.7, "max_new_tokens": 128},
    "train": {"total_steps": 100, "log_every": 10, "lr": 1e-6},
    "seed": 0,
}


def _with(config, **dotted):
  out = json.loads(json.dumps(config))
  for key, value in dotted.items():
    node = out
    *parents, leaf = key.split("__")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return out


def test_run_config_write_check_and_allow_list(tmp_path):
  path = run_config.write_run_config(tmp_path, _CONFIG)
  assert json.loads(path.read_text())["fingerprint"] == run_config.config_fingerprint(_CONFIG)
  assert run_config.check_run_config(tmp_path, _CONFIG) == []
  changed = _with(_CONFIG, train__total_steps=200, train__log_every=5)
  assert run_config.check_run_config(
      tmp_path, changed, allow_changed=["train.total_steps", "train.log_every"]
  ) == ["train.log_every", "train.total_steps"]
  with pytest.raises(FileExistsError, match="run_config.json"):
    run_config.write_run_config(tmp_path, changed)


def test_mismatched_config_names_fields_and_writes_nothing(tmp_path):
  run_config.write_run_config(tmp_path, _CONFIG)
  before = (tmp_path / "run_config.json").read_bytes()
  other = _with(_CONFIG, rollout__temperature=1.0, train__total_steps=300)
  other["model"]["extra"] = 1
  with pytest.raises(run_config.RunConfigMismatchError) as err:
    run_config.ensure_run_config(tmp_path, other, allow_changed=["train.total_steps"])
  msg = str(err.value)
  assert "rollout.temperature: run dir has 0.7, new config has 1.0" in msg
  assert "model.extra: run dir has <absent>, new config has 1" in msg
  assert "total_steps" not in msg
  assert str(tmp_path / "run_config.json") in msg
  assert (tmp_path / "run_config.json").read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ["run_config.json"]


def test_data_fingerprint_is_compared_when_stored(tmp_path):
  from rhyme_jax.data.example import Example, examples_fingerprint
  ex = [Example("a", "1+1?", "#### 2"), Example("b", "2+2?", "#### 4")]
  fp = examples_fingerprint(ex)
  assert fp["examples"] == 2 and fp == examples_fingerprint(list(ex))
  edited = examples_fingerprint([ex[0], Example("b", "2+3?", "#### 5")])
  assert edited["sha256"] != fp["sha256"]
  assert examples_fingerprint(ex[::-1])["sha256"] != fp["sha256"]  # the order is the data too
  run_config.ensure_run_config(tmp_path, _CONFIG, data=fp)
  before = (tmp_path / "run_config.json").read_bytes()
  assert run_config.ensure_run_config(tmp_path, _CONFIG, data=fp) == []
  with pytest.raises(run_config.RunConfigMismatchError, match=r"the run's data changed \(run "
                     r"dir has \{\"examples\": 2, \"sha256\": \"" + fp["sha256"]):
    run_config.ensure_run_config(tmp_path, _CONFIG, data=edited)
  assert (tmp_path / "run_config.json").read_bytes() == before
  # a run directory from before data fingerprints: not compared, and recorded from now on
  old = tmp_path / "old"
  run_config.write_run_config(old, _CONFIG)
  assert run_config.ensure_run_config(old, _CONFIG, data=edited) == []
  assert json.loads((old / "run_config.json").read_text())["data"] == edited
  with pytest.raises(run_config.RunConfigMismatchError, match="data changed"):
    run_config.check_run_config(old, _CONFIG, data=fp)


def test_fingerprint_without_the_host_local_fields():
  """What every process of a run must share, compared at start-up as one digest: the fields
  a host may set its own way (its engine's, its process id) are left out."""
  from rhyme_jax.config import HOST_LOCAL_FIELDS, LOCKSTEP_FIELDS, parse_flags
  base = ["--run_dir=r", "--num_processes=2", "--coordinator_address=h:1"]
  fp = lambda *flags: run_config.fingerprint_without(parse_flags(base + list(flags)),
                                                     HOST_LOCAL_FIELDS)
  assert fp("--process_id=0") == fp("--process_id=1", "--attention=pallas", "--multi_step=4")
  assert fp("--process_id=0") != fp("--process_id=1", "--seed=1")
  assert fp("--process_id=0") != fp("--process_id=1", "--num_steps=7")  # lockstep ones too
  assert not set(HOST_LOCAL_FIELDS) & set(LOCKSTEP_FIELDS) and "distributed" in HOST_LOCAL_FIELDS


def test_ensure_run_config_creates_then_updates_allowed(tmp_path):
  run = tmp_path / "new_run"
  assert run_config.ensure_run_config(run, _CONFIG) == []
  assert run_config.read_run_config(run) == _CONFIG
  changed = _with(_CONFIG, train__total_steps=500)
  assert run_config.ensure_run_config(run, changed, allow_changed=["train"]) == [
      "train.total_steps"]
  assert run_config.read_run_config(run)["train"]["total_steps"] == 500
  # Type changes count as changes (1 vs True).
  with pytest.raises(run_config.RunConfigMismatchError, match="seed"):
    run_config.check_run_config(run, _with(changed, seed=False))


def test_dataclass_config_and_non_json_field(tmp_path):
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Cfg:
    lr: float = 1e-3
    out: pathlib.Path = pathlib.Path("/tmp/x")
    fn: object = None

  run_config.write_run_config(tmp_path, Cfg())
  assert run_config.read_run_config(tmp_path) == {"lr": 1e-3, "out": "/tmp/x", "fn": None}
  with pytest.raises(TypeError, match="'fn'"):
    run_config.check_run_config(tmp_path, Cfg(fn=object()))


def test_run_dir_through_epath_and_uris(tmp_path):
  """`gs://bucket/run` stays a URI (pathlib would make it `gs:/bucket/run`); local run
  directories work as epath paths."""
  from etils import epath
  assert os.fspath(run_config._config_path("gs://bucket/run")) == "gs://bucket/run/run_config.json"
  run_dir = epath.Path(tmp_path) / "run"
  assert run_config.ensure_run_config(run_dir, {"a": 1, "b": 2}) == []
  assert run_config.ensure_run_config(str(run_dir), {"a": 1, "b": 3}, allow_changed=["b"]) == ["b"]
  assert run_config.read_run_config(run_dir) == {"a": 1, "b": 3}
  assert [p.name for p in run_dir.iterdir()] == [run_config.RUN_CONFIG_FILE]  # no temporary left
