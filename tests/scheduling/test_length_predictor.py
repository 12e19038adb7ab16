"""LengthPredictor on synthetic histories: group statistics, rank mapping across drifting
epochs, unknown prompts, the HistoryStore adapter, and the tail hook (remaining tokens)."""

import numpy as np
import pytest

from rhyme_jax.history.store import HistoryStore
from rhyme_jax.scheduling.predictor import (LengthPredictor, LengthTable, StoreLengths,
                                            group_stat)


def _spearman(a, b):
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


def test_one_epoch_predicts_the_group_statistic():
  table = LengthTable()
  table.add("a", 0, [10, 20, 60])
  table.add("b", 0, [5, 5, 8])
  for stat, want_a in [("mean", 30.0), ("max", 60.0), ("median", 20.0)]:
    p = LengthPredictor(table, stat=stat).predict("a")
    assert p.known and p.length == pytest.approx(want_a)
  assert group_stat(np.array([0, 100]), "q90") == pytest.approx(90.0)


def test_unknown_prompt_gets_the_population_median_and_is_marked_unknown():
  table = LengthTable()
  for i, n in enumerate([10, 20, 30, 40, 1000]):
    table.add(i, 0, [n, n])
  p = LengthPredictor(table, stat="mean").predict("never seen")
  assert not p.known and p.length == 30.0
  empty = LengthPredictor(LengthTable()).predict("x")
  assert not empty.known and empty.length == 0.0


def test_ranks_carry_an_old_epoch_into_the_newest_epoch_scale():
  # Every response doubled between epochs; prompt 'e' was not seen in the newest epoch: its
  # old rank (the longest) must map to the newest epoch's long end, not to its old length.
  table = LengthTable(epochs_kept=2)
  for key, n in zip("abcde", [10, 20, 30, 40, 50]):
    table.add(key, 0, [n] * 4)
    if key != "e":
      table.add(key, 1, [2 * n] * 4)
  pred = LengthPredictor(table, stat="mean", recency=1.0)
  assert pred.predict("e").length >= 70.0  # newest population: 20, 40, 60, 80
  for key, n in zip("abcd", [10, 20, 30, 40]):  # same rank in both epochs: newest scale
    assert pred.predict(key).length == pytest.approx(2 * n, rel=0.2)
  order = np.argsort([-pred.predict(k).length for k in "abcde"])
  assert list(order) == [4, 3, 2, 1, 0]


def test_a_one_prompt_newest_epoch_does_not_flatten_the_ranks():
  # One step into a new epoch of one-prompt steps: the newest population is that one prompt.
  # Mapped through it, every prompt would predict its length (data order); the ranks go
  # through the newest epoch holding at least half as many prompts as the largest instead.
  table = LengthTable(epochs_kept=1)
  for key, lengths in [("a", [10, 12]), ("b", [50, 60]), ("c", [30, 30])]:
    table.add(key, 0, lengths)
  table.add("d", 1, [20, 22])
  pred = LengthPredictor(table)
  assert [pred.predict(k).length for k in "abcd"] == pytest.approx([11, 55, 30, 21])
  table.add("e", 1, [40, 40])  # two prompts in the newest epoch, three in the old: it maps
  assert pred.predict("a").length == pytest.approx(21) and pred.predict("b").length == 40


def test_two_epochs_rank_better_than_one_on_noisy_synthetic_histories():
  rng = np.random.default_rng(0)
  difficulty = rng.lognormal(5.0, 0.5, size=300)

  def epoch_lengths(scale):
    return np.clip(difficulty[:, None] * scale * rng.lognormal(0, 0.6, (300, 8)), 1, 4096)

  past = [epoch_lengths(1.0), epoch_lengths(1.3)]  # drift: responses grow 30%
  truth = epoch_lengths(1.5).mean(1)
  one, two = LengthTable(1), LengthTable(2)
  for e, lengths in enumerate(past):
    for i in range(300):
      one.add(i, e, lengths[i].astype(int))
      two.add(i, e, lengths[i].astype(int))
  rho = {}
  for name, table in [("one", one), ("two", two)]:
    pred, known = LengthPredictor(table, "mean", recency=1.0).predict_many(list(range(300)))
    assert known.all()
    rho[name] = _spearman(pred, truth)
  assert rho["one"] > 0.6
  assert rho["two"] > rho["one"] + 0.02


