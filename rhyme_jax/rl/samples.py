"""Prompts, samples and the train step's sequence layout (host side, numpy).

A `Prompt` is one example rendered and tokenized for the engine; a `Sample` is one sampled
response to it with its engine log-probs and, once scored, its reward. A `GroupRecord` is what every
host learns of a group sampled anywhere (the step's exchange between hosts): enough for the
history store and the step's metrics. `pack_batch` lays a step's samples out for the learner:

  per row [prompt, response] right-padded to a static length T taken from a few buckets;
  positions = arange(T); the logits at t score token t + 1 (`targets_BxT[:, t]`), and the loss
  mask covers the response tokens. No KV cache: one causal forward.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import zlib
from typing import Sequence

import numpy as np

from rhyme_jax.data.datasets import Example
from rhyme_jax.data.prompts import PromptTemplate, render_prompt
from rhyme_jax.history.store import prompt_key


@dataclasses.dataclass
class Prompt:
  """One example ready for the engine."""

  example: Example
  text: str
  tokens: np.ndarray  # int32
  key: str  # history-store key (hash of the tokens), computed once here
  epoch: int


@dataclasses.dataclass
class Sample:
  """One sampled response; `reward`, `correct` and `text` are filled in by the scorer."""

  prompt: Prompt
  tokens: np.ndarray  # response, int32
  logprobs: np.ndarray  # engine (rollout) log-probs, float32
  finish_reason: str
  reward: float = 0.0
  correct: float | None = None
  text: str = ""


@dataclasses.dataclass
class GroupRecord:
  """One sampled group, JSON-able: prompt identity, responses and their scores."""

  uid: str  # the example's
  key: str  # the prompt's history-store key
  epoch: int
  responses: list[np.ndarray]  # int32 token arrays, one per sample
  rewards: list[float]
  correct: list[float | None]
  finish: list[str]  # finish reasons
  # the engine's float32 log-probs, one array per sample: kept only where another host trains
  # on the group (--balance_hosts), since they cost as much to send as the tokens
  logprobs: list[np.ndarray] | None = None

  @classmethod
  def of(cls, group: Sequence[Sample], logprobs: bool = False) -> "GroupRecord":
    p = group[0].prompt
    return cls(p.example.uid, p.key, p.epoch, [np.asarray(s.tokens, np.int32) for s in group],
               [float(s.reward) for s in group],
               [None if s.correct is None else float(s.correct) for s in group],
               [s.finish_reason for s in group],
               [np.asarray(s.logprobs, np.float32) for s in group] if logprobs else None)

  def samples(self, prompt: Prompt) -> list[Sample]:
    """The group's scored samples again, for `prompt` (this record's, encoded on this host;
    needs the log-probs): what the host that sampled it would have trained on."""
    if self.logprobs is None:
      raise ValueError(f"GroupRecord {self.uid}: recorded without log-probs")
    if prompt.key != self.key:
      raise ValueError(f"GroupRecord {self.uid}: prompt key {prompt.key!r} is not the "
                       f"record's {self.key!r}")
    return [Sample(prompt, t, lp, f, r, c)
            for t, lp, f, r, c in zip(self.responses, self.logprobs, self.finish, self.rewards,
                                      self.correct)]

  def to_json(self) -> dict:
    out = {"uid": self.uid, "key": self.key, "epoch": self.epoch,
           "responses": [r.tolist() for r in self.responses], "rewards": self.rewards,
           "correct": self.correct, "finish": self.finish}
    if self.logprobs is not None:  # float32 -> float64 -> JSON and back is exact
      out["logprobs"] = [lp.tolist() for lp in self.logprobs]
    return out

  @classmethod
  def from_json(cls, d: dict) -> "GroupRecord":
    lps = d.get("logprobs")
    return cls(d["uid"], d["key"], int(d["epoch"]),
               [np.asarray(r, np.int32) for r in d["responses"]], list(d["rewards"]),
               list(d["correct"]), list(d["finish"]),
               None if lps is None else [np.asarray(lp, np.float32) for lp in lps])


def encode_prompts(texts: Sequence[str], examples: Sequence[Example], epochs: Sequence[int],
                   tokenizer, max_prompt_len: int) -> list[Prompt]:
  """Tokenizes rendered prompts; a prompt too long for `--max_prompt_len` names its example."""
  out = []
  for text, ex, epoch in zip(texts, examples, epochs):
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    if len(tokens) > max_prompt_len:
      raise ValueError(f"example {ex.uid}: prompt has {len(tokens)} tokens, more than "
                       f"--max_prompt_len={max_prompt_len}")
    if len(tokens) == 0:
      raise ValueError(f"example {ex.uid}: prompt encodes to no tokens")
    out.append(Prompt(ex, text, tokens, prompt_key(tokens), epoch))
  return out


# The date a chat template that prints today's (Llama-3.x) reads in training prompts: a prompt
# must be a function of its example alone, or its tokens (and history key) would change at
# midnight, across a resume or between hosts. The templates' own fallback date.
PROMPT_DATE = datetime.datetime(2024, 7, 26)


def chat_renderer(tokenizer):
  """The chat template as the rollout renders prompts: a generation prompt, not tokenized,
  with a fixed date (`PROMPT_DATE`)."""
  return functools.partial(tokenizer.apply_chat_template, add_generation_prompt=True,
                           tokenize=False, now=PROMPT_DATE)


def longest_prompt(examples: Sequence[Example], tokenizer, template: PromptTemplate
                   ) -> tuple[int, str]:
  """(tokens, example uid) of the longest of these examples' prompts, rendered and tokenized
  as the rollout does: what `--max_prompt_len` must hold, checked before a run writes."""
  if not examples:
    return 0, ""
  texts = [render_prompt(e, chat_renderer(tokenizer), template) for e in examples]
  lengths = [len(ids) for ids in tokenizer.encode_batch(texts)]
  i = int(np.argmax(lengths))
  return lengths[i], examples[i].uid


def prompt_of(example: Example, tokens, epoch: int = 0, text: str = "") -> Prompt:
  """A `Prompt` from already tokenized ids (benchmarks that tokenize themselves)."""
  tokens = np.asarray(tokens, np.int32)
  return Prompt(example, text, tokens, prompt_key(tokens), epoch)


def length_buckets(max_total: int, smallest: int = 64) -> tuple[int, ...]:
  """Static sequence lengths: powers of two from `smallest` below `max_total`, then it."""
  sizes, n = [], smallest
  while n < max_total:
    sizes.append(n)
    n *= 2
  return tuple(sizes) + (max_total,)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket holding `n` tokens."""
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"sequence of {n} tokens exceeds the largest bucket {buckets[-1]}")


