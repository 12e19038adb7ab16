"""HistoSpec over consecutive epochs: drafts from the previous epoch and from live siblings.

SmolLM2-135M-Instruct (real GGUF weights) answers the same GSM8K train prompts (chat template,
`gsm8k` prompt template) for `--epochs` epochs, G = `--group_size` samples each. Between epochs
the policy changes as in RL training (`--policy_change=grpo`, the default): `--grpo_steps`
GRPO updates of the real learner (`rl.learner.Learner.train_on`, gsm8k reward) on the epoch's
own samples; or (`--policy_change=noise`) every weight tensor gets Gaussian noise of `--noise`
times its RMS. Per temperature and epoch, the same requests run through:

- plain: a budget-0 engine (one-token decode steps, no drafter): the speed baseline;
- history / siblings / both: an engine verifying a `--budget`-token draft tree per slot every
  step, drafts from `HistoryDrafter` with the past-epoch index, the live-sibling index, or both;
- the same with `+ahead` / `+ahead_only` (`--draft_modes`, `EngineConfig.draft_mode`): trees
  drafted in a background thread while the device verifies the previous step; where the emitted
  tokens left them, a synchronous draft (`ahead`) or none (`ahead_only`).

After each epoch the plain run's responses are recorded as the prompt's history (the next epoch
drafts from them). Epoch 0 has no history, so only plain and siblings run there.

Reported per (temperature, epoch, drafter): mean accepted length per verify (tokens per
slot-verify, bonus included), draft hit rate (accepted / drafted tokens), target forward
passes per token (decode steps / tokens), host drafting time per step on the critical path
(and in the background with `+ahead*`; ahead hit = drafts taken from there), requests whose tokens
equal the plain run's (speculative verify and one-token decode round differently in the last
bits, so a near-tie can flip a token), decode tokens/s (tokens / (drafting + device step time),
prefill excluded) and the whole rollout's tokens/s, each with its ratio to plain. Step
functions are compiled by `engine.warmup()` before anything is timed.

  python bench/histospec.py                                # CPU defaults: 2 prompts x G=4
  python bench/histospec.py --num_prompts 8 --group_size 8 --max_new_tokens 192 \\
      --buckets 64,32,16,8,4,2,1 --budget 16 --dtype bfloat16     # H100: ~9 min (RESULTS.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from rhyme_jax.data.datasets import load_gsm8k  # noqa: E402
from rhyme_jax.data.prompts import get_prompt_template, render_prompt  # noqa: E402
from rhyme_jax.history.drafter import HistoryDrafter  # noqa: E402
from rhyme_jax.history.store import HistoryStore, prompt_key  # noqa: E402
from rhyme_jax.models.loading import load_model  # noqa: E402
from rhyme_jax.models.tokenizer import load_tokenizer  # noqa: E402
from rhyme_jax.config import parse_flags  # noqa: E402
from rhyme_jax.rl.learner import Learner  # noqa: E402
from rhyme_jax.rl.rewards import get_reward_fn  # noqa: E402
from rhyme_jax.rl.rewards.scoring import Scorer  # noqa: E402
from rhyme_jax.rl.samples import Sample, prompt_of  # noqa: E402
from rhyme_jax import parallel  # noqa: E402
from rhyme_jax.rollout.engine import (  # noqa: E402
    DRAFT_MODES, TRACE_COUNTS, EngineConfig, Request, RolloutEngine)
from rhyme_jax.rollout.sampling import SamplingParams  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
MODES = ("history", "siblings", "both")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=MODEL_NAME, help="model name or path (GGUF / HF directory)")
  p.add_argument("--num_prompts", type=int, default=2, help="GSM8K train prompts")
  p.add_argument("--prompt_offset", type=int, default=0, help="index of the first prompt")
  p.add_argument("--group_size", type=int, default=4, help="samples per prompt (G)")
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--temperatures", default="1.0,0.6", help="comma-separated temperatures")
  p.add_argument("--policy_change", default="grpo", choices=("grpo", "noise"),
                 help="between epochs: GRPO updates on the epoch's samples, or weight noise")
  p.add_argument("--grpo_steps", type=int, default=1, help="GRPO updates between epochs")
  p.add_argument("--learning_rate", type=float, default=3e-5, help="GRPO learning rate")
  p.add_argument("--reward", default="gsm8k+0.5*format",
                 help="GRPO reward (a registered name or weighted sum); the format bonus gives "
                      "a 135M model a signal where exact answers are rare; a soft overlong "
                      "penalty over the last quarter of --max_new_tokens is added (all-equal "
                      "rewards give zero advantages: no policy change)")
  p.add_argument("--noise", type=float, default=1e-3,
                 help="--policy_change=noise: Gaussian noise, this times each tensor's RMS")
  p.add_argument("--modes", default=",".join(MODES), help=f"drafters to run, from {MODES}")
  p.add_argument("--draft_modes", default=",".join(DRAFT_MODES),
                 help=f"where drafting runs, each drafter once per mode, from {DRAFT_MODES}")
  p.add_argument("--budget", type=int, default=8,
                 help="verify budget: draft tokens per slot per step (static shape)")
  p.add_argument("--min_prob", type=float, default=0.1, help="drafter's minimum path probability")
  p.add_argument("--buckets", default="8,2", help="engine batch buckets (compiled shapes)")
  p.add_argument("--prefill_chunk", type=int, default=64)
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="params and activations; default float32 on cpu, else bfloat16")
  p.add_argument("--seed", type=int, default=0, help="sampling seed and weight-noise seed")
  p.add_argument("--reuse_seed", action="store_true",
                 help="sample every epoch with the same random draws (common random numbers: "
                      "each epoch is still an exact sample of its policy, but epochs are "
                      "correlated); default: a fresh seed per epoch")
  common.add_results_args(p)
  args = p.parse_args(argv)
  try:
    args.temperatures = tuple(float(t) for t in args.temperatures.split(","))
  except ValueError:
    p.error(f"--temperatures={args.temperatures!r}: expected comma-separated numbers")
  if any(not 0.0 <= t < float("inf") for t in args.temperatures):
    p.error(f"--temperatures={args.temperatures}: each must be a finite number >= 0")
  args.modes = tuple(m for m in args.modes.split(",") if m)
  bad = [m for m in args.modes if m not in MODES]
  if bad or not args.modes:
    p.error(f"--modes: unknown {bad or 'empty list'}; choose from {MODES}")
  args.draft_modes = tuple(m for m in args.draft_modes.split(",") if m)
  bad = [m for m in args.draft_modes if m not in DRAFT_MODES]
  if bad or not args.draft_modes:
    p.error(f"--draft_modes: unknown {bad or 'empty list'}; choose from {DRAFT_MODES}")
  args.buckets = common.int_list(p, "buckets", args.buckets)
  for flag in ("num_prompts", "group_size", "max_new_tokens", "epochs", "budget",
               "prefill_chunk", "grpo_steps"):
    if getattr(args, flag) <= 0:
      p.error(f"--{flag}={getattr(args, flag)}: must be > 0")
  if args.noise < 0:
    p.error(f"--noise={args.noise}: must be >= 0")
  return args


def gsm8k_prompts(tok, num, offset):
  """`num` GSM8K train examples and their prompts' token ids (model's chat template)."""
  examples = load_gsm8k("train")
  if offset + num > len(examples):
    raise SystemExit(f"--prompt_offset={offset} + --num_prompts={num} exceeds the "
                     f"{len(examples)} GSM8K train examples")
  template = get_prompt_template("gsm8k")
  render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
  chosen = examples[offset:offset + num]
  return chosen, [tok.encode(render_prompt(e, render, template)) for e in chosen]


def make_learner(args, dtype, temperature, tok):
  """The trainer's own learner and scorer (gsm8k reward, soft overlong penalty) for GRPO updates."""
  config = parse_flags([
      f"--model={args.model}", "--task=gsm8k", f"--reward={args.reward}",
      f"--param_dtype={dtype}",
      f"--group_size={args.group_size}", f"--prompts_per_step={args.num_prompts}",
      f"--learning_rate={args.learning_rate}", f"--temperature={temperature}",
      f"--max_new_tokens={args.max_new_tokens}", "--max_prompt_len=512", "--spec=none",
      f"--overlong_buffer={max(1, args.max_new_tokens // 4)}",
      "--eval_every=0", f"--seed={args.seed}", "--run_dir=unused"])  # the learner writes nothing
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  model, model_config = load_model(args.model, param_dtype=dtype, mesh=mesh)
  scorer = Scorer(tok, get_reward_fn(config.reward_name), config.rollout.max_new_tokens,
                  config.rl.overlong_buffer)
  return Learner(config, model, mesh, model_config), scorer


