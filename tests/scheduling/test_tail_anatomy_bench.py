"""bench/tail_anatomy.py: which requests make a rollout's tail, the launches they end in, and
one full run whose rows agree with the simulator's own figures."""

import os
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import schedsim  # noqa: E402
import tail_anatomy  # noqa: E402


def test_tail_members_are_those_after_the_first_ninety_percent():
  finish = np.array([5.0, 1, 2, 3, 4, 6, 7, 8, 9, 30, 20])  # 11 requests: 10 make the 90%
  assert list(tail_anatomy.tail_members(finish)) == [9]  # only 30 ends after 20
  # requests ending together with the 90th percentile are not the tail (tail_time measures
  # from that time): here nothing ends after it
  assert len(tail_anatomy.tail_members(np.array([1.0] * 8 + [4.0, 4.0]))) == 0


def test_anatomy_counts_launch_ends_and_capped_requests():
  # 20 requests: the first 18 end by t=10; the tail is the two after it, in one launch end
  finish = np.array([float(t) for t in range(1, 19)] + [40.0, 40.0])
  lengths = np.array([10] * 18 + [64, 50])
  caps = np.full(20, 64)
  res = types.SimpleNamespace(finish_ms=finish)
  assert tail_anatomy.anatomy(res, lengths, caps) == (1, 2, 1)
  finish[-1] = 44.0  # now they end in two launches
  assert tail_anatomy.anatomy(res, lengths, caps) == (2, 2, 1)


def test_full_run_on_a_small_trace(tmp_path, capsys):
  trace = schedsim.synthetic_trace(3, num_prompts=8, group_size=4, max_new_tokens=64)
  schedsim.write_trace(trace, str(tmp_path / "small.jsonl"))
  tail_anatomy.main(["--trace", str(tmp_path / "small.jsonl"), "--max_new_tokens", "64",
                     "--no_append"])
  rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
          if line.startswith("| small")]
  col = {name: i for i, name in enumerate(tail_anatomy.HEADER)}
  # the divided, KV-kept, one-shard scenarios, each order once
  scen = [(r[col["table"]], r[col["launch"]]) for r in rows]
  assert scen == [(s, l) for s, l in [("h100", "1"), ("cpu", "1"), ("h100", "4 piped"),
                                      ("h100", "4 piped, drain 1"), ("cpu", "1 piped")]
                  for _ in tail_anatomy.ORDERS]
  for r in rows:
    if r[col["order"]] == "fifo":  # its own cut: none, or undefined where its tail is 0
      for ms, cut in (("tail ms", "tail cut vs fifo"),
                      ("step-clock tail ms", "step-clock tail cut")):
        assert r[col[cut]] == ("0%" if float(r[col[ms]]) else "-")
    if r[col["order"]] == "oracle":
      assert r[col["makespan / oracle"]] == "1.000"
    if r[col["launch"]] == "1":  # one step per launch: the two clocks agree
      assert r[col["tail ms"]] == r[col["step-clock tail ms"]]
    # 32 requests: at most 3 (10%) end after the first 29, in at most as many launches
    members = float(r[col["tail requests / step"]])
    assert 0 <= float(r[col["tail launches / step"]]) <= members <= 3


@pytest.mark.parametrize("group_size", [1, 4])
def test_shuffle_draws_spread_the_figures_over_redrawn_rollouts(tmp_path, capsys, group_size):
  # Groups of one have nothing to shuffle: every redraw is the trace itself, so min, median
  # and max are the row's own figures. In groups of four FIFO's cut stays 0 and the oracle's
  # makespan ratio 1 in every draw.
  trace = schedsim.synthetic_trace(3, num_prompts=32 // group_size, group_size=group_size,
                                   max_new_tokens=64)
  schedsim.write_trace(trace, str(tmp_path / "small.jsonl"))
  tail_anatomy.main(["--trace", str(tmp_path / "small.jsonl"), "--max_new_tokens", "64",
                     "--shuffle_draws", "3", "--no_append"])
  out = capsys.readouterr().out.splitlines()
  header = next(line for line in out if line.startswith("| trace")).strip("| ").split(" | ")
  col = {name: i for i, name in enumerate(header)}
  rows = [line.strip("| ").split(" | ") for line in out if line.startswith("| small")]
  assert len(rows) == 5 * len(tail_anatomy.ORDERS)
  for r in rows:
    cuts = r[col["tail cut over shuffles (min / median / max)"]].split(" / ")
    ratios = r[col["makespan / oracle over shuffles"]].split(" / ")
    assert len(cuts) == len(ratios) == 3
    if group_size == 1:
      assert ratios == [r[col["makespan / oracle"]]] * 3
      assert cuts == [r[col["tail cut vs fifo"]]] * 3
    if r[col["order"]] == "fifo":
      assert set(cuts) <= {"0%", "-"}
    if r[col["order"]] == "oracle":
      assert ratios == ["1.000"] * 3


def test_shuffle_draws_must_not_be_negative(capsys):
  with pytest.raises(SystemExit):
    tail_anatomy.main(["--trace", "synthetic", "--shuffle_draws", "-1", "--no_append"])
  assert "--shuffle_draws=-1" in capsys.readouterr().err


@pytest.mark.parametrize("flag,bad", [("--slots", "64"), ("--table", "tpu=x.json")])
def test_bad_flags_are_one_clear_error(flag, bad, capsys):
  # the flags shared with bench/schedsim.py (bench/schedsim_divided.add_args) keep its errors
  with pytest.raises(SystemExit):
    tail_anatomy.main(["--trace", "synthetic", f"{flag}={bad}", "--no_append"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert flag in err and repr(bad) in err