def test_store_adapter_matches_a_length_table_and_leaves_the_eviction_order_alone():
  store, table = HistoryStore(epochs_kept=2), LengthTable(epochs_kept=2)
  rng = np.random.default_rng(1)
  for epoch in range(3):
    for key in ["p", "q", "r"]:
      responses = [rng.integers(0, 50, size=int(n)) for n in rng.integers(1, 40, size=4)]
      store.add_group(key, epoch, responses)
      table.add(key, epoch, [len(r) for r in responses])
  order = store.keys()
  a, b = LengthPredictor(StoreLengths(store), "max"), LengthPredictor(table, "max")
  for key in ["p", "q", "r", "zz"]:
    assert a.predict(key) == b.predict(key)
    assert a.remaining_tokens(key, 5, 64) == b.remaining_tokens(key, 5, 64)
  assert store.keys() == order


def test_caches_follow_the_store_without_refresh_and_a_plain_source_until_refresh():
  """The predictor caches populations and residual tables. Over a history store they are
  dropped whenever the store changes (add, eviction, reload from a checkpoint), so a trainer
  never schedules on a stale view; a source without a `generation` keeps them until
  `refresh`."""
  store = HistoryStore(epochs_kept=1)
  store.add_group("a", 0, [np.zeros(10, np.int32)] * 2)
  store.add_group("b", 0, [np.zeros(30, np.int32)] * 2)
  pred = LengthPredictor(StoreLengths(store))
  # a's residual life: its two 10s with every prompt's mean as 4 more samples
  residual = lambda every_mean: pytest.approx((2 * 10 + 4 * every_mean) / (2 + 4))
  assert pred.predict("new").length == 20 and pred.remaining_tokens("a", 0, 100) == residual(20)
  saved = store.state_dict()
  store.add_group("c", 0, [np.zeros(50, np.int32)] * 2)
  assert pred.predict("new").length == 30  # the population now holds c
  assert pred.remaining_tokens("a", 0, 100) == residual(30)
  store.load_state_dict(saved)  # a resume: back to a and b
  assert pred.predict("new").length == 20 and pred.remaining_tokens("a", 0, 100) == residual(20)

  class Plain:  # a LengthSource without a generation stamp
    def __init__(self):
      self.table = {"a": [(0, np.array([10, 10]))], "b": [(0, np.array([30, 30]))]}

    def keys(self):
      return list(self.table)

    def epoch_lengths(self, key):
      return self.table.get(key, [])

  plain = Plain()
  pred = LengthPredictor(plain)
  assert pred.predict("new").length == 20
  plain.table["c"] = [(0, np.array([50, 50]))]
  assert pred.predict("new").length == 20  # cached
  pred.refresh()
  assert pred.predict("new").length == 30


def test_remaining_tokens_is_the_empirical_residual_life():
  table = LengthTable()
  table.add("a", 0, [10, 20, 30])
  table.add("b", 0, [100, 200])
  pred = LengthPredictor(table, residual_prior=0)  # the prompt's own lengths alone
  assert pred.remaining_tokens("a", 0, 1000) == pytest.approx(20.0)
  assert pred.remaining_tokens("a", 15, 1000) == pytest.approx(10.0)  # E[L | L > 15] = 25
  # Outran its own history: every prompt's lengths above 35 (100, 200) -> 150 - 35.
  assert pred.remaining_tokens("a", 35, 1000) == pytest.approx(115.0)
  assert pred.remaining_tokens("a", 300, 1000) == pytest.approx(350.0)  # no evidence: room/2
  assert pred.remaining_tokens("a", 15, 20) == pytest.approx(5.0)  # capped at the room left
  assert pred.remaining_tokens("a", 20, 20) == 0.0
  work = pred.remaining_work({7: ("a", 15, 1000), 8: ("b", 0, 1000)})
  assert work == {7: pytest.approx(10.0), 8: pytest.approx(150.0)}


