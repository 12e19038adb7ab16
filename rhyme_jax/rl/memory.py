"""Per-device memory of a run, estimated before anything is loaded or compiled.

`estimate` traces the model and the optimiser abstractly (`nnx.eval_shape`, `jax.eval_shape`:
no weights, no compilation) and places every leaf with the run's partition rules on its mesh,
so the bytes are those of one device's shards, not of the whole model. It adds the rollout
engine's KV cache (largest batch bucket, its sharding rule) and the train step's working set
(gradients, and the activations one micro-batch keeps for the backward pass) and, with several
processes, the policy replica each host's rollout runs on (`rhyme_jax.multihost`). `check_fits`
compares the total with the declared device memory (`--device_memory_gib`, else what the device
reports) and refuses, naming the parts, a config that cannot fit: the run stops before it
writes anything rather than dying in an out-of-memory error after minutes of compilation.

The estimate is checked against XLA's own memory analysis of the compiled train and rollout
steps in tests/rl/test_memory.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from absl import logging as absl_logging
from flax import nnx

from rhyme_jax import multihost
from rhyme_jax.config import Config, ConfigError
from rhyme_jax.models import sharding
from rhyme_jax.models.config import ModelConfig
from rhyme_jax.models.transformer import Transformer
from rhyme_jax.rl.learner import HEAD_CHUNK, make_optimizer, optimizer_shardings
from rhyme_jax.rl.rollouts import engine_config
from rhyme_jax.rl.samples import length_buckets

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of each part of a run (the largest device, shards rounded up)."""

  params: int
  opt_state: int
  ref_params: int  # the frozen reference policy (KL penalty on), else 0
  # Three parameter-sized trees live through an update: the micro-batch scan's gradient
  # accumulator and the optimiser's updates (float32 whatever the parameters' dtype), and the
  # gradient of the micro-batch being added (the parameters' dtype).
  grads: int
  activations: int  # kept by one micro-batch's forward for its backward pass (approximate)
  # The same with the micro-batch's rows split over the mesh's batch axes (data x fsdp), as if
  # every activation sharded by rows: the least a device could hold. XLA does not get there
  # (on an fsdp mesh of 4 CPU devices its temporaries per row held were 1.6x one device's), so
  # `activations` counts every row on every device and errs high; the truth lies between.
  activations_sharded: int
  kv_cache: int  # the rollout engine's cache at its largest bucket
  kv_bucket: int  # that bucket's rows
  kv_positions: int  # its cache length
  # With several processes: the policy replica on this host's devices that rollout uses (one
  # process shares the learner's parameters: 0).
  rollout_params: int = 0

  @property
  def train_state(self) -> int:
    return self.params + self.opt_state + self.ref_params

  @property
  def total(self) -> int:
    """Peak of a step: the training state, the update's working set and the rollout cache
    (the engine keeps its cache between rollouts, so both are resident at once)."""
    return self.train_state + self.grads + self.activations + self.kv_cache + self.rollout_params

  @property
  def least(self) -> int:
    """`total` with the activations split over the batch axes (`activations_sharded`): a run
    above this cannot fit, one between it and `total` may."""
    return self.total - self.activations + self.activations_sharded

  def describe(self) -> str:
    g = lambda n: f"{n / GIB:.2f}"
    least = (f" ({g(self.least)} with the activations split over the batch axes)"
             if self.least < self.total else "")
    return (f"{g(self.total)} GiB per device{least}: parameters {g(self.params)}, optimiser "
            f"state "
            f"{g(self.opt_state)}" + (f", reference policy {g(self.ref_params)}"
                                      if self.ref_params else "")
            + f", gradients {g(self.grads)}, activations ~{g(self.activations)}, rollout KV "
            f"cache {g(self.kv_cache)} ({self.kv_bucket} rows x {self.kv_positions} positions)"
            + (f", rollout policy replica {g(self.rollout_params)}" if self.rollout_params
               else ""))


def _device_bytes(abstract_tree, shardings_tree) -> int:
  """Bytes one device holds of a tree of abstract arrays under a tree of shardings."""
  leaves = jax.tree.leaves(abstract_tree)
  shards = jax.tree.leaves(shardings_tree,
                           is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sh in zip(leaves, shards))


def abstract_params(model_config: ModelConfig) -> nnx.State:
  """The model's parameters as `ShapeDtypeStruct`s (nothing materialised)."""
  abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
  return nnx.state(abstract, nnx.Param)