def grpo_update(learner, scorer, examples, prompt_ids, reqs, results, epoch, steps):
  """`steps` GRPO updates on one epoch's samples; returns the updated model and metrics."""
  g = len(reqs) // len(prompt_ids)
  groups = []
  for i, (ex, ids) in enumerate(zip(examples, prompt_ids)):
    prompt = prompt_of(ex, ids, epoch)
    group = [Sample(prompt, r.tokens, r.logprobs, r.finish_reason)
             for r in results[i * g:(i + 1) * g]]
    scorer.score_group(group)
    groups.append(group)
  before = jax.tree.map(jnp.copy, learner.params)  # the update donates the params
  for _ in range(steps):
    learner.train_on(groups)
  sq = lambda tree: sum(float(jnp.sum(jnp.square(x.astype(jnp.float32))))
                        for x in jax.tree.leaves(tree))
  moved = np.sqrt(sq(jax.tree.map(lambda a, b: a - b, learner.params, before)) / sq(before))
  rewards = np.array([s.reward for grp in groups for s in grp])
  return learner.model(), dict(
      reward=float(rewards.mean()), reward_std=float(rewards.std()), moved=float(moved))


def perturb(model, noise: float, key):
  """A copy of `model` with every float parameter moved by noise * RMS(tensor) * N(0, 1)."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(key, len(leaves))

  @jax.jit
  def move(x, k):
    rms = jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
    return (x + (noise * rms * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype))

  moved = [move(x, k) if jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, moved))


def make_requests(prompt_ids, group_size, params, epoch):
  reqs = []
  for i, p in enumerate(prompt_ids):
    for _ in range(group_size):
      reqs.append(Request(len(reqs), p, params, group_id=f"e{epoch}/p{i}",
                          prompt_key=prompt_key(p)))
  return reqs


def make_drafter(mode, store, args):
  return HistoryDrafter(store if mode != "siblings" else None,
                        use_history=mode in ("history", "both"),
                        use_siblings=mode in ("siblings", "both"),
                        max_budget=args.budget,
                        min_prob=args.min_prob)


def summed_ratios(rows: list[dict], field: str = "total_s") -> dict[str, float]:
  """Per drafting mode: its `field` seconds summed over (T, epoch) / plain's over the same."""
  plain = {(r["temp"], r["epoch"]): r[field] for r in rows if r["mode"] == "plain"}
  out: dict[str, list[float]] = {}
  for r in rows:
    if r["mode"] != "plain":
      acc = out.setdefault(r["mode"], [0.0, 0.0])
      acc[0] += r[field]
      acc[1] += plain[(r["temp"], r["epoch"])]
  return {m: a / b for m, (a, b) in out.items()}


