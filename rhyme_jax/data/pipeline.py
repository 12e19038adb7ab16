"""Seeded, resumable, multi-host prompt batches for RL, built on grain.

The examples form one flat stream: epoch e is a seeded permutation of the whole dataset
(a different one each epoch), epochs follow each other, and step k takes the global batch of
stream positions [k * GB, (k + 1) * GB) with GB = batch_size * process_count. Process p keeps
positions [k * GB + p * batch_size, ... + batch_size). So:

  * within an epoch every example appears exactly once over all processes; a global batch may
    straddle two epochs (each item carries its own epoch number);
  * all processes advance in lockstep and see disjoint shares of the same global batch;
  * the iterator state is just the next step number ({'next_index': k}, grain's own state),
    so a restored run continues exactly where it stopped, epoch boundaries included.

With num_epochs set, the stream ends after the last complete global batch (at most GB - 1
examples of the last epoch are dropped, keeping batch shapes fixed); by default it is endless.

grain permutes epoch e with seed s + e, so s is the run's seed hashed (`shuffle_seed`): with
s = seed, seed 1's epoch 0 would be seed 0's epoch 1, and runs at neighbouring seeds (the usual
way to repeat an RL experiment) would see the same prompt orders one epoch apart.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterator, Sequence

import grain
import numpy as np

from rhyme_jax.data.datasets import Example
from rhyme_jax.data.prompts import PromptTemplate, RenderFn, render_prompt


# The rule that draws the prompt order, saved with every checkpoint: 1 = grain shuffled with
# the run's seed itself (before 2026-12-02), 2 = with `shuffle_seed`'s hash of it.
ORDER_VERSION = 2


def check_order_version(saved: int, where: str) -> None:
  """Refuses to resume a prompt stream whose order another rule drew: the same position
  would hold other prompts, and the resumed epoch would skip some and repeat others."""
  if saved != ORDER_VERSION:
    raise ValueError(f"{where}: its prompt order was drawn by data order rule {saved}, this "
                     f"checkout draws it by rule {ORDER_VERSION} (rhyme_jax.data.pipeline); "
                     "resuming would skip and repeat prompts: resume with the checkout that "
                     "wrote it or use a new --run_dir")


def shuffle_seed(seed: int) -> int:
  """The 32-bit seed grain shuffles the stream with, hashed from the run's `seed` (>= 0):
  grain's epoch e uses (this + e) mod 2**32, so two runs' epoch orders coincide only where
  their hashed seeds lie within an epoch count of each other (about 2 x epochs / 2**32)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"PromptPipeline: seed must be an integer >= 0, got {seed!r}")
  return int(np.random.SeedSequence([int(seed), 0x70726F6D]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """This process's share of one global batch of prompts."""

  step: int  # Global batch index, counted from 0 across epochs.
  examples: tuple[Example, ...]
  epochs: tuple[int, ...]  # Epoch of each example.
  positions: tuple[int, ...]  # Position of each example in the global stream.
  prompts: tuple[str, ...] | None = None  # Rendered prompts when the pipeline has a render_fn.

  @property
  def uids(self) -> tuple[str, ...]:
    return tuple(e.uid for e in self.examples)


class PromptPipeline:
  """Iterable of PromptBatch; `iter()` returns a grain iterator with get_state / set_state."""

  def __init__(self, examples: Sequence[Example], *, batch_size: int, seed: int,
               num_epochs: int | None = None, process_index: int | None = None,
               process_count: int | None = None, render_fn: RenderFn | None = None,
               template: PromptTemplate | None = None, prefetch: int = 2):
    if not examples:
      raise ValueError("PromptPipeline: examples is empty")
    if batch_size <= 0:
      raise ValueError(f"PromptPipeline: batch_size must be > 0, got {batch_size}")
    if num_epochs is not None and num_epochs <= 0:
      raise ValueError(f"PromptPipeline: num_epochs must be > 0 or None, got {num_epochs}")
    if (render_fn is None) != (template is None):
      raise ValueError("PromptPipeline: render_fn and template go together (both or neither)")
    if process_index is None or process_count is None:
      import jax  # pylint: disable=import-outside-toplevel
      process_index = jax.process_index() if process_index is None else process_index
      process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
      raise ValueError(f"PromptPipeline: need 0 <= process_index < process_count, got "
                       f"{process_index}, {process_count}")
    self.examples = tuple(examples)
    self.batch_size = batch_size
    self.global_batch_size = batch_size * process_count
    self.seed = seed
    self.num_epochs = num_epochs
    self.process_index = process_index
    self.process_count = process_count
    self.render_fn = render_fn
    self.template = template
    self.prefetch = prefetch

    stream = (grain.MapDataset.source(self.examples).shuffle(seed=shuffle_seed(seed))
              .repeat(num_epochs))
    self._stream = stream
    steps = len(stream) // self.global_batch_size if num_epochs else sys.maxsize
    self.num_steps = steps if num_epochs else None
    self.dataset = grain.MapDataset.range(steps).map(self._make_batch)

  def _make_batch(self, step: int) -> PromptBatch:
    start = step * self.global_batch_size + self.process_index * self.batch_size
    positions = tuple(range(start, start + self.batch_size))
    examples = tuple(self._stream[i] for i in positions)
    prompts = None
    if self.render_fn is not None:
      prompts = tuple(render_prompt(e, self.render_fn, self.template) for e in examples)
    n = len(self.examples)
    return PromptBatch(step=step, examples=examples, epochs=tuple(i // n for i in positions),
                       positions=positions, prompts=prompts)

  def __iter__(self) -> Iterator[PromptBatch]:
    options = grain.ReadOptions(num_threads=1 if self.prefetch else 0,
                                prefetch_buffer_size=self.prefetch)
    return iter(self.dataset.to_iter_dataset(options))

  def batch_at(self, step: int) -> PromptBatch:
    """Random access to any step (same result as iterating up to it)."""
    return self.dataset[step]
