"""Model configuration: one frozen dataclass covering the Llama / Qwen2 / Qwen3 decoder family.

The three families differ only in a few switches (q/k/v bias for Qwen2, q/k RMSNorm for Qwen3,
Llama-3 RoPE frequency scaling), so one decoder implementation serves all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `architectures` / `model_type` names -> our family name.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (`rope_type: llama3` in HF configs)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder-only transformer. Hashable: safe as a jit static arg."""

  arch: str = "llama"
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2).
  qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3).
  max_position_embeddings: int = 8192
  param_dtype: str = "float32"
  dtype: str = "float32"  # activation / compute dtype

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"ModelConfig.arch={self.arch!r}: expected one of {ARCHITECTURES}")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{field}={value!r}: expected an integer >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    for field in ("param_dtype", "dtype"):
      if getattr(self, field) not in _DTYPES:
        raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: expected one of "
                         f"{tuple(_DTYPES)}")

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json",
              **overrides) -> "ModelConfig":
    """Builds a config from an HF `config.json` dict; `source` names the file in errors."""
    hf = _normalize_hf(hf, source)
    names = list(hf.get("architectures") or []) + [hf.get("model_type")]
    arch = next((_HF_ARCH[n] for n in names if n in _HF_ARCH), None)
    if arch is None:
      raise ValueError(f"{source}: unknown architecture {names!r}; supported: "
                       f"{sorted(k for k in _HF_ARCH if k[0].isupper())}")

    def need(key):
      if key not in hf:
        raise ValueError(f"{source}: missing field {key!r}")
      return hf[key]

    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    scaling = None
    rs = hf.get("rope_scaling") or None
    if rs:
      kind = rs.get("rope_type", rs.get("type"))
      if kind == "llama3":
        scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                              float(rs["high_freq_factor"]),
                              int(rs["original_max_position_embeddings"]))
      elif kind not in (None, "default"):
        raise ValueError(f"{source}: field 'rope_scaling' has unsupported rope_type {kind!r}; "
                         "supported: llama3, default")
    kw = dict(
        arch=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
    )
    kw.update(overrides)
    return cls(**kw)


def _normalize_hf(hf: dict, source: str) -> dict:
  """Maps transformers>=5 `rope_parameters` onto the older `rope_theta`/`rope_scaling` fields.

  Also refuses, naming the field, what the decoder does not implement and would otherwise
  ignore: sliding-window attention, biases on the attention output or the MLP, an MLP
  activation other than SiLU.
  """
  hf = dict(hf)
  names = set(hf.get("architectures") or []) | {hf.get("model_type")}
  rp = hf.get("rope_parameters")
  if isinstance(rp, dict):
    if "rope_theta" in rp:
      hf.setdefault("rope_theta", rp["rope_theta"])
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "llama3"):
      raise ValueError(f"{source}: field 'rope_parameters' has unsupported rope_type "
                       f"{kind!r}; supported: llama3, default")
    if kind != "default" and not hf.get("rope_scaling"):
      hf["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
  if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
    raise ValueError(f"{source}: sliding-window attention (field 'use_sliding_window' / "
                     "'layer_types') is not supported")
  # Mistral attends within `sliding_window` tokens whenever it is set (transformers' default
  # for the field is 4096); Qwen2 carries the field too, switched by use_sliding_window.
  if names & {"MistralForCausalLM", "mistral"} and hf.get("sliding_window", 4096) is not None:
    raise ValueError(f"{source}: field 'sliding_window' is {hf.get('sliding_window', 4096)}: "
                     "sliding-window attention is not supported (where every sequence is "
                     "shorter than the window, null gives the same model)")
  if hf.get("attention_bias") and not names & {"Qwen2ForCausalLM", "qwen2"}:
    raise ValueError(f"{source}: field 'attention_bias' is true: a bias on the attention "
                     "output projection (o_proj) is not supported")
  if hf.get("mlp_bias"):
    raise ValueError(f"{source}: field 'mlp_bias' is true: MLP biases are not supported")
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act not in ("silu", "swish"):
    raise ValueError(f"{source}: field 'hidden_act' is {act!r}: only silu is supported")
  return hf