def batch_tokens(groups: Sequence[Sequence[Sample]]) -> int:
  """The longest [prompt, response] row of the groups (at least 1)."""
  return max((len(s.prompt.tokens) + len(s.tokens) for g in groups for s in g), default=1)


def pack_batch(groups: Sequence[Sequence[Sample]], advantages_B: np.ndarray, num_rows: int,
               buckets: Sequence[int], min_tokens: int = 1) -> dict[str, np.ndarray]:
  """Right-padded [prompt, response] rows; rows past the samples are empty (mask 0).

  The row length is the smallest bucket holding the longest row and `min_tokens` (the
  longest row of any host, so that every host packs the same shape).

  Keys (all [B, T] but `adv`, [B]): tokens (model inputs), targets (targets[:, t] =
  tokens[:, t + 1], what the logits at t score), mask (1 where the target is a response
  token), rollout (the engine's log-prob of that target), adv.
  """
  samples = [s for g in groups for s in g]
  if len(samples) > num_rows:
    raise ValueError(f"{len(samples)} samples do not fit in {num_rows} rows")
  t = pick_bucket(max(batch_tokens(groups), min_tokens), buckets)
  tokens_BxT = np.zeros((num_rows, t), np.int32)
  targets_BxT = np.zeros((num_rows, t), np.int32)
  mask_BxT = np.zeros((num_rows, t), np.float32)
  rollout_BxT = np.zeros((num_rows, t), np.float32)
  adv_B = np.zeros((num_rows,), np.float32)
  for i, s in enumerate(samples):
    p, r = len(s.prompt.tokens), len(s.tokens)
    seq = np.concatenate([s.prompt.tokens, s.tokens])
    tokens_BxT[i, :p + r] = seq
    targets_BxT[i, :p + r - 1] = seq[1:]
    mask_BxT[i, p - 1:p + r - 1] = 1.0
    rollout_BxT[i, p - 1:p + r - 1] = s.logprobs
    adv_B[i] = advantages_B[i]
  return dict(tokens=tokens_BxT, targets=targets_BxT, mask=mask_BxT, rollout=rollout_BxT,
              adv=adv_B)


def accuracy(correct: Sequence[float | None]) -> float | None:
  """Mean correctness of the samples whose reward has a correctness component (None: none)."""
  correct = [c for c in correct if c is not None]
  return float(np.mean(correct)) if correct else None


def rows_hash(uids: Sequence[str]) -> str:
  """Short fingerprint of which examples (by uid, in order) a step saw (equal across resumed
  and fresh runs)."""
  return hashlib.sha1(",".join(uids).encode()).hexdigest()[:12]


def tokens_crc32(responses: Sequence[np.ndarray]) -> str:
  """Fingerprint of every sampled token: equal across runs iff they sampled the same tokens
  (e.g. --spec=histospec vs --spec=none with the same seed)."""
  sampled = b"".join(np.asarray(r, np.int32).tobytes() for r in responses)
  return f"{zlib.crc32(sampled):08x}"