def activation_bytes(model_config: ModelConfig, rows: int, seq: int, itemsize: int,
                     remat: bool = False) -> int:
  """What one micro-batch's forward keeps for the backward pass, per layer and at the head.

  Per layer and token: the block input and the normed inputs of attention and MLP (3 D), the
  q/k/v projections and the attention output (N H + 2 K H + N H), the MLP's gate, up and
  their product (3 F); per layer and row four float32 N T^2 arrays (the attention scores,
  their exponentials, the probabilities and, in the backward pass, their gradient: fitted to
  XLA's memory analysis at T = 64-512, where counting two left the estimate 26% low at 256
  tokens). At the head, the float32 logits, their log-softmax and its gradient (3 V per
  token). XLA reuses buffers, so this is a model of the peak, not an exact count. `rows` are
  the rows one device holds (see MemoryEstimate.activations_sharded). With `remat` (--remat)
  a layer keeps only its input (D per token) and one layer's working set is live at a time,
  and the head runs HEAD_CHUNK positions at a time (learner._chunked_head): its 3 V per token
  for one chunk of every row, plus the final hidden states (D per token).
  """
  m = model_config
  per_token = (3 * m.hidden_size + 2 * m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim
               + 3 * m.intermediate_size) * itemsize
  per_row = 4 * m.num_heads * seq * seq * 4
  layer = rows * seq * per_token + rows * per_row
  layers = (m.num_layers * rows * seq * m.hidden_size * itemsize + layer if remat
            else m.num_layers * layer)
  if remat:
    head = (rows * min(seq, HEAD_CHUNK) * 3 * m.vocab_size * 4
            + rows * seq * m.hidden_size * itemsize)
  else:
    head = rows * seq * 3 * m.vocab_size * 4
  return layers + head


def estimate(config: Config, model_config: ModelConfig, mesh) -> MemoryEstimate:
  """Per-device bytes of `config`'s run on `mesh` (a `Mesh` or `AbstractMesh`)."""
  c, m = config, model_config
  params = abstract_params(m)
  param_sh = sharding.param_shardings(params, mesh, m)
  p_bytes = _device_bytes(params, param_sh)
  opt = jax.eval_shape(make_optimizer(c).init, params)
  o_bytes = _device_bytes(opt, optimizer_shardings(opt, mesh, m))
  eng = engine_config(c, (), c.rollout.spec == "histospec")
  bucket = max(eng.buckets)
  kv = jax.ShapeDtypeStruct((m.num_layers, bucket, eng.cache_len, m.num_kv_heads, m.head_dim),
                            m.jnp_dtype)
  kv_sh = jax.sharding.NamedSharding(mesh, sharding.kv_cache_spec(m, mesh, bucket))
  kv_bytes = 2 * _device_bytes(kv, kv_sh)
  replica = 0
  if jax.process_count() > 1 and isinstance(mesh, jax.sharding.Mesh):
    local = multihost.host_local_mesh(mesh)
    replica = _device_bytes(params, sharding.param_shardings(params, local, m))
  rows = c.rl.micro_batch_size or c.rl.samples_per_step  # this process's
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  seq = length_buckets(c.rollout.max_prompt_len + c.rollout.max_new_tokens)[-1]
  # --remat scans the layers over a stacked copy of their parameters (transformer.
  # _remat_layers): one more copy of them, as XLA's count at 64 and 256 tokens shows
  stack = _device_bytes(params["layers"], param_sh["layers"]) if c.rl.remat else 0
  act = lambda n: (activation_bytes(m, n, seq, jnp.dtype(m.jnp_dtype).itemsize, c.rl.remat)
                   + stack)
  return MemoryEstimate(
      params=p_bytes, opt_state=o_bytes, ref_params=p_bytes if c.rl.kl_beta > 0 else 0,
      grads=p_bytes * (1 + 2 * 4 // jnp.dtype(m.jnp_param_dtype).itemsize), activations=act(rows),
      activations_sharded=act(min(rows, -(-rows * jax.process_count() // shards))),
      kv_cache=kv_bytes, kv_bucket=bucket, kv_positions=eng.cache_len, rollout_params=replica)


def device_memory_bytes(config: Config) -> int | None:
  """The declared memory per device (`--device_memory_gib`), else what the first device
  reports (`memory_stats()['bytes_limit']`; CPUs report nothing: None)."""
  if config.run.device_memory_gib > 0:
    return int(config.run.device_memory_gib * GIB)
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def fit_verdict(est: MemoryEstimate, limit: int) -> str:
  """"fits" (`total` within `limit`), "may not fit" (only `least` is) or "DOES NOT FIT"."""
  return ("fits" if est.total <= limit else "may not fit" if est.least <= limit
          else "DOES NOT FIT")


def check_fits(config: Config, model_config: ModelConfig, mesh) -> MemoryEstimate:
  """The estimate, or ConfigError naming what does not fit in the device memory even with the
  activations split over the batch axes (`MemoryEstimate.least`); a warning where it fits
  only so (`fit_verdict`: "may not fit")."""
  est = estimate(config, model_config, mesh)
  limit = device_memory_bytes(config)
  verdict = None if limit is None else fit_verdict(est, limit)
  if verdict in (None, "fits"):
    return est
  source = ("--device_memory_gib" if config.run.device_memory_gib > 0
            else f"{jax.local_devices()[0].device_kind} memory")
  what = (f"{source} ({limit / GIB:.2f} GiB per device): {est.describe()}; shard more "
          "(--mesh_fsdp / --mesh_tensor), or lower --micro_batch_size, --group_size x "
          "--prompts_per_step or --max_new_tokens")
  if verdict == "DOES NOT FIT":
    raise ConfigError(f"the run does not fit in {what}")
  absl_logging.warning("the run may not fit in %s (it fits if XLA splits the activations "
                       "over the batch axes)", what)
  return est
