"""Length traces for bench/schedsim.py: where the simulated rollouts' requests and histories
come from (synthetic, JSONL, recorded `.npz` rollouts, a GRPO run's directory).

A `Trace` holds per-prompt response lengths by epoch; its last epoch is the simulated step and
the epochs before it the history (`trace_cases` turns it into one `StepCase`). A GRPO run's
directory gives one `StepCase` per training step instead (bench/schedsim_grpo.py).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os

import numpy as np

from bench import schedsim_grpo
from bench.schedsim_grpo import StepCase
from rhyme_jax.scheduling.admission import RequestMeta
from rhyme_jax.scheduling.predictor import LengthPredictor, LengthTable


@dataclasses.dataclass
class Trace:
  """Per-prompt response lengths by epoch, prompts in data order."""

  name: str
  keys: list
  prompt_len: list[int]
  lengths: list[dict[int, np.ndarray]]  # per prompt: {epoch: int64[G]}

  @property
  def epochs(self) -> list[int]:
    return sorted({e for per in self.lengths for e in per})

  def rank_correlation(self, a: int, b: int) -> float:
    """Spearman correlation of per-prompt mean length between epochs a and b."""
    both = [(p[a].mean(), p[b].mean()) for p in self.lengths if a in p and b in p]
    x, y = np.array(both).T
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def synthetic_trace(seed: int = 0, num_prompts: int = 32, group_size: int = 8, epochs: int = 2,
                    max_new_tokens: int = 512) -> Trace:
  """Lengths = difficulty (log-normal per prompt, drifting a little per epoch) x per-sample
  noise, capped at max_new_tokens; tuned to a between-epoch Spearman of about 0.8."""
  rng = np.random.default_rng(seed)
  difficulty = rng.lognormal(np.log(150), 0.55, num_prompts)
  lengths = [dict() for _ in range(num_prompts)]
  for e in range(epochs):
    drift = difficulty * rng.lognormal(0.0, 0.1, num_prompts)
    sample = drift[:, None] * rng.lognormal(0.0, 0.45, (num_prompts, group_size))
    for i in range(num_prompts):
      lengths[i][e] = np.clip(np.rint(sample[i]), 8, max_new_tokens).astype(np.int64)
  return Trace(f"synthetic:{seed}", [f"synthetic-{i}" for i in range(num_prompts)],
               [int(n) for n in rng.integers(90, 200, num_prompts)], lengths)


def load_trace(path: str) -> Trace:
  """A JSONL trace: per-group lines {prompt_key, epoch, lengths} or per-sample lines with
  {prompt_key, epoch, length} (or a "tokens"/"response" list whose length is taken)."""
  per: dict = collections.OrderedDict()
  prompt_len: dict = {}
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        key, epoch = row["prompt_key"], int(row["epoch"])
        if "lengths" in row:
          lens = [int(n) for n in row["lengths"]]
        elif "length" in row:
          lens = [int(row["length"])]
        else:
          lens = [len(row.get("tokens", row.get("response")))]
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{lineno}: not a length-trace line ({e!r})") from e
      if isinstance(key, list):
        key = tuple(key)
      per.setdefault(key, collections.defaultdict(list))[epoch].extend(lens)
      if "prompt_len" in row:
        prompt_len[key] = int(row["prompt_len"])
      elif "prompt" in row and isinstance(row["prompt"], list):
        prompt_len[key] = len(row["prompt"])
  if not per:
    raise ValueError(f"{path}: no trace lines")
  keys = list(per)
  return Trace(os.path.basename(path), keys, [prompt_len.get(k, 128) for k in keys],
               [{e: np.asarray(v, np.int64) for e, v in per[k].items()} for k in keys])


def trace_name(pattern: str) -> str:
  """A pattern's file name, under its folder's name where the file name is a wildcard alone
  (`gsm8k_T0.6_epochs0-3/*.npz`, which would otherwise read `*.npz`)."""
  base = os.path.basename(pattern)
  if base.lstrip("*?").startswith(".") or not base.strip("*?"):
    return os.path.join(os.path.basename(os.path.dirname(os.path.normpath(pattern))), base)
  return base


def load_npz_trace(pattern: str) -> Trace:
  """Recorded rollouts (`.npz`, see the module docstring) matching `pattern`, as one trace."""
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise ValueError(f"--trace {pattern}: no files match")
  per: dict = collections.OrderedDict()
  prompt_len: dict = {}
  for path in paths:
    try:
      with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta_json"]))
        keys = [str(k) for k in z["prompt_keys"]]
        plens = z["prompt_lengths"].astype(np.int64)
        for i, n in zip(z["prompt_index"].astype(np.int64), z["lengths"].astype(np.int64)):
          per.setdefault(keys[i], collections.defaultdict(list))[int(meta["epoch"])].append(
              int(n))
          prompt_len[keys[i]] = int(plens[i])
    except (KeyError, ValueError, OSError) as e:
      raise ValueError(f"{path}: not a recorded rollout ({e!r})") from e
  keys = list(per)
  name = trace_name(pattern) + f" ({len(paths)} files)"
  return Trace(name, keys, [prompt_len[k] for k in keys],
               [{e: np.asarray(v, np.int64) for e, v in per[k].items()} for k in keys])


def split_groups(trace: Trace) -> Trace:
  """A one-epoch trace as two: each prompt's first half of samples becomes the history
  (epoch 0), the second half the step (epoch 1); both halves come from the same policy, as
  consecutive epochs do when no training step runs between them."""
  (epoch,) = trace.epochs
  halves = []
  for per in trace.lengths:
    n = len(per[epoch]) // 2
    halves.append({0: per[epoch][:n], 1: per[epoch][n:]})
  return Trace(trace.name + " split in halves", trace.keys, trace.prompt_len, halves)


def write_trace(trace: Trace, path: str) -> None:
  with open(path, "w") as f:
    for key, plen, per in zip(trace.keys, trace.prompt_len, trace.lengths):
      for e in sorted(per):
        f.write(json.dumps({"prompt_key": key, "epoch": e, "lengths": per[e].tolist(),
                            "prompt_len": plen}) + "\n")


def step_jobs(trace: Trace, epoch: int, max_new_tokens: int):
  """The step's requests (prompts in data order, G samples each) with their true lengths."""
  jobs = []
  for i, (key, plen, per) in enumerate(zip(trace.keys, trace.prompt_len, trace.lengths)):
    for n in per.get(epoch, ()):
      rid = len(jobs)
      jobs.append((RequestMeta(rid, i, key, rid, max_new_tokens, plen), max(int(n), 1)))
  return jobs