def bracket_times(first: dict, second: dict) -> dict:
  """Plain's timing fields as the mean of two runs of the same requests (seconds averaged)."""
  tokens = first["tokens"]
  decode_s = (tokens / first["decode_tps"] + tokens / second["decode_tps"]) / 2
  total_s = (first["total_s"] + second["total_s"]) / 2
  return dict(decode_tps=tokens / decode_s, total_tps=first["total_tps"] * first["total_s"] / total_s,
              device_ms=(first["device_ms"] + second["device_ms"]) / 2, total_s=total_s)


def run(engine, reqs):
  results = engine.generate(reqs)
  errors = [r.error for r in results if r.finish_reason == "error"]
  if errors:
    raise SystemExit(f"rollout failed: {errors[0]}")
  s = engine.stats
  decode_s = s.draft_time_s + s.device_time_s + s.lookahead_wait_s
  offered = s.ahead_hits + s.ahead_misses
  return results, dict(
      tokens=s.tokens, steps=s.steps, mal=s.mean_accepted_length, fpt=s.forwards_per_token,
      hit=s.accepted / s.drafted if s.drafted else float("nan"), drafted=s.drafted,
      draft_ms=1e3 * s.draft_time_s / max(s.steps, 1),
      ahead_ms=1e3 * s.lookahead_time_s / max(s.steps, 1),
      ahead_hit=s.ahead_hits / offered if offered else float("nan"),
      device_ms=1e3 * s.device_time_s / max(s.steps, 1),
      decode_tps=s.tokens / max(decode_s, 1e-9), total_tps=s.tokens_per_s,
      total_s=s.total_time_s, spec_steps=s.spec_steps, asked_steps=s.asked_steps,
      shapes=dict(s.steps_by_shape), draft_s=s.draft_time_s)


