"""bench/warmup_cost.py: one-line errors for a bad flagfile or trainer flags, and (slow) a tiny
real run that counts the speculative shapes HistoSpec adds."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import warmup_cost  # noqa: E402


def test_a_missing_flagfile_names_the_flag(capsys):
  with pytest.raises(SystemExit):
    warmup_cost.main(["--flagfile", "configs/no_such.flags", "--no_append"])
  assert "--flagfile=configs/no_such.flags" in capsys.readouterr().err


def test_a_bad_trainer_flag_fails_in_one_line_naming_it():
  with pytest.raises(SystemExit, match="--micro_batch_size"):
    warmup_cost.main(["--flagfile", "configs/quickstart.flags", "--flag=--prompts_per_step=1",
                      "--flag=--group_size=2", "--no_append"])


def test_bad_compile_threads_is_one_clear_error(capsys):
  with pytest.raises(SystemExit):
    warmup_cost.main(["--compile_threads", "1,x", "--no_append"])
  assert "--compile_threads: '1,x': expected integers >= 0" in capsys.readouterr().err


TINY = ["--flagfile", "configs/quickstart.flags", "--flag=--prompts_per_step=1",
        "--flag=--group_size=2", "--flag=--micro_batch_size=2", "--flag=--max_new_tokens=8",
        "--flag=--overlong_buffer=0", "--flag=--max_prompt_len=16", "--no_append"]


@pytest.mark.slow
def test_histospec_compiles_more_step_shapes_than_plain(capsys):
  assert warmup_cost.main(TINY + ["--compile_threads", "1,2"]) == 0
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
          for line in capsys.readouterr().out.splitlines() if line.startswith("| ")
          and not line.startswith("| variant") and not line.startswith("|---")}
  plain, spec = rows["plain"], rows["+HistoSpec"]  # the last rows: 2 compile threads
  assert (plain[1], spec[1]) == ("2", "2")
  assert int(plain[4]) == 2 * 2  # buckets (2, 1) x two KV lengths, one plain shape each
  assert int(spec[4]) > int(plain[4]) and float(spec[6]) > 0
