"""bench/prefill_share.py: bad flags are one line naming them; a real run (SmolLM2, one GSM8K
prompt x 2 samples) prints both variants with equal token CRCs and fewer prefill calls shared."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import prefill_share  # noqa: E402


@pytest.mark.parametrize("flag", ["--num_prompts=0", "--group_size=-1", "--repeats=0"])
def test_bad_flag_is_one_line_naming_it(flag, capsys):
  with pytest.raises(SystemExit):
    prefill_share.parse_args([flag])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert flag.split("=")[0] in err and "must be >= 1" in err


def test_a_real_run_shares_the_prompt_and_samples_the_same(capsys):
  from rhyme_jax.data import datasets
  if not (datasets.default_gsm8k_dir() / "train.jsonl").is_file():
    pytest.skip("the shared GSM8K copy is missing; CI has it")
  prefill_share.main(["--num_prompts=1", "--group_size=2", "--max_new_tokens=2", "--repeats=1",
                      "--no_append"])
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
          for line in capsys.readouterr().out.splitlines()
          if line.startswith(("| shared", "| per request"))}
  shared, alone = rows["shared"], rows["per request"]
  assert int(shared[1]) * 2 == int(alone[1]) and shared[2] == "1" and alone[2] == "0"
  assert shared[-1] == alone[-1]  # tokens CRC32
