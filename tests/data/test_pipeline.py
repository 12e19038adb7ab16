"""Prompt pipeline: seeded epochs, exact resume across epoch boundaries, multi-host shares."""

import collections
import itertools
import json

import grain
import pytest

from rhyme_jax.data import arithmetic, pipeline, prompts

EXAMPLES = arithmetic.generate_arithmetic(23, seed=0)  # Not a multiple of the batch sizes.


def _make(**kw):
  args = dict(batch_size=4, seed=7, process_index=0, process_count=1)
  args.update(kw)
  return pipeline.PromptPipeline(EXAMPLES, **args)


def _uids(batches):
  return [b.uids for b in batches]


def test_every_epoch_is_a_fresh_permutation():
  p = _make()
  stream = [u for b in itertools.islice(iter(p), 23) for u in b.uids]  # 92 = 4 epochs.
  all_uids = sorted(e.uid for e in EXAMPLES)
  epochs = [stream[i * 23:(i + 1) * 23] for i in range(4)]
  for epoch in epochs:
    assert sorted(epoch) == all_uids
  assert len({tuple(e) for e in epochs}) == 4  # Reshuffled each epoch.
  b = p.batch_at(5)  # Positions 20..23 straddle epochs 0 and 1.
  assert b.epochs == (0, 0, 0, 1) and b.positions == (20, 21, 22, 23)


def test_seed_determines_order():
  a = _uids(itertools.islice(iter(_make()), 10))
  assert a == _uids(itertools.islice(iter(_make()), 10))
  assert a != _uids(itertools.islice(iter(_make(seed=8)), 10))


def test_neighbouring_seeds_do_not_share_epoch_orders():
  # grain permutes epoch e with seed s + e: unhashed, seed 8's epoch 0 was seed 7's epoch 1.
  def epochs(seed):
    stream = [u for b in itertools.islice(iter(_make(seed=seed)), 23) for u in b.uids]
    return [tuple(stream[i * 23:(i + 1) * 23]) for i in range(4)]
  orders = [order for seed in range(5) for order in epochs(seed)]
  assert len(set(orders)) == len(orders) == 20


def test_shuffle_seed_refuses_what_grain_cannot_take():
  assert pipeline.shuffle_seed(0) != pipeline.shuffle_seed(1)
  grain.MapDataset.range(3).shuffle(seed=pipeline.shuffle_seed(2**32 - 1))  # grain takes it
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="seed"):
      pipeline.shuffle_seed(bad)


@pytest.mark.parametrize("n_before", [3, 5, 6, 11])  # 5 and 11 cross epoch boundaries.
def test_resume_continues_exactly(n_before):
  total = 16
  uninterrupted = _uids(itertools.islice(iter(_make()), total))
  it = iter(_make())
  first = _uids(itertools.islice(it, n_before))
  state = json.loads(json.dumps(it.get_state()))  # Must survive serialisation.
  it.close()
  fresh = iter(_make())
  fresh.set_state(state)
  rest = _uids(itertools.islice(fresh, total - n_before))
  assert first + rest == uninterrupted
  # Two full epochs (46 positions) in the resumed stream: every uid exactly twice.
  counts = collections.Counter([u for b in first + rest for u in b][:46])
  assert set(counts.values()) == {2} and len(counts) == 23


def test_processes_share_global_batches_disjointly():
  pipes = [_make(batch_size=3, process_index=p, process_count=3) for p in range(3)]
  steps = 8  # 72 positions: epochs 0, 1 and part of 2.
  per_proc = [list(itertools.islice(iter(p), steps)) for p in pipes]
  for k in range(steps):
    positions = [pos for p in range(3) for pos in per_proc[p][k].positions]
    assert positions == list(range(9 * k, 9 * k + 9))
  global_stream = [u for k in range(steps) for p in range(3) for u in per_proc[p][k].uids]
  single = [u for b in itertools.islice(iter(_make(batch_size=9)), steps) for u in b.uids]
  assert global_stream == single
  assert sorted(global_stream[:23]) == sorted(e.uid for e in EXAMPLES)


def test_finite_epochs_and_rendered_prompts():
  template = prompts.get_prompt_template("arithmetic")
  p = _make(num_epochs=2, render_fn=prompts.render_plain, template=template)
  batches = list(p)
  assert p.num_steps == len(batches) == 46 // 4
  assert batches[0].prompts[0] == prompts.render_prompt(batches[0].examples[0],
                                                        prompts.render_plain, template)


def test_bad_arguments():
  with pytest.raises(ValueError, match="batch_size"):
    _make(batch_size=0)
  with pytest.raises(ValueError, match="process_index"):
    _make(process_index=2, process_count=2)
  with pytest.raises(ValueError, match="render_fn and template"):
    _make(render_fn=prompts.render_plain)
  with pytest.raises(ValueError, match="examples is empty"):
    pipeline.PromptPipeline([], batch_size=1, seed=0, process_index=0, process_count=1)


def test_a_stream_drawn_by_another_order_rule_is_not_resumed():
  pipeline.check_order_version(pipeline.ORDER_VERSION, "checkpoint x")
  with pytest.raises(ValueError, match="checkpoint x: .* rule 1, .* rule 2 .* new --run_dir"):
    pipeline.check_order_version(1, "checkpoint x")  # a checkpoint from before the seed hash
