"""Question/answer datasets for RL: validated jsonl / parquet readers and named datasets.

Every record becomes an `Example` with a stable uid: the record's own `uid`/`id` field when it
has one, else a hash of its question and answer (so the uid survives reordering or moving the
file; the history store keys past responses by it). Bad input fails loudly with the file, the
line and the field at fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from rhyme_jax.data import arithmetic
from rhyme_jax.data.example import DatasetError, Example, content_uid

__all__ = ["DatasetError", "Example", "content_uid", "load_examples", "load_gsm8k",
           "read_examples", "read_jsonl", "read_parquet", "records_to_examples"]

REQUIRED_FIELDS = ("question", "answer")
GSM8K_DIR_ENV = "RHYME_JAX_GSM8K_DIR"
_OLD_GSM8K_DIR_ENV = "RHYME_GSM8K_DIR"
ARITHMETIC_TRAIN_SIZE = 2000  # problems generated when no train size is given
ARITHMETIC_TEST_SIZE = 200  # held-out problems (fixed: the train split excludes them)


def project_root() -> Path:
  """The repository root (the directory holding the `rhyme_jax` package)."""
  return Path(__file__).resolve().parents[2]


def default_gsm8k_dir() -> Path:
  """GSM8K location: $RHYME_JAX_GSM8K_DIR if set, else `<repo>/../shared/datasets/gsm8k`."""
  env = os.environ.get(GSM8K_DIR_ENV)
  if env:
    return Path(env)
  if os.environ.get(_OLD_GSM8K_DIR_ENV):  # the name older docs gave: refuse, don't ignore it
    raise DatasetError(f"${_OLD_GSM8K_DIR_ENV} is set but not read: the variable is "
                       f"${GSM8K_DIR_ENV} (or pass --data_dir)")
  return project_root().parent / "shared" / "datasets" / "gsm8k"


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
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape ("\ud83d"): no text can hold it
      raise DatasetError(f"{where}: field {name!r} holds an unpaired surrogate "
                         f"{value[e.start]!r} at character {e.start}") from e
  return record


def _json_array(path, line_no: int) -> DatasetError:
  return DatasetError(f"{path}:{line_no}: a JSON array; expected JSON Lines (one object per "
                      "line)")


def read_jsonl(path: str | os.PathLike, required: Sequence[str] = REQUIRED_FIELDS
               ) -> list[tuple[int, dict]]:
  """Read a jsonl file into (line number, record) pairs; blank lines are skipped."""
  path = Path(path)
  if not path.is_file():
    raise DatasetError(f"{path}: dataset file not found")
  records = []
  with path.open("rb") as f:
    for line_no, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DatasetError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                           f"{e.start + 1})") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if not records and line.lstrip().startswith("["):  # one JSON array, over lines
          raise _json_array(path, line_no) from e
        raise DatasetError(f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno})"
                           ) from e
      if isinstance(record, list) and record and all(isinstance(r, dict) for r in record):
        raise _json_array(path, line_no)
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
  try:
    table = pq.read_table(path)
  except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
    raise DatasetError(f"{path}: not a readable parquet file "
                       f"({' '.join(str(e).split())[:200]})") from e
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


def read_examples(path: str | os.PathLike, uid_prefix: str | None = None) -> list[Example]:
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
    raise DatasetError(f"{path}: GSM8K file not found; pass --data_dir or set "
                       f"${GSM8K_DIR_ENV}")
  return read_examples(path, uid_prefix=f"gsm8k-{split}")


def load_examples(source: str, split: str = "train", *,
                  data_dir: str | os.PathLike | None = None, train_size: int = 0,
                  seed: int = 0) -> list[Example]:
  """The one loader: 'gsm8k', 'arithmetic' (synthetic) or a .jsonl / .parquet path.

  `train_size` > 0 keeps the first that many training examples (more than there are is an
  error; for 'arithmetic' it is how many problems to generate, default
  `ARITHMETIC_TRAIN_SIZE`); evaluation splits are whole.
  Errors are `DatasetError`s naming the file and line.
  """
  if source == "gsm8k":
    examples = load_gsm8k(split, data_dir)
  elif source == "arithmetic":
    try:
      return arithmetic.arithmetic_split(split, num_train=train_size or ARITHMETIC_TRAIN_SIZE,
                                         num_test=ARITHMETIC_TEST_SIZE, seed=seed)
    except ValueError as e:  # too many problems asked for: that is the flag's doing
      raise DatasetError(f"--train_size={train_size}: {e}" if train_size else str(e)) from e
  elif Path(source).suffix:
    examples = read_examples(source)
  else:
    raise DatasetError(f"unknown dataset {source!r}: use 'gsm8k', 'arithmetic' or a path to "
                       "a .jsonl / .parquet file")
  if split == "train" and train_size:
    if train_size > len(examples):  # not fewer than asked, silently
      raise DatasetError(f"--train_size={train_size}: {source} has {len(examples)} training "
                         "examples")
    examples = examples[:train_size]
  return examples
