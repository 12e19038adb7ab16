import numpy as np
import pytest

from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import init_model


@pytest.fixture(scope="session")
def tiny_model():
  """A random tiny Llama-style model (vocab 64) for engine tests."""
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  return init_model(cfg, seed=1)


def mixed_prompts(n, vocab, seed=0, max_prompt=20):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(rng.integers(1, max_prompt))).tolist() for _ in range(n)]
