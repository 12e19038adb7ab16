"""check_inputs (rl/inputs.py): what a run reads, refused with one line before anything is
written. (The exit statuses and the whole program: tests/test_main.py.)"""

from __future__ import annotations

import json
import os

import pytest

import train_entry

from rhyme_jax.config import ConfigError, parse_flags
from rhyme_jax.data.datasets import DatasetError
from rhyme_jax.models.loading import ModelError
from rhyme_jax.rl.inputs import check_inputs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return train_entry.write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def flags(model, run_dir, *extra):
  return parse_flags([f"--model={model}", "--tokenizer=smollm2-135m-instruct",
                      f"--run_dir={run_dir}", "--train_size=4", "--group_size=2",
                      "--prompts_per_step=2", "--max_new_tokens=4", "--max_prompt_len=128",
                      *extra])


def test_valid_inputs_pass(tiny_model, tmp_path):
  inputs = check_inputs(flags(tiny_model, tmp_path / "run"))
  assert len(inputs.train_examples) == 4
  assert not (tmp_path / "run").exists()


def test_reference_the_reward_cannot_read_names_the_line(tiny_model, tmp_path):
  """--reward=gsm8k reads the number after '####': an answer without one failed in the step
  that sampled it, after the run directory was written."""
  data = tmp_path / "d.jsonl"
  data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+3?", "answer": "5"}\n')
  with pytest.raises(DatasetError, match=rf"^{data}:2: --reward=gsm8k: gsm8k reward: reference "
                     r"answer has no '####': '5'$"):
    check_inputs(flags(tiny_model, tmp_path / "run", f"--dataset={data}", "--reward=gsm8k",
                       "--train_size=0"))
  check_inputs(flags(tiny_model, tmp_path / "run", f"--dataset={data}", "--reward=format",
                     "--train_size=0"))  # a reward that reads no reference takes it


def _tokenizer_dir(path, chat_template=None):
  """SmolLM2's tokenizer as an HF directory, with this chat template (or none)."""
  from rhyme_jax.models.tokenizer import load_tokenizer
  os.makedirs(path, exist_ok=True)
  load_tokenizer("smollm2-135m-instruct").backend.save(os.path.join(path, "tokenizer.json"))
  conf = {"eos_token": "<|im_end|>"}
  if chat_template is not None:
    conf["chat_template"] = chat_template
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(conf, f)
  return path


@pytest.mark.parametrize("template, message", [
    (None, "no chat template"),
    ("{% for m in messages %}{{ m.content }}", "chat template: Unexpected end of template"),
    ("{{ raise_exception('Conversation roles must alternate') }}",
     "chat template: Conversation roles must alternate"),
], ids=["none", "syntax", "raises"])
def test_chat_template_that_cannot_render_is_a_model_error(tiny_model, tmp_path, template,
                                                             message):
  tok = _tokenizer_dir(tmp_path / "tok", template)
  with pytest.raises(ModelError, match=rf"^--tokenizer={tok}: .*{message}"):
    check_inputs(flags(tiny_model, tmp_path / "run", f"--tokenizer={tok}"))


def test_broken_tokenizer_json_names_the_file(tiny_model, tmp_path):
  tok = _tokenizer_dir(tmp_path / "tok", "{{ messages[0].content }}")
  tj = tok / "tokenizer.json"
  os.truncate(tj, tj.stat().st_size // 2)
  with pytest.raises(ModelError, match=rf"{tj}: cannot read the tokenizer \(EOF"):
    check_inputs(flags(tiny_model, tmp_path / "run", f"--tokenizer={tok}"))


def test_run_dir_that_is_a_file_is_refused(tiny_model, tmp_path):
  (tmp_path / "run").write_text("not a directory")
  with pytest.raises(ConfigError, match="--run_dir=.*: exists and is not a directory"):
    check_inputs(flags(tiny_model, tmp_path / "run"))
  # Below a file, it could never be created: refused here, not at the first checkpoint.
  with pytest.raises(ConfigError, match=rf"^--run_dir={tmp_path}/run/x/y: cannot be written "
                                        rf"\({tmp_path}/run is not a directory\)$"):
    check_inputs(flags(tiny_model, tmp_path / "run" / "x" / "y"))
  assert not (tmp_path / "run" / "x").exists()
