"""Exact, model-free replay of a drafter against recorded rollouts.

With position-keyed sampling a speculative rollout emits the plain rollout's tokens, whatever
was drafted. So a drafter's acceptance on a recorded rollout is fixed: on a verify step of a
request at response position `pos`, the accepted draft is the longest tree path matching the
recorded continuation `response[pos:]`, and the step emits that path plus one sampled token
(the bonus; none past the end of the response). `replay` drives any `DraftSource` through a
continuous-batching schedule like the engine's (`live_rows` slots, requests admitted in order
as slots free, all live requests drafted together, then every one observed), so siblings see
each other's tokens exactly as far as they would have been generated.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from rhyme_jax.history.recording import Recording
from rhyme_jax.rollout.drafts import DraftQuery, DraftSource, DraftTree


def accepted_path(tree: DraftTree, future: np.ndarray) -> int:
  """How many leading tokens of `future` the tree drafts along one root path."""
  tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
  valid = tree.valid.tolist()
  node, k = -1, 0
  while k < len(future):
    want = int(future[k])
    nxt = next((i for i in range(node + 1, len(tokens))
                if valid[i] and parents[i] == node and tokens[i] == want), None)
    if nxt is None:
      break
    node, k = nxt, k + 1
  return k


@dataclasses.dataclass
class ReplayStats:
  """Totals of one replay (peers' names: mean accepted length per verify, bonus included)."""

  steps: int = 0  # verify steps of requests (slot-verifies)
  tokens: int = 0
  drafted: int = 0
  accepted: int = 0
  no_draft_steps: int = 0
  propose_s: float = 0.0  # in drafter.propose (wall)
  propose_cpu_s: float = 0.0  # in drafter.propose (this thread's CPU time: less load noise)
  observe_s: float = 0.0  # in drafter.observe (wall)
  batches: int = 0  # engine steps (propose calls)

  @property
  def accepted_length(self) -> float:
    return self.tokens / max(self.steps, 1)

  def row(self) -> dict[str, float]:
    return dict(accepted_length=self.accepted_length,
                drafted_per_step=self.drafted / max(self.steps, 1),
                hit_rate=self.accepted / max(self.drafted, 1),
                no_draft_frac=self.no_draft_steps / max(self.steps, 1),
                us_per_query=1e6 * self.propose_s / max(self.steps, 1),
                cpu_us_per_query=1e6 * self.propose_cpu_s / max(self.steps, 1),
                observe_us=1e6 * self.observe_s / max(self.steps, 1),
                steps=self.steps, tokens=self.tokens, batches=self.batches)


def replay(drafter: DraftSource, target: Recording, *, budget: int = 16, live_rows: int = 64,
           request_offset: int = 0) -> ReplayStats:
  """Replays `target`'s responses through `drafter` (history must already be in its store)."""
  if budget < 0 or live_rows < 1:
    raise ValueError(f"replay: need budget >= 0 and live_rows >= 1, got {budget}, {live_rows}")
  stats = ReplayStats()
  order = list(range(len(target.responses)))
  group_left: dict[str, int] = {}
  for i in order:
    group_left[target.group_id(i)] = group_left.get(target.group_id(i), 0) + 1
  live: list[tuple[int, int]] = []  # (recording index, position)
  nxt = 0
  while live or nxt < len(order):
    while len(live) < live_rows and nxt < len(order):
      live.append((order[nxt], 0))
      nxt += 1
    queries = []
    for i, pos in live:
      pi = int(target.prompt_index[i])
      queries.append(DraftQuery(request_offset + int(target.request_ids[i]), target.group_id(i),
                                target.prompt_keys[pi], target.prompts[pi],
                                target.responses[i][:pos], budget))
    t0, c0 = time.perf_counter(), time.thread_time()
    trees = drafter.propose(queries)
    stats.propose_s += time.perf_counter() - t0
    stats.propose_cpu_s += time.thread_time() - c0
    stats.batches += 1
    still = []
    for (i, pos), q, tree in zip(live, queries, trees):
      resp = target.responses[i]
      future = resp[pos:]
      k = accepted_path(tree, future)
      emitted = min(k + 1, len(future))
      drafted = int(np.count_nonzero(tree.valid))
      stats.steps += 1
      stats.tokens += emitted
      stats.drafted += drafted
      stats.accepted += min(k, emitted)
      stats.no_draft_steps += drafted == 0
      t0 = time.perf_counter()
      drafter.observe(q.request_id, q.group_id, future[:emitted], drafted, min(k, emitted))
      stats.observe_s += time.perf_counter() - t0
      if pos + emitted >= len(resp):
        drafter.finish(q.request_id, q.group_id)
        group_left[q.group_id] -= 1
        if group_left[q.group_id] == 0 and hasattr(drafter, "end_group"):
          drafter.end_group(q.group_id)
      else:
        still.append((i, pos + emitted))
    live = still
  return stats


def replay_epochs(make_drafter: Callable[[], DraftSource], history: Sequence[Recording],
                  target: Recording, **kw) -> ReplayStats:
  """A fresh drafter, `history` recordings recorded into its store (by their epochs), then
  `target` replayed through it."""
  drafter = make_drafter()
  for rec in history:
    if getattr(drafter, "store", None) is None:
      break
    for key, responses in rec.groups().items():
      drafter.record_group(key, responses, epoch=rec.epoch)
  return replay(drafter, target, **kw)
