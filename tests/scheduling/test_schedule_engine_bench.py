"""bench/schedule_engine.py's flags (a bad value is one line naming the flag, before any model
is loaded), its per-repeat figures, and bench/engine_timeline.py's reading of the step
timeline."""

import os
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import engine_timeline, schedule_engine  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--compile_threads=-1"], "--compile_threads=-1: must be >= 0"),
    (["--park_rows=-2"], "--park_rows=-2: must be >= 0"),
    (["--slots=0"], "--slots=0: must be >= 1"),
    (["--multi_step=0"], "--multi_step=0: must be >= 1"),
    (["--policies=fifo,lifo"], "--policies: 'lifo' is not one of"),
    (["--residual_quantile=1.5"], "--residual_quantile: '1.5': must be in (0, 1)"),
])
def test_bad_flag_is_one_line_naming_it(argv, message, capsys):
  with pytest.raises(SystemExit):
    schedule_engine.parse_args(argv)
  assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_good_flags_parse():
  args = schedule_engine.parse_args(["--compile_threads=8", "--policies=fifo,oracle",
                                     "--multi_step=4"])
  assert args.compile_threads == 8 and args.policies == ["fifo", "oracle"]
  assert args.multi_step == 4
  assert schedule_engine.parse_args(["--residual_quantile=0.9"]).residual_quantile == 0.9
  assert schedule_engine.parse_args(["--residual_quantile=mean"]).residual_quantile is None


def test_excess_by_event_splits_wall_time_beyond_warm_up_by_what_came_before():
  """Each step's interval (previous outputs to its own) minus its shape's warm-up time lands
  in one bin: after prefill (the first step, or new requests admitted, yields or not), after
  yields only (parks or resumes, no prefill), or plain; a multi-step launch against its steps'
  warm-up times."""
  warm = {"a": 1.0, "b": 2.0}
  timeline = [(1.5, "a", 0, 0, 0, 0.5, 1),    # first step: prefill, +0.5
              (2.5, "a", 0, 0, 0, 0.1, 1),    # plain, 0
              (4.75, "b", 2, 0, 1, 0.4, 1),   # yields only, +0.25
              (6.0, "a", 1, 3, 0, 0.3, 1),    # prefill with a yield: prefill, +0.25
              (6.9, "a", 0, 0, 0, 0.2, 1)]    # plain, -0.1
  got = engine_timeline.excess_by_event(timeline, warm)
  assert got == pytest.approx(dict(plain=-0.1, prefill=0.75, yields=0.25))
  four = timeline[:1] + [(6.5, "a", 0, 0, 0, 0.1, 4)]  # 4 plain steps in 5 s: +1
  assert engine_timeline.excess_by_event(four, warm)["plain"] == pytest.approx(1.0)
  host = engine_timeline.host_by_event(timeline)
  assert host == pytest.approx(dict(plain=0.15, prefill=0.4, yields=0.4))
  assert np.isnan(engine_timeline.host_by_event(timeline[:2])["yields"])