def modelled_seconds(run_stats: dict, costs) -> float:
  """A run's decode time with every step at its shape's warm-up time (one table for all the
  engines of a temperature, so run-to-run machine noise drops out), plus its measured
  critical-path drafting. Not modelled: the pipeline drain of a step that asked for drafts."""
  return run_stats["draft_s"] + sum(n * costs.time(shape)
                                    for shape, n in run_stats["shapes"].items())


def main(argv=None):
  args = parse_args(argv)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  t_start = time.perf_counter()
  print(f"[histospec] device: {common.device_description()}", flush=True)
  base, _ = load_model(args.model, param_dtype=dtype)
  tok = load_tokenizer(args.model)
  examples, prompt_ids = gsm8k_prompts(tok, args.num_prompts, args.prompt_offset)
  max_len = max(len(p) for p in prompt_ids) + args.max_new_tokens
  cfg = EngineConfig(max_len=max_len, buckets=args.buckets, max_draft=args.budget,
                     prefill_chunk=args.prefill_chunk,
                     eos_ids=tuple(tok.stop_ids), seed=args.seed)
  print(f"[histospec] {len(prompt_ids)} prompts x G={args.group_size} (prompt lengths "
        f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))}), max_new_tokens="
        f"{args.max_new_tokens}, budget {args.budget}, buckets {args.buckets}, {dtype}", flush=True)
  rows = []
  compiled_in_rollouts = []
  policy_moves = []
  for temp in args.temperatures:
    params = SamplingParams(temperature=temp, max_new_tokens=args.max_new_tokens)
    store = HistoryStore(epochs_kept=1)
    model = base
    learner = scorer = None
    if args.policy_change == "grpo":
      learner, scorer = make_learner(args, dtype, temp, tok)
      model = learner.model()
    t0 = time.perf_counter()
    warm = RolloutEngine(model, cfg, None)
    warm.warmup(filters=False)  # every shape the engines use, compiled and timed
    # Each drafter's engine starts from these step times, as the trainer's one engine keeps its
    # warm-up times (a fresh cost model knows no time and assumes a speculative step costs
    # P / B plain ones: it would never speculate).
    step_times = dict(warm.costs.seconds)
    # One cost model per drafter across the epochs, as the trainer's engine keeps its own
    # across steps: acceptance learnt in one epoch informs the next (per-request estimates are
    # dropped when a request finishes).
    costs_of: dict = {}
    print(f"[histospec] warm-up (compilation) {time.perf_counter() - t0:.1f}s", flush=True)
    compiles_before = dict(TRACE_COUNTS)
    for epoch in range(args.epochs):
      if epoch > 0 and args.policy_change == "noise" and args.noise > 0:
        # the same weight trajectory at every temperature
        model = perturb(model, args.noise, jax.random.fold_in(jax.random.key(args.seed), epoch))
      reqs = make_requests(prompt_ids, args.group_size, params, epoch)
      # Fresh randomness every epoch, as in training (draws are keyed by seed, request id and
      # position: with the epoch-0 seed the slightly moved policy would mostly redraw its old
      # samples and history would look far better than it is). Same seed for every engine of
      # the epoch, so their tokens can be compared.
      ecfg = dataclasses.replace(cfg, seed=args.seed * 1000 + (0 if args.reuse_seed else epoch))
      plain_results, plain = run(RolloutEngine(model, ecfg, None), reqs)
      plain["model_s"] = modelled_seconds(plain, warm.costs)
      line = dict(temp=temp, epoch=epoch, mode="plain", same=len(reqs), **plain)
      rows.append(line)
      print(f"[histospec] T={temp} epoch {epoch} plain: {plain['tokens']} tokens, "
            f"{plain['decode_tps']:.1f} decode tok/s, {plain['total_s']:.1f}s", flush=True)
      for mode in args.modes:
        if epoch == 0 and mode != "siblings":
          continue  # no history yet: 'history' drafts nothing, 'both' equals 'siblings'
        for draft_mode in args.draft_modes:
          drafter = make_drafter(mode, store, args)
          label = mode + ("" if draft_mode == "sync" else f"+{draft_mode}")
          engine = RolloutEngine(model, dataclasses.replace(ecfg, draft_mode=draft_mode),
                                 drafter)
          if label not in costs_of:
            engine.costs.seconds.update(step_times)
            costs_of[label] = engine.costs
          engine.costs = costs_of[label]
          results, st = run(engine, reqs)
          st["model_s"] = modelled_seconds(st, warm.costs)
          same = sum(np.array_equal(a.tokens, b.tokens) for a, b in zip(plain_results, results))
          rows.append(dict(temp=temp, epoch=epoch, mode=label, same=same, **st))
          print(f"[histospec] T={temp} epoch {epoch} {label}: accepted length {st['mal']:.2f}, "
                f"hit {st['hit']:.2f}, fwd/token {st['fpt']:.3f}, draft {st['draft_ms']:.2f} "
                f"ms/step (+{st['ahead_ms']:.2f} ahead, hit {st['ahead_hit']:.2f}), device "
                f"{st['device_ms']:.2f} ms/step, decode {st['decode_tps']:.1f} tok/s "
                f"({st['decode_tps'] / plain['decode_tps']:.2f}x), same tokens "
                f"{same}/{len(reqs)}, {st['total_s']:.1f}s; steps asked / speculative / all "
                f"{st['asked_steps']} / {st['spec_steps']} / {st['steps']}", flush=True)
      if len(rows) > 1 and rows[-1]["mode"] != "plain":
        # Plain again, after the drafting engines: runs later in an epoch ran up to ~10% faster
        # on an otherwise idle CPU (same work), so plain's times are the mean of a run before
        # and one after them, and no drafter gains from running second.
        again_results, again = run(RolloutEngine(model, ecfg, None), reqs)
        assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(plain_results, again_results))
        line.update(bracket_times(plain, again))
      by_prompt: dict = {}
      for req, res in zip(reqs, plain_results):  # the next epoch drafts from this one
        by_prompt.setdefault(req.prompt_key, []).append(res.tokens)
      for key, responses in by_prompt.items():
        store.add_group(key, epoch, responses)
      if learner is not None and epoch + 1 < args.epochs:
        t0 = time.perf_counter()
        model, m = grpo_update(learner, scorer, examples, prompt_ids, reqs, plain_results, epoch,
                               args.grpo_steps)
        print(f"[histospec] T={temp} after epoch {epoch}: {args.grpo_steps} GRPO step(s), "
              f"reward {m['reward']:.3f} (std {m['reward_std']:.3f}), relative parameter "
              f"change {m['moved']:.2e}, {time.perf_counter() - t0:.1f}s", flush=True)
        policy_moves.append(f"T={temp} after epoch {epoch}: reward {m['reward']:.3f} "
                            f"(std {m['reward_std']:.3f}), |dθ|/|θ| {m['moved']:.1e}")
    if dict(TRACE_COUNTS) != compiles_before:
      compiled_in_rollouts.append((temp, compiles_before, dict(TRACE_COUNTS)))

  plain_of = {(r["temp"], r["epoch"]): r for r in rows if r["mode"] == "plain"}
  table_rows = []
  for r in rows:
    p = plain_of[(r["temp"], r["epoch"])]
    spec = r["mode"] != "plain"
    table_rows.append([
        r["temp"], r["epoch"], r["mode"], r["tokens"], f"{r['mal']:.2f}",
        f"{r['hit']:.2f}" if spec else "-", f"{r['fpt']:.3f}",
        f"{r['draft_ms']:.2f}" if spec else "-",
        f"{r['ahead_ms']:.2f} / {r['ahead_hit']:.2f}" if "+ahead" in r["mode"] else "-",
        f"{r['device_ms']:.2f}", f"{r['asked_steps']} / {r['spec_steps']} / {r['steps']}",
        f"{r['same']}/{p['same']}",
        f"{r['decode_tps']:.1f}", f"{r['decode_tps'] / p['decode_tps']:.2f}x",
        f"{r['total_tps']:.1f}", f"{r['total_tps'] / p['total_tps']:.2f}x",
        f"{r['model_s']:.2f}", f"{r['model_s'] / p['model_s']:.3f}"])
  headers = ["T", "epoch", "drafts", "tokens", "accepted len/verify", "hit rate", "fwd/token",
             "draft ms/step", "ahead ms/step / hit", "device ms/step",
             "steps asked / spec / all", "same tokens",
             "decode tok/s", "vs plain", "rollout tok/s",
             "vs plain", "modelled decode s", "modelled / plain"]
  table = common.markdown_table(headers, table_rows)
  print(table)
  for temp, before, after in compiled_in_rollouts:  # a compile inside a timed rollout skews tok/s
    print(f"[histospec] WARNING: T={temp}: compiled during the rollouts: {before} -> {after}",
          flush=True)
  wall = time.perf_counter() - t_start
  notes = [
      f"{args.model}, real GGUF weights dequantized to {dtype}; {len(prompt_ids)} GSM8K train "
      f"prompts (from #{args.prompt_offset}, chat template + 'gsm8k' prompt template) x "
      f"G={args.group_size}, max_new_tokens={args.max_new_tokens}, {args.epochs} epochs, no "
      f"top-p/top-k",
      (f"policy change between epochs: {args.grpo_steps} GRPO step(s) of the real trainer on "
       f"the epoch's own samples (reward {args.reward} + soft overlong penalty over the last "
       f"{max(1, args.max_new_tokens // 4)} tokens, lr {args.learning_rate:g}): "
       + "; ".join(policy_moves)
       if args.policy_change == "grpo" else
       f"policy change between epochs: Gaussian noise of {args.noise:g} x RMS per weight "
       f"tensor"),
      f"drafting engines: HistoryDrafter trees of up to {args.budget} nodes, best first, min "
      f"path prob {args.min_prob}; each step the engine's cost model (speculate=auto) picks a "
      f"plain or a speculative shape and the nodes it verifies; plain = no drafter; buckets "
      f"{args.buckets}; history = the previous epoch's plain responses",
      "plain's times: mean of a run before and one after the drafting engines of its epoch "
      "(same tokens), so run order favours no one",
      "rollout time summed over the epochs each ran, drafting engine / plain: " + ", ".join(
          f"{m} {ratio:.3f}" for m, ratio in summed_ratios(rows).items())
      + "; modelled decode time (every step at its shape's warm-up time + measured drafting; "
      "no machine noise, pipeline drains of asked steps not modelled): " + ", ".join(
          f"{m} {ratio:.3f}" for m, ratio in summed_ratios(rows, "model_s").items()),
      "draft ms/step = host drafting on the critical path (device idle); ahead ms/step = "
      "drafting in a background thread while the device verifies (+ahead / +ahead_only rows), "
      "hit = share of queries whose emitted tokens stayed inside their tree drafted ahead; "
      "device ms/step = dispatch to outputs on the host; steps asked = steps that drafted "
      "(speculative, or plain when the drafts were not worth verifying: the pipeline drained "
      "for nothing)",
      "decode tok/s = tokens / (critical-path drafting + device step time + waiting for the "
      "background drafts), prefill excluded; rollout "
      "tok/s includes prefill; 'same tokens' counts requests equal to the plain run's; "
      "fwd/token = batched forward passes / tokens (compare with plain in the same epoch)",
      "sampling seed: " + ("the same every epoch (--reuse_seed: common random numbers)"
                           if args.reuse_seed else "fresh every epoch, as in training"),
      f"whole bench {wall / 60:.1f} min including warm-up",
  ] + args.note
  if not args.no_append:
    common.append_results("HistoSpec over epochs (bench/histospec.py)", table, notes)
    print(f"[histospec] appended to {common.RESULTS_PATH}")
  print(f"[histospec] done in {wall:.1f}s")


if __name__ == "__main__":
  main()
