"""bench/quantile_rehearsal.py: the rehearsal a run would choose history_residual's quantile
by (a step's requests at their prompts' newest kept lengths), the pick, and one full run."""

import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import quantile_rehearsal  # noqa: E402
import schedsim  # noqa: E402
from bench.schedsim_grpo import StepCase  # noqa: E402
from rhyme_jax.scheduling.admission import RESIDUAL_QUANTILE, RequestMeta  # noqa: E402
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable  # noqa: E402


def _case(history: dict, group: int = 3) -> StepCase:
  """Prompts k0.. with `group` samples each, interleaved in data order; `history`:
  {key: [(epoch, lengths)]} in the case's table (2 epochs kept)."""
  keys = sorted({k for k in history} | {"k0", "k1"})
  table = LengthTable(epochs_kept=2)
  for key, epochs in history.items():
    for epoch, lengths in epochs:
      table.add(key, epoch, lengths)
  jobs = []
  for j in range(group):  # data order interleaves the prompts: the rehearsal must keep it
    for p, key in enumerate(keys):
      rid = len(jobs)
      jobs.append((RequestMeta(rid, p, key, rid, 64), 50 + rid))
  return StepCase("t", 1, 2, jobs, LengthPredictor(table), table)


def test_rehearsal_replays_the_newest_kept_lengths_in_data_order():
  case = _case({"k0": [(0, [9, 9, 9]), (1, [4, 7, 0])], "k1": [(1, [30, 20, 10])]})
  jobs = quantile_rehearsal.rehearsal_jobs(case)
  assert [m for m, _ in jobs] == [m for m, _ in case.jobs]  # same requests, same order
  by_prompt = {}
  for m, n in jobs:
    by_prompt.setdefault(m.prompt_key, []).append(n)
  # the newest kept epoch only (k0's epoch 0 is kept too), i-th sample the i-th length, >= 1
  assert by_prompt == {"k0": [4, 7, 1], "k1": [30, 20, 10]}


def test_rehearsal_cycles_a_shorter_history_and_refuses_a_prompt_without_one():
  jobs = quantile_rehearsal.rehearsal_jobs(_case({"k0": [(1, [5, 6])], "k1": [(1, [8])]}, 3))
  assert sorted(n for m, n in jobs if m.prompt_key == "k0") == [5, 5, 6]
  assert [n for m, n in jobs if m.prompt_key == "k1"] == [8, 8, 8]
  assert quantile_rehearsal.rehearsal_jobs(_case({"k0": [(1, [5, 6, 7])]})) is None


def _result(makespan, tail):
  return types.SimpleNamespace(makespan_ms=makespan, tail_ms=tail)


def test_pick_scores_the_rehearsal_and_breaks_ties_toward_the_default():
  case = _case({"k0": [(1, [5, 6, 7])], "k1": [(1, [1, 2, 3])]})
  seen = []

  def sim(jobs, q):
    seen.append((q, sorted(n for _, n in jobs)))
    return {0.5: _result(10, 1), 0.75: _result(10, 3), 0.9: _result(12, 0)}[q]

  pick = quantile_rehearsal.pick_quantile
  assert pick(case, (0.5, 0.75, 0.9), sim, "makespan") == 0.5  # equal makespans: the tail
  assert pick(case, (0.5, 0.75, 0.9), sim, "tail") == 0.9
  # every candidate rehearses the history's lengths, never the step's true ones (50 + rid)
  assert {tuple(lens) for _, lens in seen} == {(1, 2, 3, 5, 6, 7)}
  tie = lambda jobs, q: _result(10, 1)
  assert pick(case, (0.5, 0.9, RESIDUAL_QUANTILE), tie, "tail") == RESIDUAL_QUANTILE
  assert pick(_case({}), (0.5, 0.9), sim, "tail") == RESIDUAL_QUANTILE  # nothing to rehearse


def test_full_run_on_a_small_trace(tmp_path, capsys):
  trace = schedsim.synthetic_trace(3, num_prompts=8, group_size=4, max_new_tokens=64)
  schedsim.write_trace(trace, str(tmp_path / "small.jsonl"))
  quantile_rehearsal.main(["--trace", str(tmp_path / "small.jsonl"), "--max_new_tokens", "64",
                           "--quantiles", "0.5,0.9", "--no_append"])
  rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
          if line.startswith("| small")]
  # the divided, KV-kept, one-shard scenarios: h100 / cpu at one step per launch, engine-like
  assert [(r[1], r[4]) for r in rows] == [("h100", "1"), ("cpu", "1"), ("h100", "4 piped"),
                                           ("h100", "4 piped, drain 1"), ("cpu", "1 piped")]
  for r in rows:
    ratios = [float(cell.split(",")[0]) for cell in r[6:10]]
    assert all(0.5 < x < 2 for x in ratios)
    picks = r[10].rstrip(" |").split("; ")
    assert [p.split(":")[0] for p in picks] == ["makespan", "tail"]
    for p in picks:  # one trace step: one pick per selector, among the candidates
      assert p.split(": ")[1] in ("0.5x1", "0.9x1")


@pytest.mark.parametrize("flag,bad", [("--quantiles", "0.5,1"), ("--quantiles", "x"),
                                      ("--select", "median")])
def test_bad_flags_are_one_clear_error(flag, bad, capsys):
  with pytest.raises(SystemExit):
    quantile_rehearsal.main(["--trace", "synthetic", f"{flag}={bad}", "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert flag in err and repr(bad) in err
