"""bench/schedsim.py: reading recorded rollouts (.npz) and JSONL traces, and one full run on a
small trace (every policy and scenario; the simulator's token check runs inside)."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import schedsim  # noqa: E402


def _write_recording(path, epoch, lengths_PxG, keys):
  p, g = lengths_PxG.shape
  np.savez(path, tokens=np.zeros(int(lengths_PxG.sum()), np.int32),
           lengths=lengths_PxG.reshape(-1).astype(np.int64),
           request_ids=np.arange(p * g, dtype=np.int64),
           prompt_index=np.repeat(np.arange(p), g).astype(np.int64),
           finish=np.array(["eos"] * (p * g)), prompt_tokens=np.zeros(10 * p, np.int32),
           prompt_lengths=np.full(p, 10, np.int64), prompt_keys=np.array(keys),
           meta_json=json.dumps({"epoch": epoch, "temperature": 0.6}))


def test_npz_and_jsonl_traces_round_trip(tmp_path):
  rng = np.random.default_rng(0)
  keys = [f"k{i}" for i in range(6)]
  lengths = [rng.integers(5, 90, (6, 4)) for _ in range(2)]
  for e in range(2):
    _write_recording(tmp_path / f"gsm8k_T0.6_e{e}_p0-6.npz", e, lengths[e], keys)
  trace = schedsim.load_npz_trace(str(tmp_path / "gsm8k_T0.6_e*.npz"))
  assert trace.keys == keys and trace.epochs == [0, 1] and trace.prompt_len == [10] * 6
  for i in range(6):
    np.testing.assert_array_equal(trace.lengths[i][1], lengths[1][i])
  schedsim.write_trace(trace, str(tmp_path / "t.jsonl"))
  again = schedsim.load_trace(str(tmp_path / "t.jsonl"))
  assert again.keys == trace.keys
  assert all((a[e] == b[e]).all() for a, b in zip(again.lengths, trace.lengths) for e in (0, 1))
  one = schedsim.load_npz_trace(str(tmp_path / "gsm8k_T0.6_e0*.npz"))
  halves = schedsim.split_groups(one)
  assert halves.epochs == [0, 1]
  np.testing.assert_array_equal(halves.lengths[2][1], lengths[0][2][2:])
  assert trace.name == "gsm8k_T0.6_e*.npz (2 files)"
  assert schedsim.load_npz_trace(str(tmp_path / "*.npz")).name == \
      f"{tmp_path.name}/*.npz (2 files)"  # a wildcard alone is named by its folder
  with pytest.raises(ValueError, match="no files match"):
    schedsim.load_npz_trace(str(tmp_path / "nothing*.npz"))
  (tmp_path / "bad.jsonl").write_text('{"prompt_key": "a"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1"):
    schedsim.load_trace(str(tmp_path / "bad.jsonl"))


def _is_detail(cells) -> bool:
  """A row of the per-policy detail table (15 cells, the policy's name sixth)."""
  return len(cells) == 15 and cells[5] in schedsim.POLICIES


def _is_bounds(cells) -> bool:
  """A row of divided rollout's references: 5 label cells, then a ratio and a tail cut per
  reference (`BOUNDS`)."""
  return len(cells) == 5 + 2 * len(schedsim.BOUNDS) and not _is_detail(cells)


def test_full_run_on_a_small_trace(tmp_path, capsys):
  trace = schedsim.synthetic_trace(3, num_prompts=8, group_size=4, max_new_tokens=64)
  schedsim.write_trace(trace, str(tmp_path / "small.jsonl"))
  schedsim.main(["--trace", str(tmp_path / "small.jsonl"), "--max_new_tokens", "64",
                 "--blind_draws", "3", "--no_append"])
  out = capsys.readouterr().out
  lines = [line.split(" | ") for line in out.splitlines() if line.startswith("| small")]
  kinds = {"cross-step": lambda c: len(c) == 6, "per-prompt": lambda c: len(c) == 12,
           "references": _is_bounds, "detail": _is_detail, "summary": lambda c: len(c) == 21}
  by_kind = {k: sum(map(is_kind, lines)) for k, is_kind in kinds.items()}
  scenarios = schedsim.scenarios(schedsim.argparse.Namespace(
      accepted=1.7, budget=16, plans="data_order,lpt_history,lpt_oracle"), 32, 16)
  full = [sc for sc in scenarios if sc.shards == 1 and sc.shrink and sc.accepted == 1]
  # Tables: cross-step (6 cells); detail (15, a policy per row); the per-prompt bound (12, one
  # row per table); summary (21); divided rollout's references (one shard, KV kept: chunk at
  # launch 1 and engine-like).
  divided = [sc for sc in full if sc.chunk and sc.keep_kv and not sc.kv_rows]
  assert len(divided) == 5
  assert by_kind == {"cross-step": 8, "references": len(divided), "per-prompt": 2,
                     "detail": len(full) * len(schedsim.POLICIES), "summary": len(scenarios)}
  # Divided rollout: only the online orders yield (a static order's "yield" resumes in place).
  yields = {(r[3], r[4], r[5]): int(r[10]) for r in lines if _is_detail(r)}
  passes = {(r[3], r[4], r[5]): int(r[11]) for r in lines if _is_detail(r)}
  assert all(0 < passes[k] <= n or passes[k] == n == 0 for k, n in yields.items())
  online = {"probe", "history_probe", "history_residual"}
  assert all(n == 0 for (chunk, _, pol), n in yields.items() if chunk == "-" or pol not in online)
  assert any(n > 0 for (chunk, _, pol), n in yields.items() if chunk != "-")
  # The engine-like scenarios (outputs read a launch late; 4 steps per launch on the h100 table)
  assert {launch for _, launch, _ in yields} == {"1", "4 piped", "4 piped, drain 1", "1 piped"}
  assert any(n > 0 for (chunk, launch, _), n in yields.items() if launch == "4 piped")
  assert len(lines) == sum(by_kind.values())
  # 32 requests: slots scale to 16 (h100) / 8 (cpu), chunk min(64, 64 / 4) = 16.
  assert {(r[1], r[2]) for r in lines if len(r) == 21} >= {("h100", "1x16"), ("cpu", "1x8")}
  assert "targets, small.jsonl" in out and "16 kv 2x" in out


@pytest.mark.parametrize("bad", ["8", "8,x", "0,4", "8,4,2"])
def test_bad_slots_flag_is_one_clear_error(bad, capsys):
  with pytest.raises(SystemExit):
    schedsim.main(["--slots", bad, "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--slots" in err and repr(bad) in err


@pytest.mark.parametrize("flag", ["--yield_ms", "--yield_pass_ms"])
@pytest.mark.parametrize("bad", ["0.3", "0.3,x", "-1,2"])
def test_bad_yield_cost_flags_are_one_clear_error(flag, bad, capsys):
  with pytest.raises(SystemExit):
    schedsim.main([f"{flag}={bad}", "--no_append"])
  err = capsys.readouterr().err
  assert flag in err and repr(bad) in err


@pytest.mark.parametrize("bad", ["0", "-1", "x", "inf"])
def test_bad_told_cost_is_one_clear_error(bad, capsys):
  with pytest.raises(SystemExit):
    schedsim.main([f"--told_cost={bad}", "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--told_cost" in err and repr(bad) in err


def _small_run(tmp_path, capsys, seed: int, *flags) -> list[list[str]]:
  """The table rows of schedsim on a small synthetic trace (8 prompts x 4, 64-token cap)."""
  trace = schedsim.synthetic_trace(seed, num_prompts=8, group_size=4, max_new_tokens=64)
  schedsim.write_trace(trace, str(tmp_path / "small.jsonl"))
  schedsim.main(["--trace", str(tmp_path / "small.jsonl"), "--max_new_tokens", "64",
                 "--blind_draws", "0", *flags, "--no_append"])
  return [line.split(" | ") for line in capsys.readouterr().out.splitlines()
          if line.startswith("| small")]


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "x", "median"])
def test_bad_residual_quantile_is_one_clear_error(bad, capsys):
  with pytest.raises(SystemExit):
    schedsim.main([f"--residual_quantile={bad}", "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--residual_quantile" in err and repr(bad) in err


def test_residual_quantile_reaches_history_residual_and_its_references(tmp_path, capsys):
  """--residual_quantile mean and 0.75 give history_residual different schedules on a trace
  with spread-out lengths, in the policy rows and the divided-rollout reference rows alike
  (whose history_residual column repeats the policy row's ratio)."""
  got = {}
  for q in ("mean", "0.75"):
    rows = _small_run(tmp_path, capsys, 5, "--residual_quantile", q)
    # (table, chunk, launch) -> makespan / oracle, and its yields
    detail = {(r[1], r[3], r[4]): (r[12], r[10]) for r in rows
              if _is_detail(r) and r[5] == "history_residual" and r[3] != "-"}
    bounds = {(r[1], r[3], r[4]): r[5] for r in rows if _is_bounds(r)}
    assert bounds and all(detail[k][0] == v for k, v in bounds.items())
    got[q] = detail
  assert got["mean"] != got["0.75"]


def test_told_cost_scales_the_margin_history_residual_yields_to(tmp_path, capsys):
  """--told_cost multiplies the yield cost the order weighs: told a far dearer yield,
  history_residual yields less often (its margin grows with the cost)."""
  yields = {}
  for told in ("1", "10000"):
    rows = _small_run(tmp_path, capsys, 3, "--told_cost", told)
    yields[told] = sum(int(r[10]) for r in rows if _is_detail(r) and r[5] == "history_residual")
  assert yields["10000"] < yields["1"]


@pytest.mark.parametrize("bad", ["x", "gpu=t.json", "cpu=missing.json", "cpu=bad.json"])
def test_bad_table_flag_is_one_clear_error(bad, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "bad.json").write_text('[{"bucket": 8, "ms": 2.0}]')  # no budget
  with pytest.raises(SystemExit):
    schedsim.main([f"--table={bad}", "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--table" in err and repr(bad) in err


def test_table_flag_replaces_that_table_only(tmp_path, monkeypatch, capsys):
  """--table cpu=PATH: every simulation that ran on the built-in cpu table runs on the file's
  step times instead, the h100 ones on the built-in h100 table still; and the results move."""
  path = tmp_path / "flat.json"
  path.write_text('[{"bucket": 1, "budget": 0, "ms": 10.0}, '
                  '{"bucket": 64, "budget": 0, "ms": 10.0}]')
  base = _small_run(tmp_path, capsys, 5)
  seen = []
  real = schedsim.simulate
  monkeypatch.setattr(schedsim, "simulate", lambda jobs, factory, table, cfg, plan=None: (
      seen.append((table.name, table.ms(8, 0))) or real(jobs, factory, table, cfg, plan)))
  flat = _small_run(tmp_path, capsys, 5, f"--table=cpu={path}")
  assert {name for name, _ in seen} == {"h100", str(path)}
  assert all(ms == 10.0 for name, ms in seen if name == str(path))
  detail = lambda rows, table: [r for r in rows if _is_detail(r) and r[1] == table]
  assert detail(flat, "h100") == detail(base, "h100") and detail(base, "h100")
  assert detail(flat, "cpu") != detail(base, "cpu")
