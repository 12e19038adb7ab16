"""HistoryDrafter inside the real RolloutEngine (tiny random model): exact history is accepted
almost entirely, unrelated history is rejected and never changes output, sibling drafts never
change what a group samples."""

import dataclasses

import numpy as np
import pytest

from rhyme_jax.history.drafter import HistoryDrafter
from rhyme_jax.history.store import HistoryStore, prompt_key
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rollout.drafts import NoDrafts
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

VOCAB = 64
EOS = 3
BUDGET = 8


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  return init_model(cfg, seed=1)


def engine(model, drafter, eos=(EOS,), budget=BUDGET, draft_mode="sync", attention="xla"):
  """Every step verifies a tree of `budget` tokens (empty for NoDrafts): one step shape for
  plain and speculative runs, so their tokens must be bit-identical."""
  cfg = EngineConfig(max_len=96, buckets=(8, 4, 2, 1), max_draft=budget, speculate="always",
                     pack_factors=(budget + 1,), kv_buckets=1, eos_ids=eos, seed=7,
                     draft_mode=draft_mode, attention=attention)
  return RolloutEngine(model, cfg, drafter)


def prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(4, VOCAB, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


def group_requests(prompt_list, group_size, params):
  """group_size requests per prompt; group id = prompt index; prompt key = token hash."""
  reqs = []
  for g, p in enumerate(prompt_list):
    for _ in range(group_size):
      reqs.append(Request(len(reqs), p, params, group_id=g, prompt_key=prompt_key(p)))
  return reqs


def record(drafter, reqs, results, key_of=lambda req: req.prompt_key):
  """Records each group's responses under a prompt key (the trainer's job after a rollout)."""
  groups = {}
  for req, res in zip(reqs, results):
    groups.setdefault(key_of(req), []).append(res.tokens)
  for key, responses in groups.items():
    drafter.record_group(key, responses)


def assert_same_tokens(a_results, b_results, what):
  for a, b in zip(a_results, b_results):
    np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"{what}: request {a.request_id}")
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_repeated_history_is_accepted_up_to_the_budget(model):
  """Greedy decoding, unchanged weights: the second epoch replays the first, so every draft is
  accepted; tokens per verify approach budget + 1 and forward passes per token fall with it."""
  params = SamplingParams(temperature=0.0, max_new_tokens=64)
  reqs = group_requests(prompts(4, seed=0), 2, params)
  first_engine = engine(model, NoDrafts(), eos=())
  first = first_engine.generate(reqs)
  assert first_engine.stats.mean_accepted_length == 1.0

  drafter = HistoryDrafter(HistoryStore(), use_siblings=False, max_budget=BUDGET)
  record(drafter, reqs, first)
  second_engine = engine(model, drafter, eos=())
  second = second_engine.generate(reqs)
  assert_same_tokens(first, second, "history replay")
  stats = second_engine.stats
  assert stats.drafted > 0 and stats.accepted == stats.drafted  # nothing drafted was wrong
  # 64 tokens per request: 7 verifies of 9 tokens and one of 1 (64/8 = 8.0).
  floor = 0.85
  assert stats.mean_accepted_length >= floor * (BUDGET + 1)
  assert stats.forwards_per_token <= first_engine.stats.forwards_per_token / (floor * (BUDGET + 1))


def test_first_step_drafts_the_openings_of_past_responses(model):
  """An empty response (the first verify) drafts from how past responses began."""
  params = SamplingParams(temperature=0.0, max_new_tokens=BUDGET + 1)
  reqs = group_requests(prompts(2, seed=1), 1, params)
  first = engine(model, NoDrafts(), eos=()).generate(reqs)
  drafter = HistoryDrafter(HistoryStore(), use_siblings=False, max_budget=BUDGET)
  record(drafter, reqs, first)
  eng = engine(model, drafter, eos=())
  second = eng.generate(reqs)
  assert_same_tokens(first, second, "openings")
  assert all(r.steps == 1 for r in second)  # budget + 1 tokens in one verify


