"""Two `jax.distributed` processes on localhost (2 CPU devices each, gloo collectives) training
a tiny random Llama with GRPO: the multi-host design of `rhyme_jax.multihost` end to end.

The model makes end of turn likely (`write_tiny_llama(eos_boost=...)`), so responses end at
random lengths and the two hosts' engines take different numbers of decode steps: with a
global SPMD rollout that is the case that hung or aborted (`Received data size doesn't match
expected size`); with host-local rollout it must simply work. The mesh is the v5p config's
shape, FSDP over all four devices across both processes.

Each process is `multihost_entry.py` (the real `Trainer`, observed by wrappers that log what it
consumed and sampled). Checked: both finish; their rollout policies are bitwise equal after the
updates; every prompt of the stream is sampled once by exactly one host and trained on G times;
request ids, hence sampling keys, never repeat across hosts; the history store (spec on) is
the same on both hosts. With --balance_hosts (hosts sample an LPT plan of the whole round
and train on their slices) the run equals the unbalanced one: tokens and data exactly, training
to float32 rounding (`assert_same_run` says why not bitwise). The SIGKILL / SIGTERM
resumption test launches four runs per variant and is slow.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import train_entry

from rhyme_jax.metrics import read_metrics
from rhyme_jax.rl.rollouts import without_timing

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(HERE, "multihost_entry.py")
REPO = os.path.dirname(os.path.dirname(HERE))
PROCESSES = 2
GROUP = 2


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
  return train_entry.write_tiny_llama(str(tmp_path_factory.mktemp("eos_llama")), eos_boost=2.5)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """One persistent compilation cache for this module's children (they compile alike)."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_flags(model, run_dir, *extra):
  return [f"--model={model}", "--tokenizer=smollm2-135m-instruct", f"--run_dir={run_dir}",
          "--task=arithmetic", "--train_size=2", "--reward=test_parity",
          f"--group_size={GROUP}", "--prompts_per_step=1", "--max_new_tokens=6",
          "--max_prompt_len=128", "--learning_rate=0.01", "--temperature=1.0", "--seed=3",
          "--mesh_data=1", "--mesh_fsdp=4", *extra]


class Pair:
  """The two processes of one run; their output goes to files (no pipe to fill up)."""

  def __init__(self, flags, log_dir, cache):
    os.makedirs(log_dir, exist_ok=True)
    self.log_dir = log_dir
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=os.pathsep.join([REPO, HERE] + [p for p in [os.environ.get(
                   "PYTHONPATH")] if p]))
    self.outs = [open(os.path.join(log_dir, f"out{i}.txt"), "a") for i in range(PROCESSES)]
    self.procs = [
        subprocess.Popen([sys.executable, ENTRY, log_dir, *flags,
                          f"--coordinator_address=localhost:{port}",
                          f"--num_processes={PROCESSES}", f"--process_id={i}"],
                         cwd=REPO, env=env, stdout=self.outs[i], stderr=subprocess.STDOUT)
        for i in range(PROCESSES)]

  def wait(self, timeout=600):
    deadline = time.time() + timeout
    try:
      for p in self.procs:
        p.wait(timeout=max(deadline - time.time(), 1))
    finally:
      self.kill()
    return [p.returncode for p in self.procs]

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait()
    for f in self.outs:
      f.close()

  def output(self, i):
    with open(os.path.join(self.log_dir, f"out{i}.txt")) as f:
      return f.read()[-3000:]


def events(log_dir, process, kind=None):
  path = os.path.join(log_dir, f"process{process}.jsonl")
  with open(path) as f:
    out = [json.loads(line) for line in f if line.endswith("\n")]
  return [e for e in out if kind is None or e["kind"] == kind]


def params(log_dir, process):
  with np.load(os.path.join(log_dir, f"params{process}.npz")) as z:
    return {k: z[k] for k in z.files}


TRAINING_METRICS = ("train/", "kl", "entropy", "clip_frac", "grad_norm")


