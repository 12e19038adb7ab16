"""Prompt templates: turn an Example into chat messages, then into the prompt string.

Rendering the messages into model text is the tokenizer's chat template, passed in as a
callable so this module does not depend on a tokenizer, e.g.

  render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
  text = render_prompt(example, render, get_prompt_template("gsm8k"))

The instruction asks for the final answer in the format the rewards parse ('#### N' or
\\boxed{N}); the format reward checks that the model complied.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from rhyme_jax.data.datasets import Example

Message = dict[str, str]
RenderFn = Callable[[list[Message]], str]


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
  """A system prompt (None for none) and an instruction placed after the question."""

  system: str | None
  instruction: str
  answer_format: str  # 'hash' ('#### N') or 'boxed' (\boxed{N}): what the rewards expect.


PROMPT_TEMPLATES: dict[str, PromptTemplate] = {
    "gsm8k": PromptTemplate(
        system="You are a helpful assistant that solves math problems step by step.",
        instruction="Solve the problem step by step. On the last line, write '####' "
                    "followed by the final answer as a number.",
        answer_format="hash"),
    "arithmetic": PromptTemplate(
        system="You are a helpful assistant.",
        # No example number: SmolLM2-135M copied '#### 7' from an example verbatim.
        instruction="Give a short calculation. On the last line, write '####' followed by "
                    "the final answer.",
        answer_format="hash"),
    "boxed": PromptTemplate(
        system="You are a helpful assistant that solves math problems step by step.",
        instruction="Reason step by step, and put your final answer within \\boxed{}.",
        answer_format="boxed"),
}


def get_prompt_template(name: str) -> PromptTemplate:
  if name not in PROMPT_TEMPLATES:
    raise ValueError(f"unknown prompt template {name!r}; known: {sorted(PROMPT_TEMPLATES)}")
  return PROMPT_TEMPLATES[name]


def build_messages(example: Example, template: PromptTemplate) -> list[Message]:
  """Chat messages for one example: optional system message, then the user turn."""
  messages = []
  if template.system:
    messages.append({"role": "system", "content": template.system})
  messages.append({"role": "user", "content": f"{example.question.strip()}\n\n"
                                              f"{template.instruction}"})
  return messages


def render_plain(messages: Sequence[Message]) -> str:
  """Template-free rendering for base models without a chat template ('Role: text' lines)."""
  lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
  return "\n\n".join(lines) + "\n\nAssistant:"


def render_prompt(example: Example, render_fn: RenderFn, template: PromptTemplate) -> str:
  """The prompt string the rollout engine tokenizes for `example`."""
  text = render_fn(build_messages(example, template))
  if not isinstance(text, str):
    raise TypeError(f"render_fn must return a str (use tokenize=False), got "
                    f"{type(text).__name__}")
  return text