def history_predictor(trace: Trace, epoch: int, epochs_kept: int, stat: str) -> LengthPredictor:
  table = LengthTable(epochs_kept)
  for key, per in zip(trace.keys, trace.lengths):
    for e in sorted(per):
      if e < epoch:
        table.add(key, e, per[e])
  return LengthPredictor(table, stat)


def trace_cases(spec: str, args, notes: list) -> tuple[str, list[StepCase]]:
  """(trace name, simulated rollouts): a GRPO run's steps, or a trace's last epoch."""
  if schedsim_grpo.is_grpo_dir(spec):
    directory = spec[len("grpo:"):] if spec.startswith("grpo:") else spec
    cases = schedsim_grpo.grpo_cases(directory, args.epochs_kept, args.stat)
    if not cases:
      raise ValueError(f"--trace {spec}: no step after the first data epoch")
    name = "grpo:" + os.path.basename(os.path.normpath(directory))
    lengths = np.concatenate([c.lengths for c in cases])
    cap = cases[0].jobs[0][0].max_new_tokens
    sizes = sorted({len(c.jobs) for c in cases})
    notes.append(f"trace {name}: GRPO run {directory}, {len(cases)} steps of data epochs "
                 f"{sorted({c.epoch for c in cases})} simulated one rollout each ({sizes} "
                 f"requests per step, {cap}-token cap), summed over steps; history = every "
                 f"earlier step's lengths as the trainer's store held them ({args.epochs_kept} "
                 f"epoch(s) kept per prompt), so a step's prompts are predicted from their "
                 f"earlier data epochs; length mean {lengths.mean():.0f} / max {lengths.max()}, "
                 f"{100 * (lengths >= cap).mean():.0f}% at the cap; Spearman of predicted vs true "
                 f"prompt mean length over all steps: "
                 f"{schedsim_grpo.rank_correlation(cases):.2f}")
    return name, cases
  if spec.startswith("synthetic"):
    seed = int(spec.split(":")[1]) if ":" in spec else 0
    trace = synthetic_trace(seed, max_new_tokens=args.max_new_tokens)
  elif spec.endswith(".npz"):
    trace = load_npz_trace(spec)
  else:
    trace = load_trace(spec)
  if len(trace.epochs) == 1 and args.split_groups:
    trace = split_groups(trace)
  epochs = trace.epochs
  if len(epochs) < 2:
    raise ValueError(f"--trace {trace.name}: needs >= 2 epochs (history, then the step), "
                     f"or --split_groups")
  target = epochs[-1]
  jobs = step_jobs(trace, target, args.max_new_tokens)
  lengths = np.array([n for _, n in jobs])
  notes.append(f"trace {trace.name}: {len(trace.keys)} prompts, {len(jobs)} requests in "
               f"epoch {target} (predicted from epochs {epochs[:-1]}), length mean "
               f"{lengths.mean():.0f} / max {lengths.max()}, Spearman of prompt mean length "
               f"between epochs {epochs[-2]} and {target}: "
               f"{trace.rank_correlation(epochs[-2], target):.2f}")
  predictor = history_predictor(trace, target, args.epochs_kept, args.stat)
  return trace.name, [StepCase(trace.name, 1, target, jobs, predictor, predictor.source)]