def assert_same_run(got, want, got_logs, want_logs):
  """Two runs' logged metrics and final policies (every host's) agree: samples (tokens CRC32),
  data, rewards and schedule exactly; training figures and parameters to float32 rounding.

  Not bitwise: the engine picks its step shapes (bucket moves, speculation) by its cost model,
  which measures this machine's step times and learns over a process's life, so two runs
  (one resumed, or a prompt moved to another host) may decode a row in another batch shape.
  A float32 forward in another shape rounds its last bits differently, and the loss reads the
  rollout's log-probs (the importance weight, --tis_cap): seen, is_weight_mean 0.99999988
  against 1.0 after a resume. The tokens are the same: the sampling keys follow the request
  and position, not the shape."""
  got, want = without_timing(got), without_timing(want)
  assert [sorted(r) for r in got] == [sorted(r) for r in want]
  for g, w in zip(got, want):
    for k, v in w.items():
      if k.startswith(TRAINING_METRICS):
        assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (g["step"], k)
      else:
        assert g[k] == v, (g["step"], k)
  # Adam moves a weight by up to ~--learning_rate (0.01) per step whatever its gradient's size,
  # so a near-zero gradient's rounding shows as ~1e-6; a restore that lost state shows as ~1e-2.
  for p in range(PROCESSES):
    a, b = params(got_logs, p), params(want_logs, p)
    assert sorted(a) == sorted(b)
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


def run_pair(flags, log_dir, cache, timeout=600):
  pair = Pair(flags, log_dir, cache)
  codes = pair.wait(timeout)
  assert codes == [0] * PROCESSES, "\n\n".join(pair.output(i) for i in range(PROCESSES))
  return pair


# spec=none runs with the slow tests (~60 s): histospec, which adds dynamic sampling, keeps the
# two-process GRPO path in the default suite
@pytest.mark.parametrize("spec", [pytest.param("none", marks=pytest.mark.slow), "histospec"])
def test_two_processes_two_grpo_steps(eos_model, compile_cache, tmp_path, spec):
  """With spec on, also dynamic sampling: hosts refill dropped groups in as many rounds as
  each needs (a host may train on no group at all while the other trains on its own)."""
  log_dir = str(tmp_path / "logs")
  steps = 2
  extra = ["--dynamic_sampling", "--dynamic_sampling_max_rounds=2"] if spec != "none" else []
  run_pair(run_flags(eos_model, tmp_path / "run", f"--num_steps={steps}", f"--spec={spec}",
                     "--checkpoint_every=1", "--eval_every=2", "--eval_size=3", *extra),
           log_dir, compile_cache)
  import jax
  from rhyme_jax.rollout.sampling import sample_keys

  # Both finished and agree on the updated policy, bit for bit.
  p0, p1 = params(log_dir, 0), params(log_dir, 1)
  assert sorted(p0) == sorted(p1) and len(p0) > 5
  for k in p0:
    np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
  initial = params_of_model(eos_model)
  assert max(float(np.abs(p0[k] - initial[k]).max()) for k in p0) > 1e-4  # it trained

  # Each host reads its own slice of the prompt stream (positions p, p + 2, ...), in order,
  # nothing skipped or repeated; no position read by both.
  batches = {p: events(log_dir, p, "batch") for p in range(PROCESSES)}
  taken = {p: [pos for b in batches[p] for pos in b["positions"]] for p in range(PROCESSES)}
  for p in range(PROCESSES):
    assert taken[p] == [p + PROCESSES * k for k in range(len(taken[p]))]
  if spec == "none":  # one round per step: the hosts read the stream together
    for step in range(1, steps + 1):
      both = sorted(pos for p in range(PROCESSES) for b in batches[p] if b["step"] == step
                    for pos in b["positions"])
      assert both == list(range((step - 1) * PROCESSES, step * PROCESSES))
  # Every host trains (the update is one program) on groups it sampled that step: each one
  # a whole group of G samples; the metrics (process 0) count every host's samples.
  records = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2]
  rounds_taken = set()
  for step, r in zip(range(1, steps + 1), records):
    read = {p: [b for b in batches[p] if b["step"] == step] for p in range(PROCESSES)}
    rounds_taken.add(tuple(len(read[p]) for p in range(PROCESSES)))
    assert r["rollout/samples"] == GROUP * sum(len(v) for v in read.values())
    kept = 0
    for p in range(PROCESSES):
      (train,) = [e for e in events(log_dir, p, "train") if e["step"] == step]
      groups = {tuple(s) for s in train["samples"]}
      assert len(train["samples"]) == GROUP * len(groups) and len(groups) <= 1
      sampled = {(u, e) for b in read[p] for u, e in zip(b["uids"], b["epochs"])}
      assert groups <= sampled  # trained where it was sampled
      kept += len(groups)
    assert r["rollout/groups_kept"] == kept
  assert "eval/accuracy" in records[1]

  # Request ids, hence sampling keys, never shared between hosts (nor repeated on one).
  sampled = {p: [e for e in events(log_dir, p, "generate") if not e["greedy"]]
             for p in range(PROCESSES)}
  ids = {p: [i for e in sampled[p] for i in e["ids"]] for p in range(PROCESSES)}
  assert not set(ids[0]) & set(ids[1])
  assert all(len(set(v)) == len(v) for v in ids.values())
  keys = {p: {tuple(k) for k in np.asarray(jax.random.key_data(sample_keys(
      3, np.asarray(ids[p], np.int32), np.zeros(len(ids[p]), np.int32)))).tolist()}
      for p in range(PROCESSES)}
  assert not keys[0] & keys[1]
  # The hosts' engines decoded different lengths in different numbers of steps.
  lengths = {p: [e["lengths"] for e in sampled[p]] for p in range(PROCESSES)}
  decode = {p: [e["decode_steps"] for e in sampled[p]] for p in range(PROCESSES)}
  assert lengths[0] != lengths[1] and decode[0] != decode[1], (lengths, decode)

  if spec == "histospec":
    # Every host recorded every host's groups, in the same order: identical stores.
    ends = [events(log_dir, p, "end")[-1] for p in range(PROCESSES)]
    assert ends[0]["history"] == ends[1]["history"] is not None
    assert ends[0]["history_prompts"] == 2  # both prompts, whichever host sampled them
    print("rounds per host per step:", rounds_taken)


