"""What the engine keeps per request while it runs, and the checks made on its tokens.

`LiveRequest` is one admitted request's host-side record: tokens and log-probs so far, the
counters its result reports, the tree drafted ahead for it, and its divided-rollout marks. The
rollout loop (loop.py) owns the slots; these helpers hold what each request alone decides:
whether it can run (`validate`), whether it has finished (`finish_reason`), what the drafter
sees of it (`query`).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from rhyme_jax.rollout.drafts import DraftQuery, DraftTree
from rhyme_jax.rollout.interface import Request, RequestResult


@dataclasses.dataclass
class LiveRequest:
  req: Request
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  steps: int = 0
  drafted: int = 0
  accepted: int = 0
  done: bool = False
  ahead: DraftTree | None = None  # drafted ahead from the context before the last step
  ahead_from: int = -1  # response length that tree continues
  since: int = 0  # response length when last (re)admitted or asked to yield (divided rollout)

  def finish_reason(self, eos_ids) -> str | None:
    """"eos", "stop", "length" once the tokens so far end the response, else None."""
    p, toks = self.req.params, self.tokens
    if toks and toks[-1] in eos_ids:
      return "eos"
    for s in p.stop_sequences:
      if len(toks) >= len(s) and tuple(toks[-len(s):]) == tuple(s):
        return "stop"
    if len(toks) >= p.max_new_tokens:
      return "length"
    return None

  def query(self, budget: int) -> tuple[DraftQuery, bool]:
    """What the drafter sees, with the continuation of the tree drafted ahead (if any) past
    the tokens emitted since; and whether those tokens left that tree (a miss)."""
    ahead, miss = None, False
    if self.ahead is not None:
      ahead = self.ahead.after(self.tokens[self.ahead_from:])
      miss = ahead is None
      self.ahead = None
    room = self.req.params.max_new_tokens - len(self.tokens) - 1
    key = self.req.prompt_key if self.req.prompt_key is not None else tuple(self.req.prompt)
    return DraftQuery(self.req.request_id, self.req.group_id, key,
                      np.asarray(self.req.prompt, np.int32), np.asarray(self.tokens, np.int32),
                      max(min(budget, room), 0), ahead), miss

  def result(self, reason: str, finish_time: float) -> RequestResult:
    return RequestResult(self.req.request_id, self.req.group_id,
                         np.asarray(self.req.prompt, np.int32), np.asarray(self.tokens, np.int32),
                         np.asarray(self.logprobs, np.float32), reason, steps=self.steps,
                         drafted=self.drafted, accepted=self.accepted, finish_time=finish_time)


def validate(req: Request, seen: set, vocab: int, max_len: int) -> str | None:
  """A reason this request cannot run (naming it), or None."""
  try:
    req.params.validate()
  except (ValueError, TypeError) as e:  # TypeError: a field of the wrong type
    return f"request {req.request_id}: invalid sampling params: {e}"
  n = len(req.prompt)
  if isinstance(req.request_id, bool) or not isinstance(req.request_id, numbers.Integral):
    # (1.2 and 1.7 would both become request 1 on the device: the same random keys)
    return f"request {req.request_id!r}: request_id must be an integer"
  if not -2**31 <= req.request_id < 2**31:  # the device holds it (and keys samples by it) as int32
    return f"request {req.request_id}: request_id outside int32 [-2**31, 2**31)"
  if req.request_id in seen:
    return f"request {req.request_id}: duplicate request_id"
  if n == 0:
    return f"request {req.request_id}: empty prompt"
  bad = [t for t in req.prompt if not 0 <= int(t) < vocab]
  if bad:
    return f"request {req.request_id}: prompt token {bad[0]} outside the vocabulary [0, {vocab})"
  if n + req.params.max_new_tokens > max_len:
    return (f"request {req.request_id}: prompt of {n} tokens + max_new_tokens="
            f"{req.params.max_new_tokens} exceeds the engine's max_len={max_len}")
  return None


def tree_depths(parents: np.ndarray) -> np.ndarray:
  """Depth below the root of each node of a (tokens, parents) draft (children of root: 1). A
  parent that is not an earlier node (a drafter's bug) counts as the root, where `accept.pack`
  puts that node, dead."""
  d = np.zeros(len(parents), np.int64)
  for i, par in enumerate(parents):
    d[i] = 1 if not 0 <= par < i else d[par] + 1
  return d