def test_residual_life_is_shrunk_toward_every_prompts():
  """Own lengths beyond n are few (one or two of a group of 8 for a long-running request):
  every prompt's residual life counts as `residual_prior` more samples."""
  table = LengthTable()
  table.add("a", 0, [10, 20, 30])
  table.add("b", 0, [100, 200])
  pred = LengthPredictor(table, residual_prior=2)
  # n = 25: own {30} -> 5 left; every prompt's {30, 100, 200} -> 110 - 25 = 85 left.
  assert pred.remaining_tokens("a", 25, 1000) == pytest.approx((5 + 2 * 85) / 3)
  # n = 0: own mean 20, every prompt's mean 72 -> (3 * 20 + 2 * 72) / 5.
  assert pred.remaining_tokens("a", 0, 1000) == pytest.approx((60 + 144) / 5)
  # Outran its own history: every prompt's residual life, whatever the prior.
  assert pred.remaining_tokens("a", 35, 1000) == pytest.approx(115.0)
  many = LengthTable()  # with many own samples the prior hardly moves the estimate
  many.add("a", 0, [30] * 200)
  many.add("b", 0, [300] * 8)
  assert LengthPredictor(many, residual_prior=2).remaining_tokens("a", 25, 1000) == (
      pytest.approx(5.0, rel=0.15))


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="stat="):
    LengthPredictor(LengthTable(), stat="p99")
  with pytest.raises(ValueError, match="residual_prior="):
    LengthPredictor(LengthTable(), residual_prior=-1)
  with pytest.raises(ValueError, match="recency="):
    LengthPredictor(LengthTable(), recency=0.0)
  with pytest.raises(ValueError, match="negative length"):
    LengthTable().add("a", 0, [3, -1])