def test_requests_without_a_prompt_key_use_the_prompt_tokens(model):
  """The engine's default key is the prompt's token tuple; the drafter files and finds history
  under its hash, so the trainer can record groups by prompt tokens."""
  params = SamplingParams(temperature=0.0, max_new_tokens=32)
  reqs = [Request(i, p, params, group_id=i) for i, p in enumerate(prompts(3, seed=6))]
  first = engine(model, NoDrafts(), eos=()).generate(reqs)
  drafter = HistoryDrafter(HistoryStore(), use_siblings=False, max_budget=BUDGET)
  for req, res in zip(reqs, first):
    drafter.record_group(tuple(req.prompt), [res.tokens])
  assert prompt_key(reqs[0].prompt) in drafter.store
  eng = engine(model, drafter, eos=())
  assert_same_tokens(first, eng.generate(reqs), "default keys")
  assert eng.stats.mean_accepted_length >= 0.8 * (BUDGET + 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("unrelated", ["random_tokens", "other_prompts"])
def test_unrelated_history_never_changes_output(model, temperature, unrelated):
  """History from elsewhere (random sequences, or the responses of other prompts filed under
  these prompts' keys): output equals plain decoding through the same step shape; random
  history is mostly rejected."""
  params = SamplingParams(temperature=temperature, max_new_tokens=48)
  reqs = group_requests(prompts(4, seed=2), 2, params)
  plain = engine(model, NoDrafts()).generate(reqs)

  drafter = HistoryDrafter(HistoryStore(), use_siblings=False, max_budget=BUDGET)
  keys = [r.prompt_key for r in reqs]
  if unrelated == "random_tokens":
    rng = np.random.default_rng(3)
    for key in set(keys):
      drafter.record_group(key, [rng.integers(0, VOCAB, size=48) for _ in range(4)])
  else:
    others = group_requests(prompts(4, seed=20), 2, params)
    other_results = engine(model, NoDrafts()).generate(others)
    key_of = {o.prompt_key: k for o, k in zip(others, keys)}  # prompt i's key <- other prompt i
    record(drafter, others, other_results, key_of=lambda o: key_of[o.prompt_key])

  eng = engine(model, drafter)
  spec = eng.generate(reqs)
  assert_same_tokens(plain, spec, f"{unrelated} history, T={temperature}")
  assert eng.stats.drafted > 0  # the history was actually consulted
  assert eng.stats.forwards_per_token <= 1.0
  if unrelated == "random_tokens":
    assert eng.stats.accepted / eng.stats.drafted < 0.2


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sibling_drafts_never_change_a_group(model, temperature):
  """G = 8 samples of one prompt at temperature: drafting from the live siblings (no history)
  emits the same tokens as no drafting, with drafts made synchronously or ahead."""
  params = SamplingParams(temperature=temperature, max_new_tokens=48)
  reqs = group_requests(prompts(2, seed=4), 8, params)
  plain = engine(model, NoDrafts()).generate(reqs)
  for mode in ("sync", "ahead", "ahead_only"):
    drafter = HistoryDrafter(None, use_history=False, use_siblings=True, max_budget=BUDGET)
    eng = engine(model, drafter, draft_mode=mode)
    spec = eng.generate(reqs)
    assert_same_tokens(plain, spec, f"siblings, T={temperature}, draft_mode={mode}")
    assert eng.stats.drafted > 0
    assert drafter.live_groups <= 2


def test_history_and_siblings_keep_tokens_under_perturbed_weights(model):
  """The bench's setting in miniature: epoch 2 runs slightly different weights at T=0.6 with
  history from epoch 1 and siblings; tokens equal plain decoding with the new weights."""
  import jax
  from flax import nnx
  params = SamplingParams(temperature=0.6, max_new_tokens=48)
  reqs = group_requests(prompts(3, seed=5), 4, params)
  drafter = HistoryDrafter(HistoryStore(), max_budget=BUDGET)
  record(drafter, reqs, engine(model, NoDrafts()).generate(reqs))

  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  noisy = [x + 1e-3 * jax.numpy.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  perturbed = nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))
  plain = engine(perturbed, NoDrafts()).generate(reqs)
  eng = engine(perturbed, drafter)
  spec = eng.generate(reqs)
  assert_same_tokens(plain, spec, "perturbed weights")
  assert eng.stats.accepted > 0


