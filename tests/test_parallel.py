"""Tests for rhyme_jax.parallel: meshes, partition rules, sharded models giving unsharded logits.

The multi-device checks need 8 fake CPU devices, which XLA only creates when XLA_FLAGS is set
before jax starts; other test files in the same pytest process have started jax already. So
this file re-runs itself as a child process (`python tests/test_parallel.py --child`) with the
flag set; the child runs every multi-device check once and prints a JSON report that the
tests below assert on. Single-device checks run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

TOL = 1e-5
MESHES = ((8, 1, 1), (2, 2, 2), (1, 4, 2))  # (data, fsdp, tensor)
# Both ways of getting a sharded model on one mesh; the other meshes (to keep the compile count,
# hence the run time, down) only shard an existing model.
HOWS = {(8, 1, 1): ("shard_model",), (2, 2, 2): ("shard_model",),
        (1, 4, 2): ("shard_model", "create_sharded_model")}
CASES = [(shape, how) for shape in MESHES for how in HOWS[shape]]


def _configs():
  from rhyme_jax.models.config import ModelConfig
  return {
      "llama": ModelConfig(arch="llama", tie_word_embeddings=True),
      "qwen3": ModelConfig(arch="qwen3", qk_norm=True, tie_word_embeddings=False),
  }


# ----------------------------------------------------------------------------- child process


def _child_report() -> dict:
  """Runs on 8 fake CPU devices: logits of sharded vs single-device models, plain and cached."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rhyme_jax import parallel as par
  from rhyme_jax.models import sharding as shd
  from rhyme_jax.models.attention import KVCache
  from rhyme_jax.models.transformer import init_model

  assert jax.device_count() == 8, jax.devices()
  b, t, s = 8, 8, 16
  rng = np.random.default_rng(0)

  def plain(model, tokens, positions):
    return model(tokens, positions).logits_BxTxV

  def cached(model, tokens, positions, cache, next_tok, cache_len_B):
    out = model(tokens, positions, cache=cache, cache_len_B=jnp.zeros((b,), jnp.int32))
    step = model(next_tok, cache_len_B[:, None], cache=out.cache, cache_len_B=cache_len_B)
    return out.logits_BxTxV, step.logits_BxTxV

  plain_jit, cached_jit = nnx.jit(plain), nnx.jit(cached)
  report = {}
  for name, cfg in _configs().items():
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    next_tok = rng.integers(0, cfg.vocab_size, (b, 1)).astype(np.int32)
    cache_len = np.array([8, 5, 8, 3, 8, 7, 1, 8], np.int32)  # ragged rows: rollback-like
    dev0 = jax.devices()[0]
    ref_model = init_model(cfg, 0)
    ref_model = nnx.merge(*nnx.split(jax.device_put(ref_model, dev0)))
    ref_plain = np.asarray(plain_jit(ref_model, tokens, positions))
    ref_pre, ref_step = map(np.asarray, cached_jit(
        ref_model, tokens, positions, KVCache.zeros(cfg, b, s), next_tok, cache_len))
    for shape in MESHES:
      mesh = par.make_mesh(*shape)
      for how in HOWS[shape]:
        if how == "shard_model":
          model = shd.shard_model(init_model(cfg, 0), mesh)
        else:
          model = shd.create_sharded_model(cfg, mesh, 0)
        cache = jax.device_put(KVCache.zeros(cfg, b, s), shd.kv_cache_sharding(cfg, mesh, b))
        tok, pos, nxt, clen = par.shard_batch((tokens, positions, next_tok, cache_len), mesh)
        got_plain = np.asarray(plain_jit(model, tok, pos))
        got_pre, got_step = map(np.asarray, cached_jit(model, tok, pos, cache, nxt, clen))
        q = model.layers[0].attn.q_proj.kernel[...].sharding
        head = (model.embed.embedding if cfg.tie_word_embeddings else model.lm_head.kernel)[...]
        report[f"{name}/{shape}/{how}"] = {
            "plain": float(np.abs(got_plain - ref_plain).max()),
            "prefill": float(np.abs(got_pre - ref_pre).max()),
            "decode": float(np.abs(got_step - ref_step).max()),
            "logit_scale": float(np.abs(ref_step).max()),
            "q_spec": str(q.spec),
            "q_devices": len(q.device_set),
            "q_shard_shape": list(q.shard_shape(model.layers[0].attn.q_proj.kernel[...].shape)),
            "head_spec": str(head.sharding.spec),
            "cache_spec": str(cache.k_LxBxSxKxH.sharding.spec),
            "tokens_spec": str(tok.sharding.spec),
        }
  return report


