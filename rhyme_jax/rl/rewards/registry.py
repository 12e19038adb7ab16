"""Reward functions by name: `get_reward_fn(name)(completion_text, example) -> float`.

A reward is built by a registered factory and wraps a `score` function returning a
`RewardResult`: the scalar reward plus its named components (correctness, format, ...) and the
answer it extracted, for logging. Names combine with '+' and optional weights:
'gsm8k+0.1*format' is the GSM8K correctness reward plus 0.1 x the format reward.

Examples are `rhyme_jax.data.datasets.Example` objects or plain mappings with the same fields
(`answer`, optional `meta`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

from rhyme_jax.rl.registry import Registry

ScoreFn = Callable[[str, Any], "RewardResult"]


@dataclasses.dataclass(frozen=True)
class RewardResult:
  reward: float
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)
  extracted: str | None = None  # The answer parsed from the completion, if any.


class RewardFn:
  """Callable reward: `fn(completion, example) -> float`; `fn.score(...)` gives the details."""

  def __init__(self, name: str, score: ScoreFn):
    self.name = name
    self._score = score

  def score(self, completion: str, example: Any) -> RewardResult:
    if not isinstance(completion, str):
      raise TypeError(f"reward {self.name!r}: completion must be a str, got "
                      f"{type(completion).__name__}")
    return self._score(completion, example)

  def __call__(self, completion: str, example: Any) -> float:
    return float(self.score(completion, example).reward)

  def __repr__(self):
    return f"RewardFn({self.name!r})"


# Factories `(**options) -> score(completion, example) -> RewardResult`, by name.
_REGISTRY: Registry[Callable[..., ScoreFn]] = Registry("reward")
register_reward = _REGISTRY.register  # decorator
available_rewards = _REGISTRY.names


_TERM = re.compile(r"^\s*(?:(\d+(?:\.\d*)?|\.\d+)\s*\*\s*)?([A-Za-z_][\w]*)\s*$")


def get_reward_fn(name: str, **options) -> RewardFn:
  """A reward by name ('gsm8k', 'gsm8k+0.1*format', ...); options go to a single factory."""
  if "+" not in name and "*" not in name:
    return RewardFn(name, _REGISTRY.get(name)(**options))
  if options:
    raise ValueError(f"reward {name!r}: options apply to a single reward, not a combination")
  weighted = {}
  for term in name.split("+"):
    m = _TERM.match(term)
    if not m:
      raise ValueError(f"reward {name!r}: cannot parse term {term!r}; use 'name' or "
                       "'weight*name' joined by '+'")
    weight, sub = float(m.group(1) or 1.0), m.group(2)
    if sub in weighted:
      raise ValueError(f"reward {name!r}: {sub!r} appears twice")
    weighted[sub] = weight
  return combine_rewards(weighted, name=name)


def combine_rewards(weights: Mapping[str, float], name: str | None = None) -> RewardFn:
  """Weighted sum of registered rewards; components are prefixed with each reward's name."""
  parts = {sub: get_reward_fn(sub) for sub in weights}

  def score(completion: str, example: Any) -> RewardResult:
    total, components, extracted = 0.0, {}, None
    for sub, fn in parts.items():
      result = fn.score(completion, example)
      total += weights[sub] * result.reward
      components[sub] = result.reward
      components.update({f"{sub}/{k}": v for k, v in result.components.items()})
      extracted = extracted if extracted is not None else result.extracted
    return RewardResult(total, components, extracted)

  return RewardFn(name or "+".join(f"{w}*{s}" for s, w in weights.items()), score)


def example_field(example: Any, field: str) -> Any:
  """`example.field` or `example[field]`, with a clear error when missing."""
  if isinstance(example, Mapping):
    if field in example:
      return example[field]
  elif hasattr(example, field):
    return getattr(example, field)
  raise KeyError(f"reward: example has no field {field!r} (got {type(example).__name__})")


def example_meta(example: Any) -> Mapping[str, Any]:
  """The example's meta mapping ({} when it has none)."""
  if isinstance(example, Mapping):
    return example.get("meta") or {}
  return getattr(example, "meta", None) or {}
