"""The rollout engine's step timeline (`EngineStats.timeline`) read against warm-up times.

Each entry is one launch whose outputs the host read: (seconds since the rollout began, step
shape, yields, prefills and resumes dispatched since the launch before, host seconds, decode
steps). The benches that time real rollouts (bench/schedule_engine.py, bench/divided_host.py)
split the host's time by what came before each launch, the wall time beyond the modelled step
times, and put each response on the modelled clock, so that a policy's figures can be read
without this machine's noise.
"""

from __future__ import annotations

import numpy as np


def _kind(k: int, yields: int, prefilled: int, resumed: int) -> str:
  """What the engine dispatched before a step: "prefill" (new requests, yields or not; the
  first step too), "yields" (parks or resumes, no prefill) or "plain" (neither)."""
  return "prefill" if prefilled or k == 0 else "yields" if yields or resumed else "plain"


def host_by_event(timeline) -> dict[str, float]:
  """Mean host seconds from one step's dispatch to the next's, outside blocking reads (the
  engine loop's own work: reading a step, planning, dispatching), by what came before the
  step (`_kind`); NaN for a kind that never came."""
  spent: dict[str, list] = dict(plain=[], prefill=[], yields=[])
  for k, (_, _, yields, prefilled, resumed, host_s, *_) in enumerate(timeline):
    spent[_kind(k, yields, prefilled, resumed)].append(host_s)
  return {kind: float(np.mean(v)) if v else float("nan") for kind, v in spent.items()}


def excess_by_event(timeline, warm) -> dict[str, float]:
  """Wall time beyond the step shapes' warm-up times, summed over steps by what the engine
  dispatched before each (`EngineStats.timeline`): "prefill" (new requests admitted, yields or
  not; the first step too), "yields" (requests parked or resumed, no prefill), "plain"
  (neither). The interval of a step runs from the previous step's outputs on the host to its
  own; a multi-step launch (its entry's decode steps, EngineConfig.multi_step) is one interval
  against as many warm-up times."""
  out = dict(plain=0.0, prefill=0.0, yields=0.0)
  last = 0.0
  for k, (ready, shape, yields, prefilled, resumed, _, steps) in enumerate(timeline):
    out[_kind(k, yields, prefilled, resumed)] += ready - last - warm[shape] * steps
    last = ready
  return out


def modelled_finish(timeline, warm, cost, finish) -> np.ndarray:
  """Each request's finish (`finish`, wall seconds) on the modelled clock: the decode steps up
  to the step whose outputs it finished in, each at its shape's warm-up time, plus the yields'
  KV copies before them, the modelled decode time's terms (prefill left out as there). A
  request finishes while its step's outputs are read, after that step's `timeline` entry."""
  ready = np.array([entry[0] for entry in timeline])
  clock = np.cumsum([warm[shape] * steps + (cost.fixed + cost.per_row * yields if yields else 0.0)
                     for _, shape, yields, *_, steps in timeline])
  return clock[np.searchsorted(ready, finish, side="right") - 1]


HOST_PARTS = ("dispatch", "admit", "yields", "read", "other", "CPU")


def host_parts_ms(st) -> dict[str, float]:
  """Host ms per decode step by part (`EngineStats`): the decode steps' dispatch calls,
  admissions (prefill, resume copies, slot loading), yield checks and parks, reading step
  outputs, the rest (planning, packing, the loop), and the thread's CPU time: where wall time
  well above CPU time shows the host blocked rather than busy."""
  n = max(st.steps, 1)
  parts = dict(dispatch=st.dispatch_time_s, admit=st.prefill_time_s, yields=st.yield_time_s,
               read=st.read_time_s)
  parts["other"] = st.host_s_per_step * n - sum(parts.values())
  parts["CPU"] = st.cpu_time_s
  return {k: 1e3 * v / n for k, v in parts.items()}
