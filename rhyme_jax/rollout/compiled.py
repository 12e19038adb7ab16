"""The engine's compiled functions, jitted once per process and model structure.

Engines over the same model share these and their compilations; TRACE_COUNTS counts traces
(= compilations) per function so tests can assert that nothing compiles inside a rollout.
"""

from __future__ import annotations

import collections
import functools
import threading

import jax

from rhyme_jax.rollout import accept, kv_cache, step


# Compiled once per process, model structure and shape (`_model_fns` below), so engines over
# the same model share compilations. TRACE_COUNTS counts traces (= compilations) per function,
# for tests and logs.
TRACE_COUNTS: collections.Counter = collections.Counter()
_COUNT_LOCK = threading.Lock()


def counted(kind, fn):
  @functools.wraps(fn)
  def wrapped(*args, **kw):
    with _COUNT_LOCK:  # warm-up traces in several threads
      TRACE_COUNTS[kind] += 1  # runs once per trace
    return fn(*args, **kw)
  return wrapped


@functools.lru_cache(maxsize=16)
def model_fns(graphdef, treedef):
  """Verify and prefill jitted for one model structure, taking the params as a flat list.
  Arrays cross between host and device one per call each way: verify takes its packed trees
  as `PackedTrees.wire()` and returns the new state and its outputs as `step.to_wire`'s one
  array, prefill takes one (slot, start, chunk...) array. Verify's static `steps` > 1 runs
  that many plain steps in the call (`step.plain_steps`).

  Looked up once per engine (hashing an NNX graphdef costs milliseconds, flattening a params
  State with its key sorting almost one), so a step's dispatch hashes and flattens neither.
  Engines over the same structure share these functions and their compilations.
  """
  def verify(leaves, state, wire, seed, *, filters, max_kv_len, max_q_len, attention_impl,
             steps=1):
    trees = accept.PackedTrees.from_wire(wire, state.batch)  # one transfer, not six
    one = functools.partial(step.verify_step, graphdef, jax.tree.unflatten(treedef, leaves),
                            trees=trees, seed=seed, filters=filters, max_kv_len=max_kv_len,
                            max_q_len=max_q_len, attention_impl=attention_impl)
    state, out = one(state) if steps == 1 else step.plain_steps(one, state, steps)
    return state, step.to_wire(out)  # one copy back, not three

  def prefill(leaves, cache, args):  # int32 (slot, start, C chunk tokens): one transfer
    return step.prefill_chunk(graphdef, jax.tree.unflatten(treedef, leaves), cache, args[0],
                              args[2:], args[1])

  return (jax.jit(counted("step", verify),
                  static_argnames=("filters", "max_kv_len", "max_q_len", "attention_impl",
                                   "steps"), donate_argnums=(1,)),
          jax.jit(counted("prefill", prefill), donate_argnums=(1,)))


load_slots_jit = jax.jit(counted("load", step.load_slots), donate_argnums=(0,))
regroup_jit = jax.jit(counted("regroup", step.regroup))


# Divided rollout: a pass's parks, resumes and slot loading in one call (state and pool donated).
park_resume_load_jit = jax.jit(counted("park_resume_load", step.park_resume_load),
                               donate_argnums=(0, 1))

# Admission: a prompt's prefilled KV row copied into its siblings' slots, a pass's in one call.
copy_within_jit = jax.jit(counted("copy_within", kv_cache.copy_rows_within), donate_argnums=(0,))