def _run_child() -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  # The child must import this checkout's package, not whichever copy is installed.
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                        capture_output=True, text=True, timeout=600)
  if proc.returncode:
    raise AssertionError(f"child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
  line = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")][-1]
  return json.loads(line[len("REPORT "):])


@pytest.fixture(scope="module")
def report():
  return _run_child()


# ----------------------------------------------------------------------------- multi-device


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("shape,how", CASES)
def test_sharded_logits_match_single_device(report, arch, shape, how):
  r = report[f"{arch}/{shape}/{how}"]
  assert r["logit_scale"] > 1e-3  # the comparison is not between zeros
  assert r["plain"] < TOL, r
  assert r["prefill"] < TOL, r
  assert r["decode"] < TOL, r


def test_params_and_activations_are_actually_sharded(report):
  r = report["qwen3/(1, 4, 2)/create_sharded_model"]
  assert r["q_spec"] == "P('fsdp', 'tensor')"
  assert r["q_devices"] == 8
  assert r["q_shard_shape"] == [64 // 4, 64 // 2]  # [D, N*Dh] = [64, 64] split 4 x 2
  assert r["head_spec"] == "P('fsdp', 'tensor')"  # untied lm_head [D, V]
  assert r["cache_spec"] == "P(None, 'fsdp', None, 'tensor', None)"
  assert r["tokens_spec"] == "P('fsdp', None)"
  r = report["llama/(2, 2, 2)/shard_model"]
  assert r["head_spec"] == "P('tensor', 'fsdp')"  # tied embedding [V, D]
  assert r["cache_spec"] == "P(None, ('data', 'fsdp'), None, 'tensor', None)"
  assert r["tokens_spec"] == "P(('data', 'fsdp'), None)"
  r = report["llama/(8, 1, 1)/shard_model"]
  assert r["q_spec"] == "P(None, None)"  # pure data parallel: replicated
  assert r["q_devices"] == 8
  assert r["tokens_spec"] == "P('data', None)"


# ----------------------------------------------------------------------------- single process


def test_bad_mesh_shape_names_the_flags():
  import jax
  from rhyme_jax import parallel as par
  devices = [jax.devices()[0]] * 1
  with pytest.raises(ValueError, match=r"data=2, fsdp=2, tensor=2.*= 8 but there are 1"):
    par.make_mesh(data=2, fsdp=2, tensor=2, devices=devices)
  with pytest.raises(ValueError, match="fsdp=-1, tensor=-1"):
    par.make_mesh(data=1, fsdp=-1, tensor=-1, devices=devices)
  with pytest.raises(ValueError, match="tensor=0"):
    par.make_mesh(tensor=0, devices=devices)
  mesh = par.make_mesh(devices=devices)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_unmatched_param_names_its_path():
  from flax import nnx
  from rhyme_jax.models import sharding as shd
  from rhyme_jax.models.transformer import Transformer
  cfg = _configs()["llama"]
  state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  rules = tuple(r for r in shd.PARAM_RULES if "mlp/down" not in r[0])
  with pytest.raises(ValueError, match=r"'layers/0/mlp/down_proj/kernel' \(shape \(128, 64\)\)"):
    shd.param_specs(state, rules=rules)
  with pytest.raises(ValueError, match="'blocks/0/ffn/w'"):
    shd.param_specs({"blocks": [{"ffn": {"w": np.zeros((4, 4))}}]})


def test_specs_on_abstract_state_fall_back_when_not_divisible():
  """SmolLM2-135M shapes (9 heads, 3 KV heads) on an abstract 2x2x2 mesh, no devices needed."""
  from flax import nnx
  from jax.sharding import AbstractMesh, PartitionSpec as P
  from rhyme_jax.models import sharding as shd
  from rhyme_jax.models.config import ModelConfig
  from rhyme_jax.models.transformer import Transformer
  cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)
  state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
  specs = shd.param_specs(state, mesh, cfg)
  attn = specs["layers"][1]["attn"]
  # 9 and 3 heads do not split over tensor=2: head dims replicated, D still over fsdp.
  assert attn["q_proj"]["kernel"] == P("fsdp", None)
  assert attn["k_proj"]["kernel"] == P("fsdp", None)
  assert attn["o_proj"]["kernel"] == P(None, "fsdp")
  assert specs["layers"][1]["mlp"]["down_proj"]["kernel"] == P("tensor", "fsdp")
  assert specs["embed"]["embedding"] == P("tensor", "fsdp")
  # Without the config only sizes are checked: 576 = 9*64 is even, so it would split mid-head.
  assert shd.param_specs(state, mesh)["layers"][1]["attn"]["q_proj"]["kernel"] == \
      P("fsdp", "tensor")
  assert shd.kv_cache_spec(cfg, mesh, batch=8) == P(None, ("data", "fsdp"), None, None, None)
  assert shd.kv_cache_spec(cfg, mesh, batch=6) == P(None, None, None, None, None)
  # A 3-way tensor axis divides both head counts.
  mesh3 = AbstractMesh((1, 1, 3), ("data", "fsdp", "tensor"))
  assert shd.param_specs(state, mesh3, cfg)["layers"][0]["attn"]["k_proj"]["kernel"] == \
      P(None, "tensor")


def test_specs_on_flat_numpy_dict():
  """A loader's flat {path: ndarray} dict, with slash or tuple keys, gets the same rules."""
  from jax.sharding import AbstractMesh, PartitionSpec as P
  from rhyme_jax.models import sharding as shd
  mesh = AbstractMesh((1, 2, 2), ("data", "fsdp", "tensor"))
  slash = shd.param_specs({"layers/0/mlp/gate_proj/kernel": np.zeros((8, 6)),
                           "final_norm/scale": np.zeros(8)}, mesh)
  assert slash["layers/0/mlp/gate_proj/kernel"] == P("fsdp", "tensor")
  assert slash["final_norm/scale"] == P(None)
  tuples = shd.param_specs({("layers", 1, "attn", "q_proj", "bias"): np.zeros(6),
                            ("layers", 1, "attn", "o_proj", "kernel"): np.zeros((6, 5))}, mesh)
  assert tuples[("layers", 1, "attn", "q_proj", "bias")] == P("tensor")
  assert tuples[("layers", 1, "attn", "o_proj", "kernel")] == P("tensor", None)  # 5 % 2 != 0


def test_initialize_distributed_is_a_noop_on_one_process(monkeypatch):
  from rhyme_jax import parallel as par
  for key in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES",
              "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(key, raising=False)
  assert par.maybe_initialize_distributed() is False
  assert par.maybe_initialize_distributed(force=False) is False
  assert par.distributed_settings(env={"TPU_WORKER_HOSTNAMES": "w0", "SLURM_NTASKS": "1"},
                                  tpu_workers=lambda: 1) is None


def test_a_cloud_tpu_slice_started_over_ssh_is_found_from_the_metadata_server(monkeypatch):
  """No launcher variable in a TPU VM's ssh shell: the slice's workers come from the GCE
  metadata server, asked only on a machine with TPU chips."""
  import io
  import urllib.request

  from jax._src import hardware_utils

  from rhyme_jax import parallel as par
  asked = []

  def urlopen(request, timeout):
    asked.append((request.full_url, request.get_header("Metadata-flavor"), timeout))
    return io.BytesIO(b"w-0,w-1,w-2,w-3")

  monkeypatch.setattr(urllib.request, "urlopen", urlopen)
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
  assert par.cloud_tpu_workers({}) == 0 and not asked  # no TPU here: nothing asked
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, "v5p"))
  assert par.cloud_tpu_workers({}) == 4
  assert asked == [(par._GCE_METADATA + "worker-network-endpoints", "Google", 5.0)]
  assert par.distributed_settings(env={}) == {}  # jax.distributed.initialize() detects the rest
  assert par.cloud_tpu_workers({"TPU_SKIP_MDS_QUERY": "1"}) == 0
  monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: io.BytesIO(b"w-0"))
  assert par.distributed_settings(env={}) is None  # a single-host TPU VM

  def unanswered(request, timeout):
    raise OSError("no metadata server")

  monkeypatch.setattr(urllib.request, "urlopen", unanswered)
  assert par.cloud_tpu_workers({}) == 1


