"""bench/schedsim_grpo.py: a GRPO run's recorded rollouts as per-step simulator cases. The
loader reads the right steps and data epochs, each step's predictor sees only what the
trainer's history store held before that step (no later step, no future epoch), results sum
over steps, and bench/schedsim.py runs such a directory end to end."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import schedsim  # noqa: E402
import schedsim_grpo  # noqa: E402
from rhyme_jax.history.recording import Recording  # noqa: E402
from rhyme_jax.scheduling.simulate import SimResult  # noqa: E402

G = 2
# Data epoch -> steps -> prompts (4 prompts, 2 per step, reshuffled each epoch as a sampler does).
RUN = {0: [[0, 1], [2, 3]], 1: [[3, 0], [1, 2]], 2: [[2, 1], [0, 3]]}


def _length(step, prompt, sample):
  """Encodes where a length came from: step * 100 + prompt * 10 + sample + 1."""
  return step * 100 + prompt * 10 + sample + 1


def _write_run(directory):
  step = 0
  for epoch, steps in RUN.items():
    for prompts in steps:
      step += 1
      responses = [np.zeros(_length(step, p, j), np.int32) for p in prompts for j in range(G)]
      rec = Recording(responses, np.arange(len(responses), dtype=np.int64),
                      np.repeat(np.arange(len(prompts)), G).astype(np.int64),
                      ["length"] * len(responses),
                      [np.full(5 + p, 7, np.int32) for p in prompts], [f"k{p}" for p in prompts],
                      {"epoch": epoch, "step": step, "round": 0, "process": 0,
                       "max_new_tokens": 1000, "group_size": G, "temperature": 0.7})
      rec.save(os.path.join(directory, f"e{epoch}_s{step:06d}_r0_p0.npz"))


def test_loader_reads_steps_and_epochs_and_no_future_leaks(tmp_path):
  _write_run(tmp_path)
  cases = schedsim_grpo.grpo_cases(str(tmp_path))
  assert [(c.step, c.epoch) for c in cases] == [(3, 1), (4, 1), (5, 2), (6, 2)]
  flat = [p for steps in RUN.values() for p in steps]
  for c in cases:
    prompts = flat[c.step - 1]
    assert [m.prompt_key for m, _ in c.jobs] == [f"k{p}" for p in prompts for _ in range(G)]
    assert [n for _, n in c.jobs] == [_length(c.step, p, j) for p in prompts for j in range(G)]
    assert all(m.max_new_tokens == 1000 and m.prompt_len == 5 + int(m.prompt_key[1:])
               for m, _ in c.jobs)
    assert len({m.group_id for m, _ in c.jobs}) == len(prompts)
    for key in c.table.keys():
      for epoch, lengths in c.table.epoch_lengths(key):
        assert np.all(lengths // 100 < c.step), "a length recorded at or after the step leaked"
        if key in {f"k{p}" for p in prompts}:
          assert epoch < c.epoch, "the step's own prompt predicted from its current epoch"
    for p in prompts:  # one epoch kept: the prompt's previous data epoch, as the store keeps it
      (epoch, lengths), = c.table.epoch_lengths(f"k{p}")
      prev = max(s for s in range(1, c.step) if p in flat[s - 1])
      assert epoch == c.epoch - 1 and list(lengths) == [_length(prev, p, j) for j in range(G)]
      assert c.predictor.predict(f"k{p}").known
  # Later steps are added after a case was built: its snapshot does not change.
  assert max(np.concatenate([l for k in cases[0].table.keys()
                             for _, l in cases[0].table.epoch_lengths(k)]) // 100) == 2
  kept2 = schedsim_grpo.grpo_cases(str(tmp_path), epochs_kept=2)
  assert [e for e, _ in kept2[-1].table.epoch_lengths("k0")] == [0, 1]
  with pytest.raises(ValueError, match="no e"):
    schedsim_grpo.grpo_cases(str(tmp_path / "missing"))


def test_aggregate_sums_steps():
  def res(span, tail, util, steps, peak):
    return SimResult(np.array([span]), span, tail, util, steps, 0, 1.0, 0, 0, np.array([span]),
                     peak)
  agg = schedsim_grpo.aggregate([res(10.0, 2.0, 0.5, 4, 3), res(30.0, 1.0, 0.9, 6, 5)])
  assert (agg.makespan_ms, agg.tail_ms, agg.steps, agg.peak_started) == (40.0, 3.0, 10, 5)
  assert agg.utilisation == pytest.approx((10 * 0.5 + 30 * 0.9) / 40)


def test_schedsim_runs_a_grpo_directory(tmp_path, capsys):
  _write_run(tmp_path)
  schedsim.main(["--trace", f"grpo:{tmp_path}", "--blind_draws", "2", "--no_append"])
  out = capsys.readouterr().out
  name = "grpo:" + os.path.basename(str(tmp_path))
  rows = [line.split(" | ") for line in out.splitlines() if line.startswith(f"| {name}")]
  assert rows and f"trace {name}: GRPO run" in out and "4 steps of data epochs [1, 2]" in out
  # 4 requests per step: 2 rows on the h100 table, 1 on the cpu one.
  assert any(r[1:3] == ["h100", "1x2"] for r in rows) and any(r[1:3] == ["cpu", "1x1"]
                                                               for r in rows)
