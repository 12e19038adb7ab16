"""rl/samples.py on its own: prompt encoding, buckets, the packed train batch, fingerprints."""

from __future__ import annotations

import numpy as np
import pytest

from rhyme_jax.data.datasets import Example
from rhyme_jax.history.store import prompt_key
from rhyme_jax.rl import samples as S


class ByteTokenizer:
  """A real (if trivial) tokenizer: one token per UTF-8 byte."""

  def encode(self, text):
    return list(text.encode())


EX = Example("u1", "q", "#### 1")


def _sample(prompt_tokens, response, logprob=-0.5, reward=0.0, correct=None):
  p = S.prompt_of(EX, prompt_tokens)
  return S.Sample(p, np.asarray(response, np.int32), np.full(len(response), logprob, np.float32),
                  "stop", reward=reward, correct=correct)


def test_encode_prompts_keys_once_and_names_the_example():
  (p,) = S.encode_prompts(["abc"], [EX], [2], ByteTokenizer(), max_prompt_len=3)
  assert p.tokens.tolist() == [97, 98, 99] and p.epoch == 2
  assert p.key == prompt_key(p.tokens)
  with pytest.raises(ValueError, match=r"example u1: prompt has 4 tokens, more than "
                     r"--max_prompt_len=3"):
    S.encode_prompts(["abcd"], [EX], [0], ByteTokenizer(), max_prompt_len=3)
  with pytest.raises(ValueError, match="example u1: prompt encodes to no tokens"):
    S.encode_prompts([""], [EX], [0], ByteTokenizer(), max_prompt_len=3)


def test_length_buckets_and_pick():
  assert S.length_buckets(352) == (64, 128, 256, 352)
  assert S.length_buckets(64) == (64,)
  assert S.pick_bucket(65, (64, 128)) == 128
  with pytest.raises(ValueError, match="129 tokens exceeds the largest bucket 128"):
    S.pick_bucket(129, (64, 128))


def test_pack_batch_layout():
  groups = [[_sample([1, 2, 3], [7, 8], -0.25), _sample([1, 2, 3], [9], -0.75)]]
  b = S.pack_batch(groups, np.array([1.0, -1.0]), num_rows=4, buckets=(4, 8))
  assert b["tokens"].shape == (4, 8)  # 5 tokens -> bucket 8; rows past the samples empty
  assert b["tokens"][0].tolist() == [1, 2, 3, 7, 8, 0, 0, 0]
  assert b["targets"][0].tolist() == [2, 3, 7, 8, 0, 0, 0, 0]  # logits at t score t + 1
  assert b["mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # exactly the response targets
  assert b["rollout"][0].tolist() == [0, 0, -0.25, -0.25, 0, 0, 0, 0]
  assert b["mask"][1].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
  assert b["adv"].tolist() == [1.0, -1.0, 0.0, 0.0]
  assert not b["mask"][2:].any()
  with pytest.raises(ValueError, match="2 samples do not fit in 1 rows"):
    S.pack_batch(groups, np.zeros(2), num_rows=1, buckets=(8,))


def test_accuracy_and_fingerprints():
  a, b = _sample([1], [5, 6], correct=1.0), _sample([1], [5, 7], correct=0.0)
  assert S.accuracy([a.correct, b.correct, _sample([1], [2]).correct]) == 0.5
  assert S.accuracy([_sample([1], [2]).correct]) is None
  assert S.tokens_crc32([a.tokens, b.tokens]) != S.tokens_crc32([b.tokens, a.tokens])
  assert S.tokens_crc32([a.tokens, b.tokens]) == S.tokens_crc32([np.array([5, 6]),
                                                                 np.array([5, 7])])
  assert S.rows_hash(["u1"]) != S.rows_hash(["u2"])
  assert len(S.rows_hash(["u1", "u2"])) == 12


def test_group_record_round_trips_through_json():
  import json
  group = [_sample([1, 2], [5, 6], reward=1.0, correct=1.0), _sample([1, 2], [7], reward=0.5)]
  r = S.GroupRecord.of(group)
  assert (r.uid, r.key, r.epoch) == ("u1", group[0].prompt.key, 0)
  assert r.rewards == [1.0, 0.5] and r.correct == [1.0, None] and r.finish == ["stop", "stop"]
  back = S.GroupRecord.from_json(json.loads(json.dumps(r.to_json())))
  assert [x.tolist() for x in back.responses] == [[5, 6], [7]]
  assert back.responses[0].dtype == np.int32
  assert (back.uid, back.key, back.rewards, back.correct) == (r.uid, r.key, r.rewards, r.correct)


def test_pack_batch_min_tokens_picks_a_longer_bucket():
  groups = [[_sample([1, 2, 3], [7, 8])]]
  assert S.batch_tokens(groups) == 5 and S.batch_tokens([]) == 1
  assert S.pack_batch(groups, np.ones(1), 2, (4, 8, 16))["tokens"].shape == (2, 8)
  assert S.pack_batch(groups, np.ones(1), 2, (4, 8, 16), min_tokens=9)["tokens"].shape == (2, 16)
  empty = S.pack_batch([], np.zeros(0), 2, (4, 8, 16), min_tokens=9)  # a host that kept none
  assert empty["tokens"].shape == (2, 16) and not empty["mask"].any()