@pytest.mark.parametrize("flags, env, want", [
    (("", 0, -1), {}, None),  # one process
    (("", 1, 0), {}, None),  # explicitly one process
    (("h:1", 2, 1), {}, {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}),
    (("", 2, 0), {"JAX_COORDINATOR_ADDRESS": "c:9"},
     {"coordinator_address": "c:9", "num_processes": 2, "process_id": 0}),
    (("h:1", 2, 1), {"JAX_COORDINATOR_ADDRESS": "c:9"},  # the flag wins
     {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}),
    (("", 0, -1), {"TPU_WORKER_HOSTNAMES": "w0,w1"}, {}),  # the TPU runtime says it all
    (("", 0, -1), {"MEGASCALE_COORDINATOR_ADDRESS": "m:1"}, {}),
    (("", 0, -1), {"SLURM_NTASKS": "4"}, {}),
    (("", 0, -1), {"TPU_WORKER_HOSTNAMES": "w0"}, None),  # a single-host slice
    (("", 0, -1), {"JAX_COORDINATOR_ADDRESS": "c:9", "SLURM_NTASKS": "4"},
     {"coordinator_address": "c:9"}),  # SLURM gives count and id
])
def test_distributed_settings(flags, env, want):
  from rhyme_jax import parallel as par
  assert par.distributed_settings(*flags, env=env) == want


