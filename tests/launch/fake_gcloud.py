"""Stands in for `gcloud` in the launch tests: records every call, and plays the TPU VM side.

The launch scripts' own logic is the shell they run on the workers (the `--command` of `tpu-vm
ssh`) and the files they copy there (`tpu-vm scp`). This executable runs those for real, on
this machine: each worker of the fake TPU VM is a directory under $FAKE_TPU_ROOT (w0, w1, ...,
$FAKE_TPU_WORKERS of them) used as that worker's home, and `--worker=all` runs the command in
each of them in turn, with bash, as gcloud runs it through the login shell on the VM. Calls
that only talk to the Cloud API (create, delete, queued-resources) are recorded and succeed.

Every call's argv goes, one JSON list per line, to $FAKE_GCLOUD_LOG. Only the verbs named in
$FAKE_TPU_EXEC (comma-separated: ssh, scp) are played; the others are only recorded.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys


def _option(args: list[str], name: str) -> str | None:
  for arg in args:
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
  return None


def _workers(args: list[str]) -> list[pathlib.Path]:
  root = pathlib.Path(os.environ["FAKE_TPU_ROOT"])
  count = int(os.environ.get("FAKE_TPU_WORKERS", "1"))
  worker = _option(args, "worker") or "0"
  indices = range(count) if worker == "all" else [int(worker)]
  return [root / f"w{i}" for i in indices]


def _ssh(args: list[str]) -> int:
  command = _option(args, "command")
  if command is None:
    print("fake gcloud: interactive ssh is not supported", file=sys.stderr)
    return 2
  status = 0
  for home in _workers(args):
    env = dict(os.environ, HOME=str(home))
    status |= subprocess.run(["bash", "-c", command], cwd=home, env=env).returncode
  return status


def _scp(args: list[str]) -> int:
  positional = [a for a in args if not a.startswith("--")]
  source, target = positional
  _, _, dest = target.partition(":")
  for home in _workers(args):
    path = home / dest
    if not path.parent.is_dir():
      print(f"fake gcloud scp: {path.parent} does not exist on {home.name}", file=sys.stderr)
      return 1
    shutil.copyfile(source, path)
  return 0


def main(argv: list[str]) -> int:
  with open(os.environ["FAKE_GCLOUD_LOG"], "a", encoding="utf-8") as log:
    log.write(json.dumps(["gcloud", *argv]) + "\n")
  played = os.environ.get("FAKE_TPU_EXEC", "").split(",")
  if argv[:3] == ["compute", "tpus", "tpu-vm"] and len(argv) > 3 and argv[3] in played:
    return {"ssh": _ssh, "scp": _scp}[argv[3]](argv[4:])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