@pytest.mark.slow
def test_balance_hosts_refuses_to_resume_hosts_left_at_different_rounds(eos_model, compile_cache,
                                                                       tmp_path):
  """--dynamic_sampling without --balance_hosts leaves the hosts at different rounds of the
  prompt stream (each refills its own slice). --balance_hosts reads whole rounds, so it cannot
  resume that checkpoint without skipping or repeating prompts: both hosts refuse with one
  clear error before anything of the run is written (rl.hosts.my_data_state)."""
  run_dir, logs = tmp_path / "run", str(tmp_path / "logs")
  flags = lambda steps, *extra: run_flags(eos_model, run_dir, f"--num_steps={steps}",
                                          "--spec=histospec", "--checkpoint_every=1",
                                          "--eval_every=0", "--dynamic_sampling",
                                          "--dynamic_sampling_max_rounds=2", *extra)
  run_pair(flags(2), logs, compile_cache)
  rounds = [len(events(logs, p, "batch")) for p in range(PROCESSES)]
  assert rounds[0] != rounds[1], rounds  # the case this test is about (seed 3: 4 and 3)
  before = {f: (run_dir / f).read_bytes() for f in ("run_config.json", "metrics.jsonl")}
  pair = Pair(flags(3, "--balance_hosts"), str(tmp_path / "balanced_logs"), compile_cache)
  assert all(code != 0 for code in pair.wait())
  for i in range(PROCESSES):
    out = pair.output(i)
    assert f"different rounds of the prompt stream ({rounds[0]}, {rounds[1]})" in out, out
    assert "resume without --balance_hosts" in out, out
  assert before == {f: (run_dir / f).read_bytes() for f in before}