def test_a_profile_path_that_is_a_file_is_one_line_naming_it(tmp_path, capsys):
  path = tmp_path / "a_file"
  path.write_text("")
  with pytest.raises(SystemExit):
    schedule_engine.parse_args([f"--profile={path}"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"--profile={path}: exists and is not a directory" in err
  assert schedule_engine.parse_args([f"--profile={tmp_path}"]).profile == str(tmp_path)


def test_modelled_finish_puts_each_response_at_the_modelled_end_of_its_step():
  """A response finishes while its step's outputs are read (after the step's timeline entry):
  its modelled finish is the warm-up time of every launch up to that one, each launch's steps
  at their shape's time, plus the yields' copies dispatched before them (fixed per pass that
  yields, and per yield)."""
  import types
  warm = {"a": 1.0, "b": 2.0}
  cost = types.SimpleNamespace(fixed=0.5, per_row=0.25)
  timeline = [(1.1, "a", 0, 4, 0, 0.1, 1),   # 1
              (2.3, "b", 2, 0, 0, 0.1, 1),   # 2 + 0.5 + 2 x 0.25 = 3
              (9.0, "a", 0, 0, 1, 0.1, 4),   # 4 steps: 4
              (9.9, "a", 0, 0, 0, 0.1, 1)]   # 1
  finish = np.array([1.15, 2.31, 9.5, 9.0, 9.95])  # read in entries 0, 1, 2, 2, 3
  got = engine_timeline.modelled_finish(timeline, warm, cost, finish)
  assert got == pytest.approx([1.0, 4.0, 8.0, 8.0, 9.0])


def test_host_parts_split_host_time_per_step():
  """Dispatch, admissions, yields and reading per decode step; `other` is what is left of the
  host time; CPU is the thread's own time, apart."""
  from rhyme_jax.rollout.interface import EngineStats
  st = EngineStats(steps=10, total_time_s=1.0, device_time_s=0.4, dispatch_time_s=0.2,
                   prefill_time_s=0.1, yield_time_s=0.05, read_time_s=0.15, cpu_time_s=0.5)
  got = engine_timeline.host_parts_ms(st)
  assert got == pytest.approx(dict(dispatch=20.0, admit=10.0, yields=5.0, read=15.0,
                                   other=10.0, CPU=50.0))
  assert tuple(got) == engine_timeline.HOST_PARTS


def test_profiled_names_the_busiest_function():
  def busy():
    return sum(i * i for i in range(200_000))
  from bench import common  # schedule_engine --profile and engine_overhead --profile use it
  text = common.profiled(busy, "a title", top=5)
  assert text.startswith("a title\n") and "busy" in text and "genexpr" in text


def test_gpu_script_names_a_missing_input_and_passes_shellcheck(tmp_path):
  """bench/gpu_schedule.sh (the GPU run of these benches) stops on a missing MODEL or data
  directory with one line naming it, before it runs or writes anything."""
  import shutil
  import subprocess
  script = os.path.join(ROOT, "bench", "gpu_schedule.sh")
  env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "RHYME_JAX_GSM8K_DIR")}
  out = tmp_path / "out"
  for extra, missing in (({}, "MODEL"), ({"MODEL": "m.gguf"}, "RHYME_JAX_GSM8K_DIR")):
    r = subprocess.run(["bash", script], env={**env, **extra, "OUT": str(out)},
                       capture_output=True, text=True)
    assert r.returncode != 0 and missing in r.stderr.strip().splitlines()[-1]
    assert not out.exists()
  if shutil.which("shellcheck"):
    r = subprocess.run(["shellcheck", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_by_repeat_pairs_each_policy_with_the_same_repeats_references():
  """Makespan / oracle and tail cut vs FIFO within each repeat, never across repeats (the
  fastest-run table may pair runs of different repeats), and their median in the notes."""
  row = lambda makespan, tail: dict(makespan=makespan, tail=tail, modelled_tail=tail / 2)
  reps = [dict(fifo=row(10.0, 2.0), divided=row(9.0, 0.4), oracle=row(9.0, 0.5)),
          dict(fifo=row(11.0, 1.0), divided=row(10.0, 0.5), oracle=row(8.0, 0.2)),
          dict(fifo=row(10.0, 4.0), divided=row(8.0, 0.4), oracle=row(8.0, 1.0))]
  got = schedule_engine.by_repeat(reps, ["fifo", "divided", "oracle"])
  assert got["divided"]["makespan / oracle"] == pytest.approx([1.0, 1.25, 1.0])
  assert got["divided"]["tail cut vs fifo"] == pytest.approx([0.8, 0.5, 0.9])
  assert got["oracle"]["tail cut vs fifo"] == pytest.approx([0.75, 0.8, 0.75])
  assert got["divided"]["modelled tail cut vs fifo"] == pytest.approx([0.8, 0.5, 0.9])
  lines = schedule_engine.describe_repeats(got)
  assert ("divided, tail cut vs fifo by repeat (same repeat's runs): 80%, 50%, 90%; median 80%"
          in lines)
  assert ("divided, makespan / oracle by repeat (same repeat's runs): 1.000, 1.250, 1.000; "
          "median 1.000" in lines)
  assert not any(line.startswith(("oracle, makespan", "fifo, tail")) for line in lines)
  assert schedule_engine.describe_repeats(schedule_engine.by_repeat(reps[:1], ["divided"])) == []


def test_written_trace_replays_each_prompts_lengths_by_epoch(tmp_path, capsys):
  """--write_trace: epoch 0's and 1's lengths per prompt, in request order, read back by the
  simulator's trace loader; a path in a missing directory is a one-line error first."""
  from bench.schedsim_traces import load_trace, write_trace
  res = lambda n: types.SimpleNamespace(tokens=[7] * n)
  first = [res(n) for n in (3, 5, 8, 2)]  # prompt a: 3, 5; prompt b: 8, 2
  second = [res(n) for n in (4, 4, 1, 9)]
  path = str(tmp_path / "t.jsonl")
  write_trace(schedule_engine.lengths_trace(path, ["a", "b"], [11, 12], {0: first, 1: second},
                                            2), path)
  got = load_trace(path)
  assert got.keys == ["a", "b"] and got.prompt_len == [11, 12]
  assert [{e: v.tolist() for e, v in per.items()} for per in got.lengths] == [
      {0: [3, 5], 1: [4, 4]}, {0: [8, 2], 1: [1, 9]}]
  with pytest.raises(SystemExit):
    schedule_engine.parse_args([f"--write_trace={tmp_path}/missing/t.jsonl"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--write_trace" in err and "does not exist" in err


def test_step_times_are_the_plain_steps_at_the_long_cache_as_a_table(tmp_path):
  """--write_step_times: each bucket's plain step (packed = bucket, one token per row) at the
  given cache length, in ms, readable as the simulator's step-time table."""
  import json
  from rhyme_jax.scheduling.step_time import StepTimeTable
  warm = {(4, 4, 1, 256): 0.040, (4, 4, 1, 128): 0.030, (2, 2, 1, 256): 0.025,
          (1, 1, 1, 256): 0.020, (4, 12, 3, 256): 0.090}  # the last: a speculative shape
  rows = schedule_engine.step_times(warm, (4, 2, 1), 256)
  assert rows == [{"bucket": 4, "budget": 0, "ms": 40.0}, {"bucket": 2, "budget": 0, "ms": 25.0},
                  {"bucket": 1, "budget": 0, "ms": 20.0}]
  (tmp_path / "t.json").write_text(json.dumps(rows))
  table = StepTimeTable.from_file(str(tmp_path / "t.json"))
  assert table.ms(2, 0) == pytest.approx(25.0) and table.ms(3, 0) == pytest.approx(32.5)
