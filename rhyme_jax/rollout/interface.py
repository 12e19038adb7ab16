"""The engine's narrow interface: requests in, results out, its static config and its counters.

Kept apart from the engine and its loop (engine.py, loop.py) so the trainer, benches and
schedulers can build requests and configs, and read stats, without the loop's internals.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Hashable, Mapping, Protocol, Sequence

import numpy as np

from rhyme_jax.config import ATTENTIONS, MAX_MULTI_STEP
from rhyme_jax.rollout import accept
from rhyme_jax.rollout.sampling import SamplingParams


@dataclasses.dataclass
class Request:
  request_id: int
  prompt: Sequence[int]
  params: SamplingParams = SamplingParams()
  group_id: Hashable = None
  prompt_key: Hashable = None  # key into the history store; defaults to the prompt tokens


class AdmissionOrder(Protocol):
  """Which queued request takes the next free slot (`RolloutEngine.generate(..., admission=)`).

  `order(requests)` once, before the first admission: the opening queue (a permutation of
  `requests`). Then, each time a slot frees, `next_to_admit(queue, finished, live)` returns the
  position in `queue` to admit, given {request_id: response length} of the finished requests
  and of the live ones (admitted ones start at 0). Static orders return 0; online ones (Seer's
  probe-first) re-rank as siblings finish. Implementations live in `scheduling/`. An order
  changes when a request runs, never what it samples: sampling keys depend on (seed,
  request_id, position) alone.

  An order with `online = True` may also be asked about a running request (divided rollout,
  `EngineConfig.divide_every`): `next_to_admit` gets the queue with that request appended and
  `live` holding its tokens so far; picking it keeps it running, picking another makes it
  yield its slot and rejoin the queue (its KV parked). An online order may instead define
  `should_yield(queue, running, finished, live, chunk) -> bool` for that decision (e.g. by
  expected remaining work, as history_residual does), and `yield_rule(queue, finished, live,
  chunk, free=0)` returning that decision for the running requests of one pass (the queue
  unchanged), so its work over the queue is done once per pass; a yes hands that request's
  slot to the order's next pick, after the `free` ones the empty slots take (`yield_rule`
  below). Such an ask is hypothetical: an order whose `next_to_admit` records the pick as
  admitted (probe-first marks the group started) must define its own `yield_rule`, since the
  generic rules (over `should_yield` too) find the picks through `next_to_admit`, so each ask
  would admit. Orders without `online` are static.

  An online order whose rule reads nothing that changes while the queue, `finished` and the
  number of live requests stay as they are (a running request's count it reads from `live`
  when asked), or whose rule only grows more reluctant to yield as it ages, may set
  `stable_rule = True`: the engine then keeps one rule across passes until a request is
  queued, admitted or finishes (`divided.YieldRules`), instead of rebuilding it every pass.
  `live` is then the engine's own map, updated in place.
  """

  def order(self, requests: Sequence[Request]) -> Sequence[Request]: ...

  def next_to_admit(self, queue: Sequence[Request], finished: Mapping[int, int],
                    live: Mapping[int, int]) -> int: ...


def yield_rule(order, queue: Sequence, finished: Mapping[int, int], live: Mapping[int, int],
               chunk: int, free: int = 0):
  """Whether an online `order` (an `AdmissionOrder`, or scheduling's `AdmissionPolicy`, which
  speaks the same methods) gives a running request's slot to one of `queue` (divided rollout),
  as a function of the running request, for those asked in one pass while `queue`, `finished`
  and `live` stay as they are. The queued requests are handed out in the order's picks: the
  first `free` fill the empty slots, and each running request that yields takes the next, so
  the j-th to yield gives way to the (free + j)-th pick, never all of them to the one best
  (which took one slot and handed the others straight back, two KV row copies per round
  trip). The order's own `yield_rule` where it has one, else `should_yield` against the rest
  of the queue, else whether `next_to_admit`, offered the rest plus the running request, picks
  another. The engine (rollout/divided.py) and the simulator both decide through this."""
  if hasattr(order, "yield_rule"):
    return order.yield_rule(queue, finished, live, chunk, free=free)
  rest = list(queue)
  pick = lambda: order.next_to_admit(rest, finished, live)
  for _ in range(min(free, len(rest))):
    rest.pop(pick())

  def rule(running) -> bool:
    if not rest:
      return False
    if hasattr(order, "should_yield"):
      if not order.should_yield(rest, running, finished, live, chunk):
        return False
      k = pick()
    else:
      k = order.next_to_admit([*rest, running], finished, live)
      if k == len(rest):
        return False
    rest.pop(k)
    return True
  return rule


@dataclasses.dataclass
class RequestResult:
  request_id: int
  group_id: Hashable
  prompt: np.ndarray
  tokens: np.ndarray  # int32 response tokens (EOS / stop sequence included when hit)
  logprobs: np.ndarray  # float32, one per response token
  finish_reason: str  # "eos" | "stop" | "length" | "error"
  error: str | None = None
  steps: int = 0  # verify steps this request took part in
  drafted: int = 0  # draft tokens proposed for it
  accepted: int = 0  # draft tokens accepted
  finish_time: float = 0.0  # seconds since the start of the rollout


DRAFT_MODES = ("sync", "ahead", "ahead_only")
SPECULATE = ("auto", "always", "never")
BUCKET_MOVES = ("cost", "always")
DRAIN_STEPS = ("multi", "cost", "single")  # launches once nothing waits (EngineConfig)
# Cache lengths are rounded up to a power-of-two multiple in [16, 512], the Pallas kernels' KV
# block (it must divide S): the largest one <= S/16, so padding stays under max(16, S/16)
# positions while long caches get large blocks (S=4130 -> 4352 = 17 x 256).
KV_ALIGN_MIN, KV_ALIGN_MAX = 16, 512


def kv_align(s: int) -> int:
  """The multiple a cache length of about s positions is rounded up to."""
  return min(KV_ALIGN_MAX, max(KV_ALIGN_MIN, 1 << max(0, (s // 16).bit_length() - 1)))


def round_kv(s: int) -> int:
  """s rounded up to its alignment (kv_align): what the kernels' blocks divide."""
  a = kv_align(s)
  return -(-s // a) * a


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shapes and policies. `max_len` bounds prompt + response tokens per request.

  The engine alone sizes drafts: each bucket B compiles a plain step (P = B packed tokens, one
  per row) and one speculative step per `pack_factors` entry f (P = B + max((f-1)·B, 8·(f-1))
  positions, at most `max_draft` draft nodes per row, fewer at large B so attention's row block
  stays small), each for `kv_buckets` cache-length buckets.
  """

  max_len: int = 512
  buckets: tuple[int, ...] = (32, 16, 8, 4, 2, 1)
  max_draft: int = 16  # most draft nodes verified per row per step (<= 31); 0 = never speculate
  pack_factors: tuple[int, ...] = (2, 4)
  kv_buckets: int = 2  # cache-length buckets compiled: S, S/2, ... (attention reads one)
  # "auto": the cost model decides each step (plain where speculation cannot pay); "always":
  # every step uses the largest speculative shape, drafts or not (tests, benches: one shape);
  # "never": plain steps only.
  speculate: str = "auto"
  pipeline: bool = True  # dispatch a plain step before reading the previous one
  # With nothing queued, live rows that fit a smaller bucket move into it: "cost" where the
  # cost model says the move pays for itself (`CostModel.bucket_to_run`), "always" at once.
  bucket_moves: str = "cost"
  # Plain decode steps per launch: a stretch without drafts runs this many steps in one
  # compiled call (a scan of the plain step), so the host dispatches and reads once per
  # `multi_step` tokens per row. A row that ends at EOS inside a launch computes its remaining
  # steps for nothing (their tokens are dropped); token caps shorten launches instead
  # (loop.Rollout._launch_steps). 1: one step per launch.
  multi_step: int = 1
  # Launches once no request waits (none queued or parked): "multi" as before; "single" one
  # step each; "cost" one step where a host pass takes less than the step (tail.py). A launch
  # reports the ends inside it at its end (read one launch later, pipelined) and the rows stay
  # in their bucket until then; with nothing waiting, multi_step saves only host time.
  drain_steps: str = "multi"
  prefill_chunk: int = 64
  eos_ids: tuple[int, ...] = ()
  seed: int = 0
  # Where host drafting runs (drafters without `lookahead` always draft synchronously):
  # - "sync": before each step, on the critical path (the device waits);
  # - "ahead": the drafter's `lookahead` runs in a background thread on this step's contexts
  #   (budget: `lookahead_budget`) while the device verifies; next step each request gets the
  #   part of that tree continuing what it emitted (`DraftQuery.ahead`), and drafts
  #   synchronously only where the emitted tokens left the tree;
  # - "ahead_only": as "ahead", but never on the critical path.
  draft_mode: str = "sync"
  # Decode attention (config.ATTENTIONS): "xla", "pallas" (the backend's Pallas kernel; the XLA
  # path with one logged reason on CPU or an unsupported shape) or "pallas_interpret" (that
  # kernel interpreted, for CPU tests). A static part of every compiled step.
  attention: str = "xla"
  # Divided rollout (divided.py; used with an online admission order): a request is offered the
  # choice to yield its slot every `divide_every` tokens (0 = never), its KV kept in one of
  # `park_rows` device rows (a compile-time size: memory of (park_rows + 1) x cache_len
  # positions, the one more a sink for padded copies).
  divide_every: int = 0
  park_rows: int = 0
  # Warm-up compiles the buckets' shapes in this many threads (warmup.py; 0: one per bucket up
  # to the host's CPUs on a CPU backend, one on an accelerator; 1: one after another). Never
  # changes what compiles, only how long it takes.
  compile_threads: int = 0

  def __post_init__(self):
    if not self.buckets or any(b <= 0 for b in self.buckets):
      raise ValueError(f"buckets={self.buckets}: must be a non-empty list of positive sizes")
    if not 0 <= self.max_draft < accept.MAX_ROW_TOKENS:
      raise ValueError(f"max_draft={self.max_draft}: must be in [0, {accept.MAX_ROW_TOKENS})")
    if any(f < 2 for f in self.pack_factors):
      raise ValueError(f"pack_factors={self.pack_factors}: each must be >= 2")
    if self.kv_buckets < 1:
      raise ValueError(f"kv_buckets={self.kv_buckets}: must be >= 1")
    if self.speculate not in SPECULATE:
      raise ValueError(f"speculate={self.speculate!r}: expected one of {SPECULATE}")
    if self.bucket_moves not in BUCKET_MOVES:
      raise ValueError(f"bucket_moves={self.bucket_moves!r}: expected one of {BUCKET_MOVES}")
    if self.max_len < 2:
      raise ValueError(f"max_len={self.max_len}: must be >= 2")
    if self.prefill_chunk <= 0:
      raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be > 0")
    if self.drain_steps not in DRAIN_STEPS:
      raise ValueError(f"drain_steps={self.drain_steps!r}: expected one of {DRAIN_STEPS}")
    if self.draft_mode not in DRAFT_MODES:
      raise ValueError(f"draft_mode={self.draft_mode!r}: expected one of {DRAFT_MODES}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTIONS}")
    if not 1 <= self.multi_step <= MAX_MULTI_STEP:
      raise ValueError(f"multi_step={self.multi_step}: must be in [1, {MAX_MULTI_STEP}]")
    if self.compile_threads < 0:
      raise ValueError(f"compile_threads={self.compile_threads}: must be >= 0")
    if self.divide_every < 0 or self.park_rows < 0:
      raise ValueError(f"divide_every={self.divide_every}, park_rows={self.park_rows}: must be "
                       ">= 0")
    if self.divide_every and not self.park_rows:
      raise ValueError(f"divide_every={self.divide_every} needs park_rows >= 1: a yielded "
                       "request's KV waits in a park row")

  @property
  def row_tokens(self) -> int:
    return 1 + self.max_draft

  @property
  def cache_len(self) -> int:
    """Room for a request's tokens plus one launch's tokens (a step's tree, or a multi-step
    launch) and one pipelined launch past its end, rounded up (round_kv) so the Pallas kernels'
    KV blocks divide it. Positions past a row's length are never attended (the XLA path masks
    them, the kernels never read them)."""
    return round_kv(self.max_len + 2 * max(self.row_tokens, self.multi_step))

  @property
  def lookahead_budget(self) -> int:
    """Nodes drafted ahead: this step's draft, its bonus token and the next draft."""
    return 2 * self.max_draft + 1

  def kv_lengths(self) -> tuple[int, ...]:
    """Cache-length buckets the XLA path slices attention to: S, S/2, ... each rounded up."""
    s = self.cache_len
    return tuple(sorted({min(s, round_kv(s >> i)) for i in range(self.kv_buckets)} - {0}))

  def spec_shapes(self, bucket: int) -> tuple[tuple[int, int], ...]:
    """(P, T) of the speculative steps of a bucket: packed size, tokens per row."""
    if self.max_draft == 0 or self.speculate == "never":
      return ()
    out = []
    for f in sorted(self.pack_factors):
      p = bucket + max((f - 1) * bucket, 8 * (f - 1))
      t = min(self.row_tokens, p - bucket + 1, max(4, 256 // bucket))
      if (p, t) not in out:
        out.append((p, t))
    return tuple(out)


@dataclasses.dataclass
class EngineStats:
  """Counters of one `generate` call (peers' names: mean accepted length, slot utilisation)."""

  steps: int = 0  # verify steps (target forward passes of the decode phase)
  launches: int = 0  # compiled calls that ran them (fewer with EngineConfig.multi_step > 1)
  spec_steps: int = 0  # of which speculative
  asked_steps: int = 0  # steps that asked for drafts (speculative, or plain after drafting)
  prefill_chunks: int = 0
  prefill_shared: int = 0  # requests given a copy of a sibling's prompt KV instead of prefill
  prefill_time_s: float = 0.0  # admitting requests: prompt prefill and slot loading
  tokens: int = 0  # response tokens emitted
  useful_slot_steps: int = 0
  slot_steps: int = 0
  drafted: int = 0  # draft nodes verified
  accepted: int = 0
  positions: int = 0  # packed positions computed (sum of P over steps)
  live_positions: int = 0  # live rows + drafted nodes (sum over steps)
  host_waits: int = 0  # reads of step outputs with no later step queued (the device idles)
  bucket_moves: int = 0  # moves of the live rows into a smaller bucket (one level each)
  moves_held: int = 0  # passes whose rows fit a smaller bucket the cost model kept them out of
  draft_time_s: float = 0.0  # host drafting on the critical path (device idle meanwhile)
  device_time_s: float = 0.0  # blocking waits for step outputs
  # The host's time outside those waits, by part (the rest is planning and packing): the
  # decode steps' dispatch calls, reading steps' outputs (bookkeeping per row), and divided
  # rollout's yield checks and parks; `prefill_time_s` holds admissions
  dispatch_time_s: float = 0.0
  read_time_s: float = 0.0
  yield_time_s: float = 0.0
  cpu_time_s: float = 0.0  # the calling thread's CPU time (time.thread_time) over the call
  lookahead_time_s: float = 0.0  # background drafting, overlapped with device_time_s
  lookahead_wait_s: float = 0.0  # waiting for background drafting after the device finished
  ahead_hits: int = 0  # queries given the continuation of a tree drafted ahead
  ahead_misses: int = 0  # queries whose emitted tokens left their tree drafted ahead
  yields: int = 0  # slots given up by running requests (divided rollout)
  yield_passes: int = 0  # engine passes that parked at least one (one copy call each)
  parked_peak: int = 0  # most yielded requests waiting at once (their KV in park rows)
  yield_rules: int = 0  # yield rules the admission order built (divided.YieldRules)
  total_time_s: float = 0.0
  # decode steps per (bucket, P, T, cache length); a multi-step launch counts each of its steps
  steps_by_shape: dict = dataclasses.field(default_factory=collections.Counter)
  # per launch: (bucket, packed P, live, queued)
  trace: list = dataclasses.field(default_factory=list)
  # per launch, in order: (seconds from the call's start to its outputs on the host, its step
  # shape, the yields, requests prefilled and requests resumed dispatched since the launch
  # before was, the host seconds in between outside blocking reads: reading the launch before,
  # planning, dispatching, and the decode steps it ran), to attribute wall time to what the
  # engine did between launches
  timeline: list = dataclasses.field(default_factory=list)
  admitted: list = dataclasses.field(default_factory=list)  # request ids in admission order

  @property
  def mean_accepted_length(self) -> float:
    """Tokens emitted per slot-verify (bonus included): 1.0 means no speculation gain."""
    return self.tokens / max(self.useful_slot_steps, 1)

  @property
  def forwards_per_token(self) -> float:
    return self.steps / max(self.tokens, 1)

  @property
  def host_s_per_step(self) -> float:
    """Seconds per decode step outside blocking reads of step outputs: the engine loop's own
    work; where it nears a step's device time, the host sets the pace."""
    return (self.total_time_s - self.device_time_s) / max(self.steps, 1)

  @property
  def slot_utilisation(self) -> float:
    return self.useful_slot_steps / max(self.slot_steps, 1)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.total_time_s, 1e-9)

  def summary(self) -> dict:
    return dict(steps=self.steps, spec_steps=self.spec_steps, tokens=self.tokens,
                tokens_per_s=self.tokens_per_s, mean_accepted_length=self.mean_accepted_length,
                forwards_per_token=self.forwards_per_token, launches=self.launches,
                slot_utilisation=self.slot_utilisation, drafted=self.drafted,
                accepted=self.accepted, positions=self.positions,
                live_positions=self.live_positions, host_waits=self.host_waits,
                bucket_moves=self.bucket_moves, moves_held=self.moves_held,
                draft_time_s=self.draft_time_s, device_time_s=self.device_time_s,
                dispatch_time_s=self.dispatch_time_s, read_time_s=self.read_time_s,
                yield_time_s=self.yield_time_s, cpu_time_s=self.cpu_time_s,
                lookahead_time_s=self.lookahead_time_s,
                lookahead_wait_s=self.lookahead_wait_s, ahead_hits=self.ahead_hits,
                ahead_misses=self.ahead_misses, yields=self.yields, yield_passes=self.yield_passes,
                parked_peak=self.parked_peak, total_time_s=self.total_time_s)