@pytest.mark.slow  # two 3-step two-process runs: 190-230 s of the default suite's ~15 minutes
def test_balanced_hosts_sample_and_train_as_the_unbalanced_run(eos_model, compile_cache,
                                                               tmp_path):
  """--balance_hosts: each host reads the whole round and samples the prompts the LPT plan over
  predicted work gives it (the same plan on both hosts, no communication). The run must be the
  unbalanced run's: the same tokens sampled (request ids follow the prompt, not the host), the
  same data, rewards and groups trained on each host. A prompt is decoded in another batch
  shape, so its rollout log-probs (which the loss's importance weight reads, --tis_cap) may
  differ in their last bits (seen: an is_weight_mean of 0.99999994 against 1.0): the training
  figures and the policy are compared to float32 rounding, not bitwise."""
  flags = lambda run, *extra: run_flags(eos_model, run, "--num_steps=3", "--train_size=4",
                                        "--prompts_per_step=2", "--max_new_tokens=8",
                                        "--checkpoint_every=3", "--eval_every=0", *extra)
  logs = {name: str(tmp_path / f"{name}_logs") for name in ("plain", "balanced")}
  run_pair(flags(tmp_path / "plain"), logs["plain"], compile_cache)
  run_pair(flags(tmp_path / "balanced", "--balance_hosts"), logs["balanced"], compile_cache)

  got = read_metrics(tmp_path / "balanced" / "metrics.jsonl")
  want = read_metrics(tmp_path / "plain" / "metrics.jsonl")
  plain_keys = lambda rs: [{k: v for k, v in r.items() if not k.startswith("schedule/")}
                           for r in rs]
  assert_same_run(plain_keys(got), plain_keys(want), logs["balanced"], logs["plain"])
  assert sum(r["schedule/host_groups_moved"] for r in got) > 0  # the plan moved groups

  sampled = lambda name, p: {e["step"]: e for e in events(logs[name], p, "generate")
                             if not e["greedy"]}
  trained = lambda name, p: [e["samples"] for e in events(logs[name], p, "train")]
  for p in range(PROCESSES):  # each host trains on its own slice of the round either way
    assert trained("balanced", p) == trained("plain", p)
  moved = 0
  for step in (1, 2, 3):
    ids = {name: [sampled(name, p)[step] for p in range(PROCESSES)]
           for name in ("plain", "balanced")}
    # the same requests over both hosts (each once) with the same response lengths
    length_of = lambda es: dict(sorted((i, n) for e in es for i, n in zip(e["ids"],
                                                                        e["lengths"])))
    assert length_of(ids["balanced"]) == length_of(ids["plain"])
    assert sum(len(e["ids"]) for e in ids["balanced"]) == PROCESSES * 2 * GROUP
    moved += ids["balanced"][0]["ids"] != ids["plain"][0]["ids"]
  assert moved  # some step's hosts sampled other prompts than their slices
  # both hosts read every prompt of the round: the whole stream, in order, once per host
  for p in range(PROCESSES):
    taken = [pos for b in events(logs["balanced"], p, "batch") for pos in b["positions"]]
    assert taken == list(range(3 * PROCESSES * 2))


@pytest.mark.slow
def test_balanced_hosts_refill_dynamic_sampling_rounds_together(eos_model, compile_cache,
                                                                tmp_path):
  """--balance_hosts with --dynamic_sampling: the refill is global. Both hosts read the same
  rounds, train on distinct groups (as many as all hosts kept) and agree on the policy."""
  logs = str(tmp_path / "logs")
  run_pair(run_flags(eos_model, tmp_path / "run", "--num_steps=3", "--train_size=4",
                     "--prompts_per_step=2", "--max_new_tokens=8", "--checkpoint_every=3",
                     "--eval_every=0", "--balance_hosts", "--dynamic_sampling",
                     "--dynamic_sampling_max_rounds=2"), logs, compile_cache)
  reads = [[b["positions"] for b in events(logs, p, "batch")] for p in range(PROCESSES)]
  assert reads[0] == reads[1]
  a, b = params(logs, 0), params(logs, 1)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  records = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert sum(r["rollout/rounds"] for r in records) == len(reads[0]) > 3  # some step refilled
  for step, r in zip((1, 2, 3), records):
    groups = [tuple(map(tuple, e["samples"][::GROUP])) for p in range(PROCESSES)
              for e in events(logs, p, "train") if e["step"] == step]
    flat = [g for host in groups for g in host]
    assert len(flat) == len(set(flat)) == r["rollout/groups_kept"]