@pytest.mark.parametrize("flags, env, message", [
    (("", 0, -1), {"JAX_COORDINATOR_ADDRESS": "c:9"},
     "JAX_COORDINATOR_ADDRESS=c:9 is set but the process count is not: pass "
     "--num_processes=N and --process_id=I to every process (or unset it for one process)"),
    (("h:1", 0, -1), {}, "--coordinator_address=h:1 is set but the process count is not"),
    (("h:1", 2, -1), {}, "--coordinator_address=h:1 --num_processes=2: pass --process_id=I"),
    (("", 2, 1), {}, "--num_processes=2: needs --coordinator_address=HOST:PORT"),
])
def test_distributed_settings_errors_are_one_line(flags, env, message):
  from rhyme_jax import parallel as par
  with pytest.raises(ValueError) as e:
    par.distributed_settings(*flags, env=env)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_one_process_batches_and_rows():
  """With one process `shard_batch` places the batch as it is (rows split when they divide,
  replicated otherwise) and `host_rows` reads it back; every process holds its own rows."""
  import jax
  from rhyme_jax import parallel as par
  mesh = par.make_mesh()
  x = np.arange(12, dtype=np.int32).reshape(3, 4)
  put = par.shard_batch({"x": x, "s": np.float32(2.0)}, mesh)
  np.testing.assert_array_equal(par.host_rows(put["x"]), x)
  assert put["x"].shape == (3, 4) and float(put["s"]) == 2.0
  par.check_process_rows(mesh)  # one process: nothing to share
  assert jax.process_count() == 1


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
  print("REPORT " + json.dumps(_child_report()), flush=True)
