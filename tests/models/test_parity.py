"""Parity with transformers (the reference): logits and greedy continuations.

Tiny random Llama / Llama-3-RoPE / Qwen2 / Qwen3 models are created with transformers, saved
as safetensors (once sharded), loaded with our loader, and compared; then the real SmolLM2
GGUF is loaded by both and compared on a chat prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rhyme_jax.models.attention import KVCache  # noqa: E402
from rhyme_jax.models.loading import load_hf_checkpoint, load_model  # noqa: E402

NEW_TOKENS = 32
# max |ours - ref| must stay below this fraction of the reference logit scale (max |logit|).
REL_TOL = 1e-4


def greedy_with_cache(model, cfg, prompt: list[int], n: int) -> list[int]:
  """Greedy decode with our KV cache: one prefill call, then one-token decode calls."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens_BxT, positions_BxT, cache, cache_len_B):
    out = nnx.merge(graphdef, state)(tokens_BxT, positions_BxT, cache=cache,
                                     cache_len_B=cache_len_B)
    return jnp.argmax(out.logits_BxTxV[:, -1], axis=-1), out.cache

  t = len(prompt)
  cache = KVCache.zeros(cfg, 1, t + n)
  nxt, cache = step(state, jnp.asarray([prompt], jnp.int32), jnp.arange(t)[None], cache,
                    jnp.zeros((1,), jnp.int32))
  out = []
  for i in range(n):
    out.append(int(nxt[0]))
    nxt, cache = step(state, nxt[:, None].astype(jnp.int32), jnp.full((1, 1), t + i), cache,
                      jnp.full((1,), t + i, jnp.int32))
  return out


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
  gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                      eos_token_id=None, pad_token_id=0, bos_token_id=None)
  with torch.no_grad():
    out = hf_model.generate(torch.tensor([prompt]), generation_config=gen)
  return out[0, len(prompt):].tolist()


def logits_diff(model, hf_model, ids: list[int]) -> tuple[float, float]:
  """(max |ours - ref|, max |ref|) over all positions of one sequence."""
  with torch.no_grad():
    ref = hf_model(torch.tensor([ids])).logits.float().numpy()
  ours = np.asarray(model(jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None]).logits_BxTxV)
  return float(np.abs(ours - ref).max()), float(np.abs(ref).max())


def _randomize(hf_model, seed: int):
  """Non-trivial norms and biases (HF inits them to 1 and 0), so a mis-mapped one shows."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      if "norm" in name:
        p.copy_(0.5 + torch.rand(p.shape, generator=g))
      elif name.endswith("bias"):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))


_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15,
               max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)

CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False), None),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=5000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), None),
    "llama-sharded": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=3), "20KB"),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), None),
    "qwen3-qknorm-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        tie_word_embeddings=True, head_dim=24), None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_pair(request, tmp_path_factory):
  """(our model, our cfg, the HF model, case name) for one tiny random config."""
  cfg_cls, model_cls, extra, shard = CASES[request.param]
  torch.manual_seed(len(request.param))
  hf_cfg = getattr(transformers, cfg_cls)(**{**_COMMON, **extra})
  hf_model = getattr(transformers, model_cls)(hf_cfg).eval()
  _randomize(hf_model, seed=7)
  path = tmp_path_factory.mktemp(request.param)
  kw = {"max_shard_size": shard} if shard else {}
  hf_model.save_pretrained(path, safe_serialization=True, **kw)
  if shard:
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 1
  model, cfg = load_hf_checkpoint(path)
  return model, cfg, hf_model, request.param


def test_tiny_config_matches(tiny_pair):
  _, cfg, hf_model, name = tiny_pair
  assert cfg.tie_word_embeddings == hf_model.config.tie_word_embeddings
  if name.startswith("qwen2"):
    assert cfg.attention_bias
  if name.startswith("qwen3"):
    assert cfg.qk_norm and cfg.head_dim == 24
  if name.startswith("llama3"):
    assert cfg.rope_scaling is not None and cfg.rope_theta == 5000.0


def test_tiny_logits_match(tiny_pair):
  model, _, hf_model, name = tiny_pair
  ids = np.random.RandomState(1).randint(0, 97, size=40).tolist()
  diff, scale = logits_diff(model, hf_model, ids)
  print(f"{name}: max|diff|={diff:.3g} logit scale={scale:.3g}")
  assert diff <= REL_TOL * max(scale, 1.0), (name, diff, scale)


def test_tiny_greedy_continuation_matches(tiny_pair):
  model, cfg, hf_model, name = tiny_pair
  prompt = np.random.RandomState(2).randint(0, 97, size=7).tolist()
  ours = greedy_with_cache(model, cfg, prompt, NEW_TOKENS)
  ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
  assert ours == ref, name


def test_load_model_dispatches_directory(tmp_path):
  hf_cfg = transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})
  transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path, safe_serialization=True)
  model, cfg = load_model(str(tmp_path), param_dtype=jnp.bfloat16)
  assert cfg.param_dtype == "bfloat16"
  assert model.embed.embedding[...].dtype == jnp.bfloat16


# --- the real SmolLM2-135M-Instruct (GGUF, Q4_1 / Q8_0 dequantized to float32) ---------------


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2_tokenizer):
  msgs = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples now?"}]
  return smollm2_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)


@pytest.mark.slow  # loads SmolLM2 twice (~30-60 s on 2 cores)
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf, smollm2_prompt):
  model, cfg = smollm2
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
  diff, scale = logits_diff(model, smollm2_hf, smollm2_prompt)
  print(f"SmolLM2: max|diff|={diff:.3g} logit scale={scale:.3g} over {len(smollm2_prompt)} tokens")
  assert diff <= REL_TOL * scale, (diff, scale)


@pytest.mark.slow  # plus jit of the 30-layer model for prefill and decode
def test_smollm2_greedy_matches_transformers(smollm2, smollm2_hf, smollm2_prompt,
                                             smollm2_tokenizer):
  model, cfg = smollm2
  ours = greedy_with_cache(model, cfg, smollm2_prompt, NEW_TOKENS)
  ref = hf_greedy(smollm2_hf, smollm2_prompt, NEW_TOKENS)
  print("SmolLM2 greedy:", repr(smollm2_tokenizer.decode(ours)))
  assert ours == ref
