"""Dataset readers: validation errors name file/line/field; GSM8K loads with stable uids."""

import json

import pytest

from rhyme_jax.data import datasets
from rhyme_jax.data.datasets import DatasetError


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def test_reads_jsonl_with_stable_unique_uids(tmp_path):
  rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4",
                                                      "level": 3},
          {"question": "1+1?", "answer": "#### 2"}]
  path = _write(tmp_path / "train.jsonl", [json.dumps(r) for r in rows[:2]] + [""] +
                [json.dumps(rows[2])])
  examples = datasets.read_examples(path)
  assert [e.question for e in examples] == ["1+1?", "2+2?", "1+1?"]
  assert examples[1].meta["level"] == 3 and examples[1].meta["line"] == 2
  assert examples[2].meta["line"] == 4  # Blank line 3 skipped, numbering kept.
  assert len({e.uid for e in examples}) == 3
  assert examples[2].uid == examples[0].uid + "-2"
  assert examples[0].uid.startswith("train-")
  # Same content in another order and file: same uids.
  moved = _write(tmp_path / "train2.jsonl", [json.dumps(rows[1]), json.dumps(rows[0])])
  again = datasets.read_examples(moved, uid_prefix="train")
  assert again[1].uid == examples[0].uid and again[0].uid == examples[1].uid


def test_own_ids_are_kept_and_duplicates_rejected(tmp_path):
  path = _write(tmp_path / "d.jsonl", [json.dumps({"id": 7, "question": "q", "answer": "a"}),
                                       json.dumps({"id": 7, "question": "r", "answer": "b"})])
  with pytest.raises(DatasetError, match=r"d\.jsonl:2: duplicate id 7"):
    datasets.read_examples(path)
  path = _write(tmp_path / "e.jsonl", [json.dumps({"id": 7, "question": "q", "answer": "a"})])
  assert datasets.read_examples(path, uid_prefix="")[0].uid == "7"


def test_malformed_json_names_file_and_line(tmp_path):
  path = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "q", "answer": "a"}),
                                         '{"question": "q", "answer": ', "{}"])
  with pytest.raises(DatasetError, match=r"bad\.jsonl:2: malformed JSON"):
    datasets.read_examples(path)


@pytest.mark.parametrize("record,field", [({"answer": "a"}, "question"),
                                          ({"question": "q"}, "answer"),
                                          ({"question": "q", "answer": 3}, "answer"),
                                          ({"question": " ", "answer": "a"}, "question")])
def test_missing_or_bad_field_names_file_line_field(tmp_path, record, field):
  path = _write(tmp_path / "f.jsonl", [json.dumps({"question": "q", "answer": "a"})] * 2 +
                [json.dumps(record)])
  with pytest.raises(DatasetError, match=rf"f\.jsonl:3: .*field '{field}'"):
    datasets.read_examples(path)


def test_non_object_line(tmp_path):
  path = _write(tmp_path / "g.jsonl", ["[1, 2]"])
  with pytest.raises(DatasetError, match=r"g\.jsonl:1: expected a JSON object, got list"):
    datasets.read_examples(path)


def test_empty_and_missing_files(tmp_path):
  empty = _write(tmp_path / "empty.jsonl", ["", "  "])
  with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset is empty"):
    datasets.read_examples(empty)
  with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found"):
    datasets.read_examples(tmp_path / "nope.jsonl")
  with pytest.raises(DatasetError, match=r"unsupported dataset format '\.csv'"):
    datasets.read_examples(tmp_path / "x.csv")


def test_parquet_reads_or_explains(tmp_path):
  path = tmp_path / "d.parquet"
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    path.write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"d\.parquet: reading parquet needs the `pyarrow`"):
      datasets.read_examples(path)
    return
  pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 1", "#### 2"]}), path)
  assert [e.answer for e in datasets.read_examples(path)] == ["#### 1", "#### 2"]
  pq.write_table(pa.table({"question": ["q1"]}), path)
  with pytest.raises(DatasetError, match="missing required column 'answer'"):
    datasets.read_examples(path)
  path.write_bytes(b"PAR1 not a parquet file")
  with pytest.raises(DatasetError, match=r"d\.parquet: not a readable parquet file"):
    datasets.read_examples(path)


GSM8K_MISSING = ("the shared GSM8K copy (../shared/datasets/gsm8k/test.jsonl next to the "
                 "checkout) is missing; CI has it")


