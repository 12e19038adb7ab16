"""Recordings round-trip through their file format and merge; replay measures a drafter exactly:
no drafts give 1 token per verify, exact history gives budget + 1 per verify until the end."""

import numpy as np
import pytest

from rhyme_jax.history.drafter import HistoryDrafter
from rhyme_jax.history.recording import Recording, merge, split_groups
from rhyme_jax.history.replay import accepted_path, replay, replay_epochs
from rhyme_jax.history.store import HistoryStore, prompt_key
from rhyme_jax.rollout.drafts import DraftTree, NoDrafts


def recording(epoch, num_prompts=3, group=4, length=50, first_prompt=0, seed=0, distinct=False):
  rng = np.random.default_rng(seed)
  if distinct:  # no token repeats anywhere: every match is unique
    pool = iter(rng.permutation(100_000).astype(np.int32))
  prompts = [np.arange(first_prompt + i, first_prompt + i + 5, dtype=np.int32)
             for i in range(num_prompts)]
  responses = [rng.integers(0, 1000, int(rng.integers(1, length))).astype(np.int32)
               for _ in range(num_prompts * group)]
  if distinct:
    responses = [np.array([next(pool) for _ in r], np.int32) for r in responses]
  return Recording(responses, np.arange(num_prompts * group) + first_prompt * group,
                   np.repeat(np.arange(num_prompts), group), ["length"] * len(responses),
                   prompts, [prompt_key(p) for p in prompts],
                   dict(epoch=epoch, temperature=0.6, seed=epoch, top_p=1.0, max_new_tokens=length,
                        group_size=group))


def test_save_load_round_trip_and_merge(tmp_path):
  a, b = recording(1), recording(1, first_prompt=3, seed=1)
  a.save(tmp_path / "a.npz")
  back = Recording.load(tmp_path / "a.npz")
  assert back.meta == a.meta and back.finish == a.finish and back.prompt_keys == a.prompt_keys
  for x, y in zip(back.responses + back.prompts, a.responses + a.prompts):
    np.testing.assert_array_equal(x, y)
  both = merge([a, b])
  assert len(both.prompts) == 6 and both.group_id(len(both.responses) - 1) == "e1/p5"
  assert both.groups()[b.prompt_keys[2]][0] is b.responses[8]
  with pytest.raises(ValueError, match="temperature"):
    merge([a, Recording(**{**b.__dict__, "meta": {**b.meta, "temperature": 1.0}})])
  long_keys = Recording(**{**a.__dict__, "prompt_keys": [f"dataset/train/{'x' * 40}-{i}"
                                                         for i in range(3)]})
  long_keys.save(tmp_path / "long.npz")  # keys of any length come back whole, not cut at 32
  assert Recording.load(tmp_path / "long.npz").prompt_keys == long_keys.prompt_keys
  np.savez(tmp_path / "bad.npz", tokens=np.zeros(3))
  with pytest.raises(ValueError, match="missing field"):
    Recording.load(tmp_path / "bad.npz")


def test_accepted_path_follows_the_matching_branch():
  tree = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, -1, 1, 2]), np.ones(4, bool))
  assert accepted_path(tree, np.array([6, 7, 8, 9])) == 3
  assert accepted_path(tree, np.array([5, 7])) == 1
  assert accepted_path(tree, np.array([9])) == 0
  assert accepted_path(tree, np.array([6, 7])) == 2


def test_no_drafts_is_one_token_per_verify():
  target = recording(1)
  stats = replay(NoDrafts(), target, budget=16, live_rows=5)
  assert stats.accepted_length == 1.0 and stats.tokens == target.num_tokens
  assert stats.no_draft_steps == stats.steps


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_exact_history_is_accepted_up_to_the_budget(budget):
  """History = the target itself: every verify emits budget + 1 tokens (fewer at the end)."""
  target = recording(1, group=1, length=200, distinct=True)
  stats = replay_epochs(lambda: HistoryDrafter(HistoryStore(), use_siblings=False,
                                               max_budget=budget), [target], target,
                        budget=budget, live_rows=4)
  want = sum(-(-len(r) // (budget + 1)) for r in target.responses)
  assert stats.steps == want and stats.tokens == target.num_tokens
  # every step emits a bonus token except a last one whose draft covered the rest
  assert stats.accepted == stats.tokens - stats.steps + sum(
      len(r) % (budget + 1) != 0 for r in target.responses)


@pytest.mark.parametrize("mode", ["history", "siblings", "both"])
def test_compiled_drafter_replays_like_the_reference(mode):
  """The whole drafter, compiled vs the readable reference, on a replay with repetitive
  history and siblings: the same trees at every step, hence the same statistics."""
  rng = np.random.default_rng(3)
  def noisy(epoch):  # responses sharing a pattern per prompt, tokens changed at random
    rec = recording(epoch, num_prompts=3, group=4, length=80, seed=epoch)
    for i, r in enumerate(rec.responses):
      base = np.arange(len(r)) % (7 + int(rec.prompt_index[i]))
      rec.responses[i] = np.where(rng.random(len(r)) < 0.2, r % 13, base).astype(np.int32)
    return rec
  history, target = noisy(0), noisy(1)
  runs = []
  for compiled in (True, False):
    make = lambda: HistoryDrafter(HistoryStore(), use_history=mode != "siblings",
                                  use_siblings=mode != "history", max_budget=8,
                                  compiled=compiled)
    st = replay_epochs(make, [history], target, budget=8, live_rows=5)
    runs.append((st.steps, st.tokens, st.drafted, st.accepted, st.no_draft_steps))
  assert runs[0] == runs[1]
  assert runs[0][3] > 0


def test_split_groups_halves_every_group():
  rec = recording(0, num_prompts=3, group=4)
  hist, target = split_groups(rec)
  assert len(hist.responses) == len(target.responses) == 6
  assert hist.meta["group_size"] == 2 and target.epoch == 1
  np.testing.assert_array_equal(hist.prompt_index, [0, 0, 1, 1, 2, 2])
  assert hist.responses[1] is rec.responses[2] and target.responses[1] is rec.responses[3]