def params_of_model(model_dir):
  """The tiny model's initial parameters, keyed like `multihost_entry`'s dump."""
  import jax
  from flax import nnx
  from rhyme_jax.models.loading import load_model
  model, _ = load_model(model_dir)
  leaves = jax.tree_util.tree_leaves_with_path(nnx.split(model)[1])
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _wait_for_step(metrics, step, pair, timeout=600):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics)):
      return
    assert all(p.poll() is None for p in pair.procs), "a process ended before the signal"
    time.sleep(0.2)
  raise AssertionError(f"step {step} not logged in {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [
    (),  # each host reads and samples its own slice
    # each host reads whole rounds and samples its LPT share, refilled globally: the plan is
    # made from the history store, so a resumed run must restore the store exactly
    ("--balance_hosts", "--dynamic_sampling", "--dynamic_sampling_max_rounds=2"),
], ids=["slices", "balanced"])
def test_sigterm_and_sigkill_of_both_processes_resume_as_uninterrupted(eos_model, compile_cache,
                                                                      tmp_path, hosts):
  """SIGTERM to one process stops both at the same step boundary with a checkpoint; a SIGKILL
  of both later; each rerun resumes. The run's metrics (every host's data and samples, and with
  --balance_hosts the plan's figures) and its final policy equal an uninterrupted run's
  (training figures and policy to float32 rounding: `assert_same_run`)."""
  flags = lambda run: run_flags(eos_model, run, "--num_steps=5", "--checkpoint_every=1",
                                "--spec=histospec", "--keep_checkpoints=2", *hosts)
  ref_logs = str(tmp_path / "ref_logs")
  run_pair(flags(tmp_path / "ref"), ref_logs, compile_cache)

  run_dir, logs = tmp_path / "run", str(tmp_path / "logs")
  metrics = run_dir / "metrics.jsonl"
  pair = Pair(flags(run_dir), logs, compile_cache)
  _wait_for_step(metrics, 1, pair)
  pair.procs[1].send_signal(signal.SIGTERM)  # one host only: both must stop together
  assert pair.wait() == [0, 0], pair.output(0) + pair.output(1)
  stopped = max(r["step"] for r in read_metrics(metrics))
  assert stopped < 5
  for i in range(PROCESSES):
    assert f"stopped at step {stopped} (checkpoint saved)" in pair.output(i)

  pair = Pair(flags(run_dir), logs, compile_cache)  # resume, then SIGKILL both mid-run
  _wait_for_step(metrics, stopped + 1, pair)
  pair.kill()
  killed_at = max(r["step"] for r in read_metrics(metrics))
  assert killed_at < 5

  pair = run_pair(flags(run_dir), logs, compile_cache)
  assert all("resumed from" in pair.output(i) for i in range(PROCESSES))
  got, want = read_metrics(metrics), read_metrics(tmp_path / "ref" / "metrics.jsonl")
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
  assert_same_run(got, want, logs, ref_logs)  # same data, same samples, same updates
  # Taken over the three attempts, the stream positions of the final run's steps are those of
  # the uninterrupted run: nothing skipped, nothing repeated.
  def positions(log_dir):
    by_step = {}
    for p in range(PROCESSES):
      for b in events(log_dir, p, "batch"):
        by_step[b["step"]] = by_step.get(b["step"], []) + b["positions"]
    return by_step
  assert {k: sorted(v) for k, v in positions(ref_logs).items()} == {
      k: sorted(v) for k, v in _last_attempt_positions(logs).items()}


def _last_attempt_positions(log_dir):
  """Per step, the positions taken by the attempt whose result stands: a step redone after a
  kill counts once, with its last attempt's batches."""
  by_step: dict[int, dict[int, list]] = {}
  for p in range(PROCESSES):
    attempt = 0
    for e in events(log_dir, p):
      if e["kind"] == "start":
        attempt += 1
      elif e["kind"] == "batch":
        by_step.setdefault(e["step"], {}).setdefault(attempt, [])
        by_step[e["step"]][attempt] = by_step[e["step"]].get(attempt, []) + e["positions"]
  # `attempt` is per process; both processes start each attempt together.
  return {step: runs[max(runs)] for step, runs in by_step.items()}


@pytest.mark.slow
def test_a_process_that_fails_alone_does_not_leave_the_run_hanging(eos_model, tmp_path):
  """Process 1's reward raises mid-step while process 0 waits in the step's exchange. Process 1
  prints the traceback and exits at once (rhyme_jax.main: no jax.distributed shutdown barrier
  that process 0 never reaches); jax.distributed then stops process 0 (a heartbeat timeout).
  Before, both waited: process 1 in the shutdown barrier, process 0 in the exchange."""
  port = _free_port()
  flags = run_flags(eos_model, tmp_path / "run", "--num_steps=2", "--eval_every=0")
  outs = [open(tmp_path / f"out{i}.txt", "w") for i in range(PROCESSES)]
  procs = []
  for i in range(PROCESSES):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [REPO, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               **({"RHYME_JAX_TEST_REWARD_RAISES": "1"} if i == 1 else {}))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, "train_entry.py"), *flags,
         f"--coordinator_address=localhost:{port}", f"--num_processes={PROCESSES}",
         f"--process_id={i}"], cwd=REPO, env=env, stdout=outs[i], stderr=subprocess.STDOUT))
  try:
    procs[1].wait(timeout=400)
    procs[0].wait(timeout=240)  # jax.distributed's heartbeat timeout is 100 s
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in outs:
      f.close()
  out1 = (tmp_path / "out1.txt").read_text()
  assert procs[1].returncode == 1 and "this process's reward fails" in out1, out1[-3000:]
  assert procs[0].returncode != 0, (tmp_path / "out0.txt").read_text()[-3000:]