def test_gsm8k_default_location(monkeypatch):
  monkeypatch.delenv(datasets.GSM8K_DIR_ENV, raising=False)
  monkeypatch.delenv("RHYME_GSM8K_DIR", raising=False)
  assert datasets.default_gsm8k_dir() == datasets.project_root().parent / "shared" / \
      "datasets" / "gsm8k"
  if not (datasets.default_gsm8k_dir() / "test.jsonl").is_file():
    pytest.skip(GSM8K_MISSING)
  test = datasets.load_gsm8k("test")
  assert len(test) == 1319
  assert all("####" in e.answer for e in test)
  assert test[0].uid.startswith("gsm8k-test-") and len({e.uid for e in test}) == len(test)
  assert datasets.load_gsm8k("test")[5].uid == test[5].uid


def test_gsm8k_override_by_argument_and_environment(tmp_path, monkeypatch):
  assert datasets.GSM8K_DIR_ENV == "RHYME_JAX_GSM8K_DIR"  # the name the docs give
  _write(tmp_path / "test.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})])
  assert len(datasets.load_gsm8k("test", data_dir=tmp_path)) == 1
  monkeypatch.setenv(datasets.GSM8K_DIR_ENV, str(tmp_path))
  assert len(datasets.load_examples("gsm8k", "test")) == 1
  with pytest.raises(DatasetError, match="train.jsonl: GSM8K file not found.*RHYME_JAX_GSM8K_DIR"):
    datasets.load_gsm8k("train")
  with pytest.raises(DatasetError, match="split must be"):
    datasets.load_gsm8k("dev")
  monkeypatch.delenv(datasets.GSM8K_DIR_ENV)
  monkeypatch.setenv("RHYME_GSM8K_DIR", str(tmp_path))  # the name old docs gave
  with pytest.raises(DatasetError, match=r"\$RHYME_GSM8K_DIR is set but not read: the variable "
                     r"is \$RHYME_JAX_GSM8K_DIR"):
    datasets.load_examples("gsm8k", "test")


def test_load_examples_sources(tmp_path):
  assert len(datasets.load_examples("arithmetic", "test")) == datasets.ARITHMETIC_TEST_SIZE
  assert len(datasets.load_examples("arithmetic", "train", train_size=7)) == 7
  path = tmp_path / "d.jsonl"
  _write(path, [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(5)])
  assert [e.answer for e in datasets.load_examples(str(path), "train", train_size=2)] == \
      ["#### 0", "#### 1"]
  assert len(datasets.load_examples(str(path), "test", train_size=2)) == 5
  with pytest.raises(DatasetError, match=rf"^--train_size=6: {path} has 5 training examples$"):
    datasets.load_examples(str(path), "train", train_size=6)
  with pytest.raises(DatasetError, match="unknown dataset 'foo'"):
    datasets.load_examples("foo")


def test_more_arithmetic_problems_than_exist_names_the_flag(monkeypatch):
  """(Drawing past the ~200k distinct problems takes half a minute: the generator's refusal
  is stood in for.)"""
  def refuse(split, num_train, **kw):
    raise ValueError(f"arithmetic: could not draw {num_train} distinct problems")
  monkeypatch.setattr(datasets.arithmetic, "arithmetic_split", refuse)
  with pytest.raises(DatasetError, match=r"^--train_size=250000: arithmetic: could not draw"):
    datasets.load_examples("arithmetic", "train", train_size=250000)


def test_non_utf8_byte_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+\xff?", '
                   b'"answer": "#### 4"}\n')
  with pytest.raises(DatasetError, match=r"bad.jsonl:2: not UTF-8 \(byte 0xff at column 17\)"):
    datasets.read_examples(path)


def test_unpaired_surrogate_and_json_array_name_the_line(tmp_path):
  """Scraped text can carry a lone surrogate escape, which no UTF-8 text holds; a .json file
  holding one array is valid JSON but not JSON Lines: both named, not a traceback."""
  from rhyme_jax.data.datasets import read_jsonl
  path = tmp_path / "d.jsonl"
  path.write_text('{"question": "1+1?", "answer": "#### 2"}\n'
                  '{"question": "smile \\ud83d?", "answer": "#### 2"}\n')
  with pytest.raises(DatasetError, match=rf"^{path}:2: field 'question' holds an unpaired "
                     r"surrogate '\\ud83d' at character 6$"):
    read_jsonl(path)
  path.write_text('[{"question": "1+1?", "answer": "#### 2"},\n {"question": "2+2?"}]\n')
  with pytest.raises(DatasetError, match=rf"^{path}:1: a JSON array; expected JSON Lines"):
    read_jsonl(path)
  path.write_text('[{"question": "1+1?", "answer": "#### 2"}]\n')
  with pytest.raises(DatasetError, match=rf"^{path}:1: a JSON array; expected JSON Lines"):
    read_jsonl(path)
