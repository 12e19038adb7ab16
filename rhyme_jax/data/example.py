"""`Example`, the unit every dataset yields, and the error every dataset reader raises.

Kept apart from the readers so generators (`rhyme_jax.data.arithmetic`) and readers
(`rhyme_jax.data.datasets`) both build on it without importing each other.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping


class DatasetError(ValueError):
  """A dataset file is missing, malformed or lacks a required field."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One RL prompt source: a question and its reference answer.

  `answer` is the reference text; for GSM8K-style data it ends with '#### <number>'.
  `meta` keeps the record's other fields (source file, line, generator parameters...).
  """

  uid: str
  question: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)


def content_uid(question: str, answer: str, prefix: str = "") -> str:
  """Stable id from the content: the same question/answer always gets the same uid."""
  digest = hashlib.sha1(f"{question}\x00{answer}".encode("utf-8")).hexdigest()[:16]
  return f"{prefix}-{digest}" if prefix else digest


def examples_fingerprint(examples) -> dict[str, Any]:
  """{"examples": N, "sha256": ...} of the examples' ids and texts, in order: what a resumed
  run compares (run_config.json's "data") so that a dataset edited or swapped between runs,
  which the flags cannot show, is refused instead of shifting the data order."""
  h = hashlib.sha256()
  for e in examples:
    for part in (e.uid, e.question, e.answer):
      h.update(part.encode("utf-8"))
      h.update(b"\x00")
  return {"examples": len(examples), "sha256": h.hexdigest()}
