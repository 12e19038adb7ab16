"""Per-prompt history of past responses: what HistoSpec drafts from and HistoPipe predicts from.

RL revisits every prompt once per epoch. After each rollout the trainer records the group it
just generated (`add_group`); the next epoch drafts from those responses and predicts the
prompt's response length from them. Only the last `epochs_kept` epochs are kept per prompt (the
published HistoSpec keeps 1), and the whole store is bounded in tokens: the prompts least recently
recorded are evicted first. Only recording moves a prompt in that order, never a read (drafting,
a length look-up): every host of a pod records the same groups in the same order while each
drafts only its own prompts, so their stores, and the plans scheduling derives from them, stay
identical. `state_dict()` is a handful of flat numpy arrays plus a JSON string,
so it can ride along in the training checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
from typing import Hashable, Sequence

import numpy as np

# Versions and generations: unique across stores and reloads, so an index cached against one
# never matches different content.
_STAMPS = itertools.count(1)


def prompt_key(tokens: Sequence[int]) -> str:
  """A stable key for a prompt: blake2b (128 bit) of its tokens as little-endian int32."""
  data = np.ascontiguousarray(np.asarray(tokens, dtype="<i4").reshape(-1)).tobytes()
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def store_key(key) -> Hashable:
  """The store key of a request's prompt key: token sequences (the engine's default key is the
  prompt's token tuple) become their `prompt_key` hash; str / int keys pass through. The
  drafter records and reads, and the length predictor looks up, by this one key."""
  if isinstance(key, (tuple, list, np.ndarray)):
    return prompt_key(key)
  return key


@dataclasses.dataclass
class EpochGroup:
  """The responses one prompt got in one epoch."""

  epoch: int
  responses: list[np.ndarray]  # int32 token arrays
  rewards: np.ndarray  # float32[len(responses)]

  @property
  def lengths(self) -> np.ndarray:
    return np.array([len(r) for r in self.responses], np.int64)

  @property
  def num_tokens(self) -> int:
    return int(sum(len(r) for r in self.responses))


def _check_key(key: Hashable, where: str) -> None:
  if not isinstance(key, (str, int)) or isinstance(key, bool):
    raise TypeError(f"{where}: prompt key must be a str or int (a token hash or dataset uid), "
                    f"got {type(key).__name__}")


class HistoryStore:
  """Past responses per prompt key, last `epochs_kept` epochs, bounded to `max_tokens` (the
  least recently recorded prompts evicted first)."""

  def __init__(self, epochs_kept: int = 1, max_tokens: int = 50_000_000):
    if epochs_kept < 1:
      raise ValueError(f"HistoryStore: epochs_kept must be >= 1, got {epochs_kept}")
    if max_tokens < 1:
      raise ValueError(f"HistoryStore: max_tokens must be >= 1, got {max_tokens}")
    self.epochs_kept = int(epochs_kept)
    self.max_tokens = int(max_tokens)
    self._entries: collections.OrderedDict[Hashable, list[EpochGroup]] = (
        collections.OrderedDict())  # least recently recorded first
    self._versions: dict[Hashable, int] = {}
    # Changes whenever any key's content does (add, eviction, reload): lets a caller skip
    # per-key version checks while nothing changed.
    self.generation = next(_STAMPS)
    self.num_tokens = 0
    self.evictions = 0

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, key: Hashable) -> bool:
    return key in self._entries

  def keys(self) -> list[Hashable]:
    """Keys from least to most recently recorded (the eviction order)."""
    return list(self._entries)

  def add_group(self, key: Hashable, epoch: int, responses: Sequence[Sequence[int]],
                rewards: Sequence[float] | None = None) -> None:
    """Records a prompt's group for `epoch` (appended if that epoch already has one). A group
    of no responses records nothing: an empty epoch would push an older one out of the kept
    epochs, and `state_dict`, which holds responses, could not bring it back on resume."""
    _check_key(key, "HistoryStore.add_group")
    resp = [np.asarray(r, np.int32).reshape(-1).copy() for r in responses]
    if rewards is None:
      rew = np.full(len(resp), np.nan, np.float32)
    else:
      rew = np.asarray(rewards, np.float32).reshape(-1)
      if len(rew) != len(resp):
        raise ValueError(f"HistoryStore.add_group: {len(resp)} responses but {len(rew)} rewards "
                         f"for key {key!r}")
    if not resp:
      return
    groups = self._entries.pop(key, [])
    self.num_tokens -= sum(g.num_tokens for g in groups)
    same = [g for g in groups if g.epoch == int(epoch)]
    if same:
      same[0].responses.extend(resp)
      same[0].rewards = np.concatenate([same[0].rewards, rew])
    else:
      groups.append(EpochGroup(int(epoch), resp, rew))
    groups.sort(key=lambda g: g.epoch)
    groups = groups[-self.epochs_kept:]
    self._entries[key] = groups
    self.num_tokens += sum(g.num_tokens for g in groups)
    self._versions[key] = self.generation = next(_STAMPS)
    self._evict(keep=key)

  def _evict(self, keep: Hashable) -> None:
    while self.num_tokens > self.max_tokens and len(self._entries) > 1:
      old_key = next(iter(self._entries))
      if old_key == keep:  # the newest entry alone exceeds the bound: keep it anyway
        break
      groups = self._entries.pop(old_key)
      self._versions.pop(old_key, None)
      self.generation = next(_STAMPS)
      self.num_tokens -= sum(g.num_tokens for g in groups)
      self.evictions += 1

  def get(self, key: Hashable) -> list[EpochGroup] | None:
    """The kept epochs of a prompt, oldest first, or None (a read: the eviction order stays)."""
    return self._entries.get(key)

  def responses(self, key: Hashable) -> list[np.ndarray]:
    """All kept responses of a prompt (oldest epoch first); [] when unknown."""
    groups = self.get(key)
    return [r for g in groups for r in g.responses] if groups else []

  def version(self, key: Hashable) -> int | None:
    """Changes whenever the key's content changes (lets indexes built from it be cached)."""
    return self._versions.get(key)

  def predicted_length(self, key: Hashable) -> tuple[float, int] | None:
    """(mean, max) response length of the prompt's latest epoch, or None without history."""
    groups = self._entries.get(key)
    if not groups or not groups[-1].responses:
      return None
    lengths = groups[-1].lengths
    return float(lengths.mean()), int(lengths.max())

  def epoch_lengths(self, key: Hashable) -> list[tuple[int, np.ndarray]]:
    """(epoch, int64[n] response lengths) per kept epoch of a prompt, oldest first; [] when
    unknown. What the length predictor (scheduling/) reads."""
    return [(g.epoch, g.lengths) for g in self._entries.get(key) or () if g.responses]

  # --- checkpointing -----------------------------------------------------------------------

  def state_dict(self) -> dict:
    """Flat numpy arrays + a JSON string, in eviction order; `load_state_dict` restores it
    exactly."""
    keys, tokens, lengths, rewards, epochs, key_ids = [], [], [], [], [], []
    for i, (key, groups) in enumerate(self._entries.items()):
      keys.append(["s", key] if isinstance(key, str) else ["i", int(key)])
      for g in groups:
        for r, rew in zip(g.responses, g.rewards):
          tokens.append(r)
          lengths.append(len(r))
          rewards.append(rew)
          epochs.append(g.epoch)
          key_ids.append(i)
    meta = {"epochs_kept": self.epochs_kept, "max_tokens": self.max_tokens, "keys": keys,
            "evictions": self.evictions}
    return {
        "meta_json": json.dumps(meta),
        "tokens": np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32),
        "lengths": np.asarray(lengths, np.int64),
        "rewards": np.asarray(rewards, np.float32),
        "epochs": np.asarray(epochs, np.int64),
        "key_ids": np.asarray(key_ids, np.int64),
    }

  def load_state_dict(self, state: dict) -> None:
    """Replaces the content with a `state_dict()` (config included)."""
    try:
      meta_json = state["meta_json"]
      if isinstance(meta_json, np.ndarray):  # a checkpointer may hand strings back as arrays
        meta_json = meta_json.item()
      meta = json.loads(meta_json.decode() if isinstance(meta_json, bytes) else meta_json)
      tokens = np.asarray(state["tokens"], np.int32)
      lengths = np.asarray(state["lengths"], np.int64)
      rewards = np.asarray(state["rewards"], np.float32)
      epochs = np.asarray(state["epochs"], np.int64)
      key_ids = np.asarray(state["key_ids"], np.int64)
    except KeyError as e:
      raise ValueError(f"HistoryStore.load_state_dict: missing field {e}") from e
    if not len(lengths) == len(rewards) == len(epochs) == len(key_ids):
      raise ValueError("HistoryStore.load_state_dict: lengths/rewards/epochs/key_ids differ in "
                       "size")
    if int(lengths.sum()) != len(tokens):
      raise ValueError(f"HistoryStore.load_state_dict: lengths sum to {int(lengths.sum())} but "
                       f"tokens has {len(tokens)}")
    self.__init__(meta["epochs_kept"], meta["max_tokens"])
    self.evictions = int(meta.get("evictions", 0))
    keys = [k if t == "s" else int(k) for t, k in meta["keys"]]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    per_key: dict[int, list[int]] = collections.defaultdict(list)
    for j, kid in enumerate(key_ids.tolist()):
      per_key[kid].append(j)
    for i, key in enumerate(keys):
      groups: dict[int, EpochGroup] = {}
      for j in per_key.get(i, []):
        e = int(epochs[j])
        g = groups.setdefault(e, EpochGroup(e, [], np.zeros(0, np.float32)))
        g.responses.append(tokens[offsets[j]:offsets[j + 1]].copy())
        g.rewards = np.append(g.rewards, rewards[j]).astype(np.float32)
      self._entries[key] = [groups[e] for e in sorted(groups)]
      self.num_tokens += sum(g.num_tokens for g in self._entries[key])
      self._versions[key] = self.generation = next(_STAMPS)
