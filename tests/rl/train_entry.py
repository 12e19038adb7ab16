"""Test entry point: `python tests/rl/train_entry.py --flags...` = `python -m rhyme_jax.main`
plus one extra registered reward, `test_parity`, for tiny random models.

A random model never writes a correct answer, so every real reward is 0 for all samples, all
advantages are 0 and nothing is learned. `test_parity` (1 if the decoded completion has an even
number of characters) varies within a group, so the gradients are non-zero and a test can tell
whether parameters and optimiser state survive a restart.
"""

from __future__ import annotations

import os
import sys

from rhyme_jax.rl.rewards import available_rewards, register_reward
from rhyme_jax.rl.rewards.registry import RewardResult

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                  hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=1024,
                  hidden_act="silu")


def register_test_reward() -> None:
  if "test_parity" in available_rewards():
    return

  @register_reward("test_parity")
  def _parity():
    def score(completion, example):
      # A host failing on its own mid-run: the input check's probe (an answer with '####')
      # passes, a sampled completion raises (tests/rl/test_trainer_multihost.py).
      if os.environ.get("RHYME_JAX_TEST_REWARD_RAISES") and "####" not in completion:
        raise RuntimeError("test_parity: this process's reward fails")
      r = float(len(completion) % 2 == 0)
      return RewardResult(r, {"correct": r})
    return score


def write_tiny_llama(directory: str, seed: int = 0, eos_boost: float = 0.0) -> str:
  """A random 1-layer Llama with SmolLM2's vocabulary size as an HF safetensors directory.

  `eos_boost` > 0 makes SmolLM2's end of turn (token 2) likely at every position, so responses
  end early and at random lengths: every embedding row gets a shared component along one axis,
  which dominates the normed last hidden state, and token 2's row `eos_boost` more of it (its
  logit leads by ~4 * eos_boost; 2.5 gives it ~30% at temperature 1).
  """
  import json

  import numpy as np
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  c = TINY_LLAMA
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(c, f)
  rng = np.random.default_rng(seed)
  d, f_, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  q = c["num_attention_heads"] * c["head_dim"]
  kv = c["num_key_value_heads"] * c["head_dim"]
  w = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)
  ones = lambda n: np.ones(n, np.float32)
  embed = w(v, d)
  if eos_boost:
    embed[:, 0] += 1.0
    embed[2, 0] += eos_boost
  tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": ones(d)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": ones(d), p + "post_attention_layernorm.weight": ones(d),
        p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.k_proj.weight": w(kv, d),
        p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, q),
        p + "mlp.gate_proj.weight": w(f_, d), p + "mlp.up_proj.weight": w(f_, d),
        p + "mlp.down_proj.weight": w(d, f_)})
  save_file(tensors, os.path.join(directory, "model.safetensors"))
  return directory


if __name__ == "__main__":
  register_test_reward()
  from rhyme_jax import main
  sys.argv[0] = "rhyme_jax.main"
  main.run_main()
