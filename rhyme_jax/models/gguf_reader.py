"""Reading llama.cpp GGUF files: metadata, model config, and dequantized HF-layout tensors.

A GGUF file holds the weights (often block-quantized), the model hyper-parameters as
`{arch}.*` metadata keys, and the tokenizer. This module turns it into what the rest of the
loader wants: a `ModelConfig` and float32 numpy tensors named and laid out like HF's
(`[out, in]` for linear weights). Two llama.cpp conventions are undone here:

- llama.cpp names tensors `blk.N.attn_q.weight` etc. (`GGUF_NAMES` maps ours onto them);
- for the `llama` architecture the converter permutes the rows of Q and K inside each head so
  that RoPE can rotate adjacent pairs (interleaved layout); our RoPE rotates halves (the HF
  layout), so `_unpermute_rows` puts the rows back. Qwen2/Qwen3 use the half layout in
  llama.cpp as well and are stored unpermuted.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rhyme_jax.models.config import ModelConfig

# Tensor types we dequantize; anything else is rejected with the tensor's name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")

# GGUF `general.architecture` -> our family name.
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Our parameter path (relative to a layer for the per-layer ones) -> llama.cpp tensor name.
_LAYER_NAMES = {
    "input_norm.scale": "attn_norm.weight",
    "attn.q_proj.kernel": "attn_q.weight",
    "attn.q_proj.bias": "attn_q.bias",
    "attn.k_proj.kernel": "attn_k.weight",
    "attn.k_proj.bias": "attn_k.bias",
    "attn.v_proj.kernel": "attn_v.weight",
    "attn.v_proj.bias": "attn_v.bias",
    "attn.o_proj.kernel": "attn_output.weight",
    "attn.q_norm.scale": "attn_q_norm.weight",
    "attn.k_norm.scale": "attn_k_norm.weight",
    "post_attn_norm.scale": "ffn_norm.weight",
    "mlp.gate_proj.kernel": "ffn_gate.weight",
    "mlp.up_proj.kernel": "ffn_up.weight",
    "mlp.down_proj.kernel": "ffn_down.weight",
}
_TOP_NAMES = {
    "embed.embedding": "token_embd.weight",
    "final_norm.scale": "output_norm.weight",
    "lm_head.kernel": "output.weight",
}


def gguf_name(param_path: str) -> str:
  """`layers.3.attn.q_proj.kernel` -> `blk.3.attn_q.weight` (KeyError for unknown paths)."""
  if param_path.startswith("layers."):
    _, idx, rest = param_path.split(".", 2)
    return f"blk.{idx}.{_LAYER_NAMES[rest]}"
  return _TOP_NAMES[param_path]


class GGUFFile:
  """An open GGUF file: metadata lookups and dequantized tensors, errors naming the file."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # heavy import, only when a GGUF is actually read

    self._gguf = gguf
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"GGUF file not found: {self.path}")
    try:
      self.reader = gguf.GGUFReader(self.path)
    except Exception as e:  # the gguf package reports truncation as reshape/dtype errors
      raise ValueError(f"{self.path}: cannot read GGUF file (truncated or corrupt?): "
                       f"{type(e).__name__}: {e}") from e
    self.tensors = {t.name: t for t in self.reader.tensors}

  # ----- metadata

  def has(self, key: str) -> bool:
    return key in self.reader.fields

  def get(self, key: str, default: Any = ...) -> Any:
    """The value of metadata `key` (arrays as lists); ValueError naming file and key if absent."""
    field = self.reader.fields.get(key)
    if field is None:
      if default is ...:
        raise ValueError(f"{self.path}: missing GGUF metadata field {key!r}")
      return default
    return field.contents()

  @property
  def architecture(self) -> str:
    return self.get("general.architecture")

  def config(self, **overrides) -> ModelConfig:
    """A `ModelConfig` from the `{arch}.*` metadata keys and the tensors present."""
    arch_name = self.architecture
    unsupported = sorted({(t.tensor_type.name, t.name) for t in self.reader.tensors
                          if t.tensor_type.name not in SUPPORTED_TYPES})
    if unsupported:  # found from the header, before any weight is read
      kind, name = unsupported[0]
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported type {kind}; "
                       f"supported: {', '.join(SUPPORTED_TYPES)}")
    if arch_name not in _ARCH:
      raise ValueError(f"{self.path}: field 'general.architecture' has unsupported value "
                       f"{arch_name!r}; supported: {sorted(_ARCH)}")
    if "rope_freqs.weight" in self.tensors:
      raise ValueError(f"{self.path}: tensor 'rope_freqs.weight' (Llama-3 RoPE scaling stored as "
                       "per-frequency factors) is not supported; load the HF checkpoint instead")
    a = arch_name
    hidden = int(self.get(f"{a}.embedding_length"))
    num_heads = int(self.get(f"{a}.attention.head_count"))
    num_kv = int(self.get(f"{a}.attention.head_count_kv", num_heads))
    head_dim = int(self.get(f"{a}.attention.key_length", hidden // num_heads))
    # RoPE as llama.cpp would apply it and this decoder does not: refused, not ignored.
    scaling = str(self.get(f"{a}.rope.scaling.type", "none"))
    if scaling != "none" or float(self.get(f"{a}.rope.scaling.factor", 1.0)) != 1.0:
      raise ValueError(f"{self.path}: field '{a}.rope.scaling.type' is {scaling!r} (factor "
                       f"{self.get(f'{a}.rope.scaling.factor', 1.0)}): RoPE scaling in a GGUF "
                       "is not supported; load the HF checkpoint instead")
    rotary = int(self.get(f"{a}.rope.dimension_count", head_dim))
    if rotary != head_dim:
      raise ValueError(f"{self.path}: field '{a}.rope.dimension_count' is {rotary}, not the "
                       f"head dim {head_dim}: partial rotary embeddings are not supported")
    embd = self.tensors.get("token_embd.weight")
    if embd is not None:
      vocab = int(embd.shape[-1])  # ggml order: [hidden, vocab]; the matrix is authoritative
    elif self.has("tokenizer.ggml.tokens"):
      vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
    else:
      vocab = int(self.get(f"{a}.vocab_size"))
    kw = dict(
        arch=_ARCH[arch_name],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(self.get(f"{a}.feed_forward_length")),
        num_layers=int(self.get(f"{a}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in self.tensors,
        attention_bias="blk.0.attn_q.bias" in self.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
        max_position_embeddings=int(self.get(f"{a}.context_length", 8192)),
    )
    kw.update(overrides)
    return ModelConfig(**kw)

  # ----- tensors

  def tensor(self, name: str, cfg: ModelConfig | None = None) -> np.ndarray:
    """Tensor `name` dequantized to float32 in numpy (HF) order, Q/K rows un-permuted."""
    t = self.tensors.get(name)
    if t is None:
      raise ValueError(f"{self.path}: missing tensor {name!r}")
    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported type {kind}; "
                       f"supported: {', '.join(SUPPORTED_TYPES)}")
    try:
      # Copy out of the memmap first: slicing a memmap block by block is much slower.
      x = self._gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    except Exception as e:
      raise ValueError(f"{self.path}: cannot dequantize tensor {name!r} ({kind}): {e}") from e
    x = np.asarray(x, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
    if cfg is not None and self.architecture == "llama":
      if name.endswith((".attn_q.weight", ".attn_q.bias")):
        x = _unpermute_rows(x, cfg.num_heads, name, self.path)
      elif name.endswith((".attn_k.weight", ".attn_k.bias")):
        x = _unpermute_rows(x, cfg.num_kv_heads, name, self.path)
    return x


def _unpermute_rows(x: np.ndarray, heads: int, name: str, path: str) -> np.ndarray:
  """Undoes llama.cpp's per-head Q/K row order.

  Within each head the converter lists rows as (pair index, member of pair): row 2i is the
  first-half row i of HF and row 2i+1 its partner from the second half. Reading the rows as
  [heads, half, 2] and swapping the last two axes restores HF's [heads, 2, half] order.
  """
  rows = x.shape[0]
  if rows % (2 * heads):
    raise ValueError(f"{path}: tensor {name!r} has {rows} rows, not a multiple of 2*{heads} heads")
  half = rows // heads // 2
  rest = x.shape[1:]
  return x.reshape(heads, half, 2, *rest).swapaxes(1, 2).reshape(x.shape)
