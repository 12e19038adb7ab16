"""Question/answer datasets for RL: validated jsonl / parquet readers and named datasets.

Every record becomes an `Example` with a stable uid: the record's own `uid`/`id` field when it
has one, else a hash of its question and answer (so the uid survives reordering or moving the
file; the history store keys past responses by it). Bad input fails loudly with the file, the
line and the field at fault.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

REQUIRED_FIELDS = ("question", "answer")
GSM8K_DIR_ENV = "RHYME_JAX_GSM8K_DIR"


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


def project_root() -> Path:
  """The repository root (the directory holding the `rhyme_jax` package)."""
  return Path(__file__).resolve().parents[2]


def default_gsm8k_dir() -> Path:
  """GSM8K location: $RHYME_JAX_GSM8K_DIR if set, else `<repo>/../shared/datasets/gsm8k`."""
  env = os.environ.get(GSM8K_DIR_ENV)
  if env:
    return Path(env)
  return project_root().parent / "shared" / "datasets" / "gsm8k"


def content_uid(question: str, answer: str, prefix: str = "") -> str:
  """Stable id from the content: the same question/answer always gets the same uid."""
  digest = hashlib.sha1(f"{question}\x00{answer}".encode("utf-8")).hexdigest()[:16]
  return f"{prefix}-{digest}" if prefix else digest


def _validate_record(record: Any, where: str, required: Sequence[str]) -> dict:
  if not isinstance(record, dict):
    raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
  for name in required:
    if name not in record:
      raise DatasetError(f"{where}: missing required field {name!r} (fields present: "
                         f"{sorted(record)})")
    value = record[name]
    if not isinstance(value, str) or not value.strip():
      raise DatasetError(f"{where}: field {name!r} must be a non-empty string, got "
                         f"{value!r:.80}")
  return record


def read_jsonl(path: str | os.PathLike, required: Sequence[str] = REQUIRED_FIELDS
               ) -> list[tuple[int, dict]]:
  """Read a jsonl file into (line number, record) pairs; blank lines are skipped."""
  path = Path(path)
  if not path.is_file():
    raise DatasetError(f"{path}: dataset file not found")
  records = []
  with path.open("r", encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno})"
                           ) from e
      records.append((line_no, _validate_record(record, f"{path}:{line_no}", required)))
  if not records:
    raise DatasetError(f"{path}: dataset is empty (no records)")
  return records


def read_parquet(path: str | os.PathLike, required: Sequence[str] = REQUIRED_FIELDS
                 ) -> list[tuple[int, dict]]:
  """Read a parquet file into (row number, record) pairs (rows numbered from 1)."""
  path = Path(path)
  if not path.is_file():
    raise DatasetError(f"{path}: dataset file not found")
  try:
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise DatasetError(f"{path}: reading parquet needs the `pyarrow` package, which is not "
                       "installed (pip install pyarrow), or convert the file to jsonl") from e
  table = pq.read_table(path)
  for name in required:
    if name not in table.column_names:
      raise DatasetError(f"{path}: missing required column {name!r} (columns: "
                         f"{table.column_names})")
  rows = table.to_pylist()
  if not rows:
    raise DatasetError(f"{path}: dataset is empty (no rows)")
  return [(i, _validate_record(r, f"{path}:row {i}", required))
          for i, r in enumerate(rows, start=1)]


def records_to_examples(records: Iterable[tuple[int, dict]], source: str,
                        uid_prefix: str = "") -> list[Example]:
  """Turn validated records into Examples with stable, unique uids.

  Exact duplicates (same question and answer) get '-2', '-3'... appended in file order, so
  uids stay unique and deterministic.
  """
  examples, seen = [], {}
  for line_no, record in records:
    own = record.get("uid", record.get("id"))
    if own is not None:
      uid = f"{uid_prefix}-{own}" if uid_prefix else str(own)
    else:
      uid = content_uid(record["question"], record["answer"], uid_prefix)
    seen[uid] = seen.get(uid, 0) + 1
    if seen[uid] > 1:
      if own is not None:
        raise DatasetError(f"{source}:{line_no}: duplicate id {own!r}")
      uid = f"{uid}-{seen[uid]}"
    meta = {k: v for k, v in record.items() if k not in ("question", "answer")}
    meta.update(source=source, line=line_no)
    examples.append(Example(uid=uid, question=record["question"], answer=record["answer"],
                            meta=meta))
  return examples


def load_examples(path: str | os.PathLike, uid_prefix: str | None = None) -> list[Example]:
  """Load a .jsonl / .json lines or .parquet file of {question, answer} records.

  uid_prefix defaults to the file stem ('train', 'test'), which keeps uids of different
  splits apart.
  """
  path = Path(path)
  suffix = path.suffix.lower()
  if suffix in (".jsonl", ".json"):
    records = read_jsonl(path)
  elif suffix == ".parquet":
    records = read_parquet(path)
  else:
    raise DatasetError(f"{path}: unsupported dataset format {suffix!r} (use .jsonl or "
                       ".parquet)")
  return records_to_examples(records, str(path),
                             path.stem if uid_prefix is None else uid_prefix)


def load_gsm8k(split: str = "train", data_dir: str | os.PathLike | None = None
               ) -> list[Example]:
  """GSM8K `split` ('train' or 'test') from data_dir (default: `default_gsm8k_dir()`)."""
  if split not in ("train", "test"):
    raise DatasetError(f"gsm8k: split must be 'train' or 'test', got {split!r}")
  root = Path(data_dir) if data_dir is not None else default_gsm8k_dir()
  path = root / f"{split}.jsonl"
  if not path.is_file():
    raise DatasetError(f"{path}: GSM8K file not found; pass data_dir or set "
                       f"${GSM8K_DIR_ENV}")
  return load_examples(path, uid_prefix=f"gsm8k-{split}")


def load_dataset(name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None,
                 **kwargs) -> list[Example]:
  """Resolve a dataset by name: 'gsm8k', 'arithmetic' (synthetic) or a path to a file.

  kwargs go to the synthetic generator (`num_examples`, `seed`, ...).
  """
  if name == "gsm8k":
    return load_gsm8k(split, data_dir)
  if name == "arithmetic":
    from rhyme_jax.data import arithmetic  # pylint: disable=import-outside-toplevel
    return arithmetic.arithmetic_split(split, **kwargs)
  if Path(name).suffix:
    return load_examples(name)
  raise DatasetError(f"unknown dataset {name!r}: use 'gsm8k', 'arithmetic' or a path to a "
                     ".jsonl / .parquet file")
