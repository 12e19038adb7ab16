"""A name -> function registry: losses, advantage estimators and rewards are chosen by name."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
  """Functions of one `kind` (named in errors), registered with a decorator."""

  def __init__(self, kind: str):
    self.kind = kind
    self._fns: dict[str, F] = {}

  def register(self, name: str) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
      if name in self._fns:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._fns[name] = fn
      return fn
    return wrap

  def get(self, name: str) -> F:
    """The function registered as `name`; unknown names list the known ones."""
    if name not in self._fns:
      raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._fns)}")
    return self._fns[name]

  def names(self) -> list[str]:
    return sorted(self._fns)
