"""rl/learner.py on its own: a tiny random model, hand-made scored groups, real updates."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rhyme_jax import parallel
from rhyme_jax.config import parse_flags
from rhyme_jax.data.datasets import Example
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model
from rhyme_jax.rl.learner import Learner
from rhyme_jax.rl.samples import Sample, prompt_of

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8)


def _learner(*flags):
  config = parse_flags(["--run_dir=unused", "--group_size=2", "--prompts_per_step=2",
                        "--max_prompt_len=8", "--max_new_tokens=8", "--learning_rate=0.01",
                        "--temperature=1.0", *flags])
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  return Learner(config, init_model(CFG, 0), mesh, CFG)


def _groups(rewards):
  rng = np.random.default_rng(0)
  groups = []
  for i, rs in enumerate(rewards):
    p = prompt_of(Example(f"u{i}", "q", "a"), rng.integers(1, 64, 5))
    groups.append([Sample(p, rng.integers(1, 64, 4).astype(np.int32),
                          np.full(4, -4.0, np.float32), "stop", reward=r) for r in rs])
  return groups


def _params(learner):
  return [np.array(x) for x in jax.tree.leaves(learner.params)]


def test_update_moves_the_policy_and_reports_metrics():
  learner = _learner()
  before = _params(learner)
  m = learner.train_on(_groups([[1.0, 0.0], [0.0, 1.0]]))
  assert m["seq_len"] == 16  # 9 tokens -> the smallest bucket of max_prompt_len + max_new
  assert np.isfinite(m["train/loss"]) and m["grad_norm"] > 0
  assert max(float(np.abs(a - b).max()) for a, b in zip(before, _params(learner))) > 1e-4
  assert jax.tree.leaves(learner.model())[0] is not None


def test_equal_rewards_leave_the_policy_unchanged():
  learner = _learner("--weight_decay=0")
  before = _params(learner)
  m = learner.train_on(_groups([[1.0, 1.0], [0.0, 0.0]]))  # zero advantages everywhere
  assert m["grad_norm"] == 0.0
  for a, b in zip(before, _params(learner)):
    np.testing.assert_array_equal(a, b)


def test_micro_batches_average_to_the_full_batch_gradient():
  whole, micro = _learner(), _learner("--micro_batch_size=2")
  groups = _groups([[1.0, 0.0], [0.2, 0.9]])
  m_whole, m_micro = whole.train_on(groups), micro.train_on(groups)
  assert m_whole["grad_norm"] == pytest.approx(m_micro["grad_norm"], rel=1e-4)
  for a, b in zip(_params(whole), _params(micro)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _ragged_groups(rewards, lengths):
  """Groups whose responses have the given lengths (tokens), not all alike."""
  rng = np.random.default_rng(1)
  groups, it = [], iter(lengths)
  for i, rs in enumerate(rewards):
    p = prompt_of(Example(f"u{i}", "q", "a"), rng.integers(1, 64, 5))
    groups.append([])
    for r in rs:
      n = next(it)
      groups[-1].append(Sample(p, rng.integers(1, 64, n).astype(np.int32),
                               np.full(n, -4.0, np.float32), "stop", reward=r))
  return groups


@pytest.mark.parametrize("aggregation, rewards, lengths", [
    ("token-mean", [[1.0, 0.0], [0.2, 0.9]], [6, 1, 1, 8]),  # unequal token counts
    # one group: two of the four rows are padding (two more updates compiled: slow)
    pytest.param("token-mean", [[1.0, 0.0]], [6, 2], marks=pytest.mark.slow),
    pytest.param("seq-mean-token-mean", [[1.0, 0.0]], [6, 2], marks=pytest.mark.slow),
], ids=["ragged", "padding", "padding-seq-mean"])
def test_micro_batches_give_the_whole_batch_gradient_whatever_the_lengths(aggregation, rewards,
                                                                         lengths):
  """Each micro-batch's loss is a mean over its own tokens (or sequences): weighted by its
  share of the batch's (learner.micro_weights) the update is the whole batch's. An equal
  1/M weighting gave short responses and empty rows the wrong weight."""
  flags = ("--weight_decay=0", f"--loss_aggregation={aggregation}")
  whole, micro = _learner(*flags), _learner(*flags, "--micro_batch_size=1")
  groups = _ragged_groups(rewards, lengths)
  m_whole, m_micro = whole.train_on(groups), micro.train_on(groups)
  assert m_whole["train/loss"] == pytest.approx(m_micro["train/loss"], rel=1e-4, abs=1e-7)
  assert m_whole["grad_norm"] == pytest.approx(m_micro["grad_norm"], rel=1e-4)
  for a, b in zip(_params(whole), _params(micro)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_remat_updates_as_keeping_activations_does():
  """--remat recomputes each layer in the backward pass: the same update to float rounding."""
  kept, remat = _learner("--micro_batch_size=2"), _learner("--micro_batch_size=2", "--remat")
  groups = _groups([[1.0, 0.0], [0.2, 0.9]])
  m_kept, m_remat = kept.train_on(groups), remat.train_on(groups)
  assert m_kept["grad_norm"] == pytest.approx(m_remat["grad_norm"], rel=1e-5)
  for a, b in zip(_params(kept), _params(remat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # compiles the update and the log-prob step (~1 min on 2 shared cores)
def test_second_epoch_sees_kl_to_the_reference():
  learner = _learner("--ppo_epochs=2", "--kl_beta=0.1")
  m = learner.train_on(_groups([[1.0, 0.0], [0.0, 1.0]]))
  # The first epoch starts at the reference (KL exactly 0); the reported last epoch does not.
  assert m["kl"] > 1e-8
  assert learner.ref_params is not None


def _head_inputs(b=3, t=10, cfg=CFG):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, params = nnx.split(init_model(cfg, 1))
  rng = np.random.default_rng(2)
  tokens = jax.numpy.asarray(rng.integers(0, 64, (b, t)), jax.numpy.int32)
  targets = jax.numpy.asarray(rng.integers(0, 64, (b, t)), jax.numpy.int32)
  return graphdef, params, tokens, targets


UNTIED3 = dataclasses.replace(CFG, num_layers=3, tie_word_embeddings=False)


@pytest.mark.parametrize("chunk, cfg", [(3, CFG), (16, CFG), (3, UNTIED3)],
                         ids=["padded_chunks", "one_chunk", "three_layers_untied"])
def test_chunked_head_gives_the_whole_heads_values_and_gradients(chunk, cfg):
  """--remat scans the layers and applies the head a chunk of positions at a time
  (learner._chunked_head): the log-probs, entropies and their gradients are the plain
  forward's to float rounding, with a tied head or an lm_head of its own."""
  from rhyme_jax.rl import learner  # pylint: disable=import-outside-toplevel
  graphdef, params, tokens, targets = _head_inputs(cfg=cfg)
  w = jax.numpy.linspace(0.5, 1.5, 30).reshape(3, 10)

  def objective(p, remat):
    logp, ent = learner._forward_logprobs(graphdef, p, tokens, targets, 0.7, remat, chunk)
    return jax.numpy.sum(w * logp) + 0.3 * jax.numpy.sum(w * ent), (logp, ent)

  (v0, (lp0, e0)), g0 = jax.value_and_grad(objective, has_aux=True)(params, False)
  (v1, (lp1, e1)), g1 = jax.value_and_grad(objective, has_aux=True)(params, True)
  assert lp1.shape == (3, 10) and e1.shape == (3, 10)
  np.testing.assert_allclose(lp1, lp0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(e1, e0, rtol=1e-5, atol=1e-6)
  assert float(v1) == pytest.approx(float(v0), rel=1e-5)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_chunked_head_never_holds_the_whole_logits():
  """XLA's own count of the gradient's temporaries: with a vocabulary far wider than the
  model, the whole head's B x T x V float32 logits (and their log-softmax and its gradient)
  dominate; a 4-position chunk holds a fraction of them."""
  from rhyme_jax.rl import learner  # pylint: disable=import-outside-toplevel
  wide = dataclasses.replace(CFG, vocab_size=8192)
  graphdef, params, tokens, targets = _head_inputs(b=2, t=64, cfg=wide)

  def temp_bytes(chunk):
    def loss(p):
      logp, ent = learner._forward_logprobs(graphdef, p, tokens, targets, 1.0, True, chunk)
      return jax.numpy.sum(logp) + jax.numpy.sum(ent)
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = 2 * 64 * wide.vocab_size * 4
  whole, chunked = temp_bytes(64), temp_bytes(4)
  assert whole >= 3 * logits_bytes  # logits, log-softmax, its gradient (17 MB at jax 0.10.2)
  assert chunked < logits_bytes / 2  # a 4-position chunk's share of them (1.3 MB)


@pytest.mark.parametrize("flags", [[], pytest.param(
    ["--micro_batch_size=2", "--ppo_epochs=2", "--kl_beta=0.1"], marks=pytest.mark.slow)])
def test_bfloat16_parameters_train_on_float32_master_weights(flags, tmp_path):
  """--param_dtype=bfloat16. An update is about the learning rate (here 1e-5), below a bfloat16
  weight's resolution (2**-8 of it): applied to bfloat16 weights most of it rounds away, so the
  optimiser runs on float32 master weights and the bfloat16 parameters are their rounding.
  (Before, the first update failed: a bfloat16 gradient sum in a float32-weighted scan.) The
  masters move by about the learning rate, survive a checkpoint, and the loss follows a
  float32 run's."""
  from rhyme_jax.checkpoint import RunCheckpointer
  from rhyme_jax.rl.learner import MasterWeights

  def run(dtype):
    cfg = dataclasses.replace(CFG, param_dtype=dtype, dtype=dtype)
    config = parse_flags(["--run_dir=unused", "--group_size=2", "--prompts_per_step=2",
                          "--max_prompt_len=8", "--max_new_tokens=8", "--learning_rate=1e-5",
                          "--temperature=1.0", f"--param_dtype={dtype}", *flags])
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    model = init_model(cfg, 0)  # the float32 model's weights, rounded: both runs start alike
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(init_model(CFG, 0))))
    learner = Learner(config, model, mesh, cfg)
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(learner.params)]
    losses = [learner.train_on(_groups([[1.0, 0.0], [0.0, 1.0]]))["train/loss"]]
    return learner, before, losses

  learner, before, losses = run("bfloat16")
  assert isinstance(learner.opt_state, MasterWeights)
  params, master = jax.tree.leaves(learner.params), jax.tree.leaves(learner.opt_state.master)
  assert {p.dtype for p in params} == {np.dtype("bfloat16")}
  assert {m.dtype for m in master} == {np.dtype("float32")}
  moved = max(float(np.abs(np.asarray(m) - b).max()) for m, b in zip(master, before))
  assert 0.5e-5 < moved < 3e-5, moved  # Adam's first update: about the learning rate
  for p, m in zip(params, master):  # the parameters are the masters' rounding, exactly
    np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))
  ref, ref_before, ref_losses = run("float32")
  assert not isinstance(ref.opt_state, MasterWeights)
  np.testing.assert_allclose(losses, ref_losses, atol=2e-3)
  step = np.concatenate([(np.asarray(m) - b).ravel() for m, b in zip(master, before)])
  ref_step = np.concatenate([(np.asarray(p) - b).ravel()
                             for p, b in zip(jax.tree.leaves(ref.params), ref_before)])
  assert np.mean(np.sign(step) == np.sign(ref_step)) > 0.95  # the same direction, mostly
  with RunCheckpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, params=learner.params, opt_state=learner.opt_state)
    back = ckpt.restore(abstract_params=learner.params, abstract_opt_state=learner.opt_state)
  assert isinstance(back.opt_state, MasterWeights)
  for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(learner.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
