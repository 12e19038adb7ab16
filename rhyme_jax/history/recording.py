"""Recorded rollouts: the tokens a real engine emitted, kept so drafters can be replayed offline.

With position-keyed sampling a speculative rollout emits exactly the plain rollout's tokens, so
the accepted length of any drafter on any step is fixed by the recorded response alone: a
drafter can be measured with no model (`history.replay`). A `Recording` is one rollout (one
epoch at one sampling setting) of a set of prompts, G responses each.

File format (`.npz`, `Recording.save` / `Recording.load`):
  tokens       int32[sum of lengths]  all responses concatenated (EOS included when hit)
  lengths      int64[R]               response lengths
  request_ids  int64[R]               the engine's request ids
  prompt_index int64[R]               which prompt (index into `prompt_keys` / `prompt_lengths`)
  finish       <U8[R]                 finish reasons ("eos" | "stop" | "length")
  prompt_tokens int32[sum of prompt lengths], prompt_lengths int64[P], prompt_keys str[P]
  meta_json    str: {"epoch", "seed", "temperature", "top_p", "top_k", "max_new_tokens",
                "group_size", "model", "dataset", "split", "prompt_offset", "dtype", ...}
Group ids are "e{epoch}/p{prompt_index}"; prompt keys are `store.prompt_key(prompt tokens)`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

FIELDS = ("tokens", "lengths", "request_ids", "prompt_index", "finish", "prompt_tokens",
          "prompt_lengths", "prompt_keys", "meta_json")


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  return [flat[offsets[i]:offsets[i + 1]] for i in range(len(lengths))]


@dataclasses.dataclass
class Recording:
  """One recorded rollout: R responses to P prompts (G = R / P each) and how they were sampled."""

  responses: list[np.ndarray]  # int32 tokens per request
  request_ids: np.ndarray  # int64[R]
  prompt_index: np.ndarray  # int64[R]
  finish: list[str]
  prompts: list[np.ndarray]  # int32 prompt tokens per prompt
  prompt_keys: list[str]
  meta: dict

  def __post_init__(self):
    r = len(self.responses)
    if not len(self.request_ids) == len(self.prompt_index) == len(self.finish) == r:
      raise ValueError(f"Recording: {r} responses but {len(self.request_ids)} request ids, "
                       f"{len(self.prompt_index)} prompt indices, {len(self.finish)} finish "
                       "reasons")
    if len(self.prompts) != len(self.prompt_keys):
      raise ValueError(f"Recording: {len(self.prompts)} prompts but {len(self.prompt_keys)} keys")
    if r and not 0 <= int(np.min(self.prompt_index)) <= int(np.max(self.prompt_index)) < len(
        self.prompts):
      raise ValueError(f"Recording: prompt_index outside [0, {len(self.prompts)})")

  @property
  def epoch(self) -> int:
    return int(self.meta.get("epoch", 0))

  @property
  def temperature(self) -> float:
    return float(self.meta.get("temperature", float("nan")))

  def group_id(self, i: int) -> str:
    return f"e{self.epoch}/p{int(self.prompt_index[i])}"

  def groups(self) -> dict[str, list[np.ndarray]]:
    """{prompt key: responses} (what a history store records after this rollout)."""
    out: dict[str, list[np.ndarray]] = {}
    for i, r in enumerate(self.responses):
      out.setdefault(self.prompt_keys[int(self.prompt_index[i])], []).append(r)
    return out

  @property
  def num_tokens(self) -> int:
    return int(sum(len(r) for r in self.responses))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the `.npz` format above (compressed)."""
    lengths = np.array([len(r) for r in self.responses], np.int64)
    flat = (np.concatenate(self.responses).astype(np.int32) if self.responses
            else np.zeros(0, np.int32))
    plen = np.array([len(p) for p in self.prompts], np.int64)
    pflat = np.concatenate(self.prompts).astype(np.int32) if self.prompts else np.zeros(0, np.int32)
    tmp = str(path) + ".tmp.npz"
    np.savez_compressed(tmp, tokens=flat, lengths=lengths,
                        request_ids=np.asarray(self.request_ids, np.int64),
                        prompt_index=np.asarray(self.prompt_index, np.int64),
                        finish=np.array(self.finish, dtype="<U8"), prompt_tokens=pflat,
                        prompt_lengths=plen,
                        prompt_keys=np.array([str(k) for k in self.prompt_keys], str),
                        meta_json=np.array(json.dumps(self.meta)))
    os.replace(tmp, path)  # readers never see a half-written file

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Recording":
    """Reads a file written by `save`; a missing field is named in the error."""
    with np.load(path, allow_pickle=False) as z:
      missing = [f for f in FIELDS if f not in z.files]
      if missing:
        raise ValueError(f"{path}: not a recording, missing field(s) {missing}")
      lengths = z["lengths"]
      if int(lengths.sum()) != len(z["tokens"]):
        raise ValueError(f"{path}: lengths sum to {int(lengths.sum())} but tokens has "
                         f"{len(z['tokens'])}")
      return cls(responses=_split(z["tokens"].astype(np.int32), lengths),
                 request_ids=z["request_ids"].astype(np.int64),
                 prompt_index=z["prompt_index"].astype(np.int64),
                 finish=[str(f) for f in z["finish"]],
                 prompts=_split(z["prompt_tokens"].astype(np.int32), z["prompt_lengths"]),
                 prompt_keys=[str(k) for k in z["prompt_keys"]],
                 meta=json.loads(str(z["meta_json"])))


def merge(recordings: list[Recording]) -> Recording:
  """Recordings of consecutive prompt ranges of one rollout (same epoch and sampling) as one."""
  if not recordings:
    raise ValueError("merge: no recordings")
  first = recordings[0].meta
  for r in recordings[1:]:
    for k in ("epoch", "temperature", "top_p", "seed", "max_new_tokens", "group_size"):
      if r.meta.get(k) != first.get(k):
        raise ValueError(f"merge: recordings differ in {k} ({first.get(k)} vs {r.meta.get(k)})")
  offsets = np.cumsum([0] + [len(r.prompts) for r in recordings])
  meta = dict(first, num_prompts=int(offsets[-1]))
  return Recording(
      responses=[x for r in recordings for x in r.responses],
      request_ids=np.concatenate([r.request_ids for r in recordings]),
      prompt_index=np.concatenate([r.prompt_index + o for r, o in zip(recordings, offsets)]),
      finish=[f for r in recordings for f in r.finish],
      prompts=[p for r in recordings for p in r.prompts],
      prompt_keys=[k for r in recordings for k in r.prompt_keys], meta=meta)


def split_groups(rec: Recording) -> tuple[Recording, Recording]:
  """Each group's responses split in two halves (even / odd positions in the group): a
  'history' and a 'target' rollout of the same prompts, G/2 each. With unchanged weights
  and independent draws this is a previous epoch and a fresh-seed epoch (smaller groups)."""
  halves = []
  for parity in (0, 1):
    seen: dict[int, int] = {}
    pick = []
    for i in range(len(rec.responses)):
      p = int(rec.prompt_index[i])
      if seen.get(p, 0) % 2 == parity:
        pick.append(i)
      seen[p] = seen.get(p, 0) + 1
    meta = dict(rec.meta, epoch=rec.epoch + parity,
                group_size=(rec.meta.get("group_size") or 2) // 2, split_of=rec.epoch)
    halves.append(Recording([rec.responses[i] for i in pick], rec.request_ids[pick],
                            rec.prompt_index[pick], [rec.finish[i] for i in pick],
                            rec.prompts, rec.prompt_keys, meta))
  return halves[0], halves[1]