def _random_histories(seed, count, lengths, group, priors):
  """`count` random (table, prior, predictor, every kept length): up to 7 keys of 1-2 epochs,
  group sizes in `group`, lengths in `lengths` (ties, empty groups)."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    table = LengthTable(epochs_kept=2)
    for key in range(int(rng.integers(1, 8))):
      for epoch in range(int(rng.integers(1, 3))):
        table.add(key, epoch, rng.integers(*lengths, int(rng.integers(*group))).tolist())
    prior = float(rng.choice(priors))
    every = np.concatenate([l for k in table.keys() for _, l in table.epoch_lengths(k)])
    yield table, prior, LengthPredictor(table, residual_prior=prior), every


def _own(table, key) -> np.ndarray:
  own = [l for _, l in table.epoch_lengths(key)]
  return np.concatenate(own) if own else np.zeros(0, np.int64)


def test_remaining_tokens_matches_the_direct_formula_and_follows_the_table():
  """The sorted suffix-sum tables give exactly the direct E[L - n | L > n] shrunk toward every
  prompt's, on random histories (ties, empty groups, n past every length); the tables are
  kept until `refresh`, like the rank populations."""
  for table, prior, pred, every in _random_histories(3, 20, (0, 60), (0, 9), (0.0, 2.0, 4.0)):
    for key in range(9):
      own = _own(table, key)
      for n in range(0, 70, 7):
        room, beyond, mine = 64 - n, every[every > n], own[own > n]
        if room <= 0:
          want = 0.0
        elif not beyond.size:
          want = max(room / 2, 1.0)
        else:
          want = beyond.mean() - n
          if mine.size:
            want = (mine.sum() - mine.size * n + prior * want) / (mine.size + prior)
          want = min(max(want, 1.0), room)
        assert pred.remaining_tokens(key, n, 64) == pytest.approx(want, rel=1e-12)
  table = LengthTable()
  table.add("a", 0, [10, 20, 30])
  pred = LengthPredictor(table, residual_prior=0)
  assert pred.remaining_tokens("a", 0, 1000) == pytest.approx(20.0)
  table.add("a", 0, [60])  # the table's generation moved: the cached tables are dropped
  assert pred.remaining_tokens("a", 0, 1000) == pytest.approx(30.0)


def test_remaining_quantile_hand_computed():
  table = LengthTable()
  table.add("a", 0, [10, 20, 30, 40])
  table.add("b", 0, [5, 5, 100, 100])
  own = LengthPredictor(table, residual_prior=0)  # the prompt's own lengths alone
  assert own.remaining_quantile("a", 0, 256, 0.75) == 30.0  # 3 of 4 at or below 30
  assert own.remaining_quantile("a", 0, 256, 0.76) == 40.0
  assert own.remaining_quantile("a", 15, 256, 0.75) == 25.0  # L - 15 over {20, 30, 40}
  assert own.remaining_quantile("a", 45, 256, 0.5) == 55.0  # outran its own: every prompt's
  assert own.remaining_quantile("a", 150, 256, 0.5) == 53.0  # outran all: half the room
  assert own.remaining_quantile("b", 0, 60, 0.75) == 60.0  # capped at the room
  assert own.remaining_quantile("a", 60, 60, 0.75) == 0.0
  # A prior of 4 samples over every prompt's 8 lengths (0.5 each) beside a's own 4 (1 each):
  # at r = 30, 3 + 0.5 x 5 of 8 = 0.69; at r = 40, 4 + 0.5 x 6 = 0.875, the first >= 0.75.
  mixed = LengthPredictor(table, residual_prior=4)
  assert mixed.remaining_quantile("a", 0, 256, 0.75) == 40.0
  assert mixed.remaining_quantile("b", 0, 256, 0.75) == 100.0  # 5 of 8 below 100


def test_remaining_quantile_matches_a_weighted_quantile_of_the_mixture():
  """On random histories: the smallest r >= 1 with at least q of the weight at L - n <= r,
  where each own length above n weighs 1 and every prompt's lengths above n weigh
  residual_prior in all (the distribution whose mean is `remaining_tokens`)."""
  for table, prior, pred, every in _random_histories(11, 30, (1, 80), (1, 9), (0.0, 1.0, 4.0)):
    for key in range(6):
      own = _own(table, key)
      for n in range(0, 90, 9):
        for q in (0.25, 0.5, 0.75, 0.9):
          room, beyond, mine = 80 - n, every[every > n] - n, own[own > n] - n
          if room <= 0:
            want = 0.0
          elif not beyond.size:
            want = max(room / 2, 1.0)
          else:
            k = prior if mine.size else 1.0
            values = np.concatenate([mine, beyond])
            weights = np.concatenate([np.ones(mine.size), np.full(beyond.size, k / beyond.size)])
            shares = [weights[values <= r].sum() / weights.sum() for r in range(1, room + 1)]
            want = float(next((r for r, w in zip(range(1, room + 1), shares)
                               if w >= q - 1e-12), room))
          got = pred.remaining_quantile(key, n, 80, q)
          assert got == want, (key, n, q, got, want)


def test_a_few_prompts_into_an_epoch_do_not_map_every_rank():
  """One epoch kept: a step into epoch 1, two prompts revisited (both groups at the cap) hold
  epoch 1 while epoch 0 still holds the other eight. Ranks map through epoch 0 until epoch 1
  holds half as many prompts as it, so the unrevisited prompts keep distinct predictions and
  LPT keeps the longest apart (mapped through the two capped groups every prediction was
  3000, and LPT dealt the six round-robin)."""
  from rhyme_jax.scheduling.assignment import plan_hosts
  from rhyme_jax.scheduling.predictor import mapping_epoch
  table = LengthTable(epochs_kept=1)
  for i, n in enumerate([50, 100, 200, 400, 800, 1600, 3000, 3000, 3000, 3000]):
    table.add(f"p{i}", 0, [n] * 8)
  pred = LengthPredictor(table, "mean")
  keys = [f"p{i}" for i in range(6)]
  before = plan_hosts(keys, 8, pred, 2)[0]
  for i in (6, 7):
    table.add(f"p{i}", 1, [3000] * 8)
  assert mapping_epoch(pred._populations()) == 0
  assert [pred.predict(k).length for k in keys] == [50, 100, 200, 400, 800, 1600]
  assert plan_hosts(keys, 8, pred, 2)[0] == before == [[5], [0, 1, 2, 3, 4]]
  for i in (8, 9, 0):  # epoch 1 now holds 5 prompts, epoch 0 five: epoch 1 maps
    table.add(f"p{i}", 1, [3000 - 100 * i] * 8)
  assert mapping_epoch(pred._populations()) == 1
  assert mapping_epoch({0: np.arange(9.0), 1: np.arange(4.0)}) == 0
  assert mapping_epoch({0: np.arange(8.0), 1: np.arange(4.0)}) == 1