def test_history_drafts_on_the_kernel_path_emit_the_xla_tokens(model):
  """attention='pallas_interpret' (on CPU the TPU kernel, interpreted) with history and sibling
  drafts: the history is the responses with every fourth token changed, so drafts are partly
  accepted, and the tokens equal the XLA path's plain decoding (few tokens: the interpreter is
  slow)."""
  params = SamplingParams(temperature=0.0, max_new_tokens=12)
  reqs = group_requests(prompts(2, seed=9), 2, params)
  plain = engine(model, NoDrafts(), eos=()).generate(reqs)
  drafter = HistoryDrafter(HistoryStore(), max_budget=BUDGET)
  for req, res in zip(reqs, plain):
    wrong = res.tokens.copy()
    wrong[3::4] = (wrong[3::4] + 1) % VOCAB
    drafter.record_group(req.prompt_key, [wrong])
  eng = engine(model, drafter, eos=(), attention="pallas_interpret")
  assert eng.attention_impl == "tpu_interpret"
  assert_same_tokens(plain, eng.generate(reqs), "history drafts on the kernel path")
  assert 0 < eng.stats.accepted < eng.stats.drafted


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_drafting_ahead_overlaps_the_device_and_changes_no_token(model, temperature):
  """draft_mode 'ahead' / 'ahead_only': drafts come from trees drafted in a background thread
  during the previous step. Replaying history (greedy, same weights) nearly every step takes its
  draft from there (hits); 'ahead_only' never drafts on the critical path. At any temperature
  the tokens equal plain decoding, and nothing compiles beyond the synchronous run's shapes."""
  from rhyme_jax.rollout.engine import TRACE_COUNTS
  params = SamplingParams(temperature=temperature, max_new_tokens=64)
  reqs = group_requests(prompts(4, seed=8), 2, params)
  plain = engine(model, NoDrafts(), eos=()).generate(reqs)
  history = engine(model, NoDrafts(), eos=()).generate(
      [dataclasses.replace(r, params=SamplingParams(temperature=0.0, max_new_tokens=64))
       for r in reqs])
  runs = {}
  for mode in ("sync", "ahead", "ahead_only"):
    drafter = HistoryDrafter(HistoryStore(), max_budget=BUDGET)
    record(drafter, reqs, history)
    eng = engine(model, drafter, eos=(), draft_mode=mode)
    eng.warmup()
    traces = dict(TRACE_COUNTS)
    runs[mode] = (eng.generate(reqs), eng.stats, drafter.stats)
    assert dict(TRACE_COUNTS) == traces, "a rollout compiled"
    assert_same_tokens(plain, runs[mode][0], f"draft_mode={mode}, T={temperature}")
  assert runs["sync"][1].lookahead_time_s == 0 and runs["sync"][1].ahead_hits == 0
  for mode in ("ahead", "ahead_only"):
    stats, dstats = runs[mode][1], runs[mode][2]
    assert stats.lookahead_time_s > 0 and dstats["lookahead_queries"] > 0
    assert dstats["ahead_used"] == stats.ahead_hits
    if temperature == 0.0:  # the replayed history: almost every draft was prepared ahead
      assert stats.ahead_hits >= 0.8 * (stats.ahead_hits + stats.ahead_misses)
      assert stats.mean_accepted_length >= 0.75 * runs["sync"][1].mean_accepted_length
  # 'ahead_only' drafts synchronously for nobody: every non-empty draft came from ahead.
  only = runs["ahead_only"][2]
  assert only["draft_tokens"] == only["ahead_tokens"]
