"""Prompt templates produce the chat messages the renderer receives."""

import pytest

from rhyme_jax.data import prompts
from rhyme_jax.data.datasets import Example

EXAMPLE = Example(uid="u", question="  Tom has 3 apples. How many?  ", answer="#### 3")


def test_messages_and_rendering():
  template = prompts.get_prompt_template("gsm8k")
  messages = prompts.build_messages(EXAMPLE, template)
  assert [m["role"] for m in messages] == ["system", "user"]
  assert messages[1]["content"].startswith("Tom has 3 apples. How many?\n\n")
  assert "####" in messages[1]["content"]
  seen = []

  def render(msgs):
    seen.append(msgs)
    return "<chat>" + "|".join(m["content"] for m in msgs)

  text = prompts.render_prompt(EXAMPLE, render, template)
  assert seen == [messages] and text.startswith("<chat>You are")
  plain = prompts.render_plain(messages)
  assert plain.startswith("System: ") and plain.endswith("\n\nAssistant:")


def test_no_system_prompt_and_errors():
  template = prompts.PromptTemplate(system=None, instruction="Answer.", answer_format="hash")
  assert [m["role"] for m in prompts.build_messages(EXAMPLE, template)] == ["user"]
  assert prompts.get_prompt_template("boxed").answer_format == "boxed"
  with pytest.raises(ValueError, match="unknown prompt template 'x'"):
    prompts.get_prompt_template("x")
  with pytest.raises(TypeError, match="tokenize=False"):
    prompts.render_prompt(EXAMPLE, lambda m: [1, 2, 3], template)
