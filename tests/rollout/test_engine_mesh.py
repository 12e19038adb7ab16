"""The engine on an 8-device mesh (data x fsdp x tensor = 2 x 2 x 2), the trainer's placement:
after warm-up a rollout compiles nothing, including the steps that follow a move into a smaller
bucket and the passes that park and resume yielded requests. On one device every placement is
the same; on a mesh a step, a regroup or a park pass could hand the next call a state placed
differently from the one warm-up compiled for, and that call would compile inside the rollout
(a change of input sharding retraces, so the trace counter sees it).

The 8 fake CPU devices need XLA_FLAGS before jax starts, so this file re-runs itself as a child
process (`python tests/rollout/test_engine_mesh.py --child`), as tests/test_parallel.py does.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = {  # name -> EngineConfig overrides; every case moves rows as soon as they fit
    "speculative_divided": dict(max_draft=4, pack_factors=(5,), speculate="always",
                                divide_every=4, park_rows=3),
    "plain_two_steps_per_launch": dict(max_draft=0, pack_factors=(2,), speculate="never",
                                       multi_step=2),
}


def _child_report() -> dict:
  import jax
  from rhyme_jax import parallel as par
  from rhyme_jax.models import sharding as shd
  from rhyme_jax.models.config import ModelConfig
  from rhyme_jax.models.transformer import init_model
  from rhyme_jax.rollout.drafts import RandomDrafter
  from rhyme_jax.rollout.engine import TRACE_COUNTS, EngineConfig, Request, RolloutEngine
  from rhyme_jax.rollout.sampling import SamplingParams
  from tests.rollout.conftest import mixed_prompts
  from tests.rollout.test_divided import FewestTokensFirst

  assert jax.device_count() == 8, jax.devices()
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  model = shd.shard_model(init_model(cfg, 1), par.make_mesh(2, 2, 2))
  report = {}
  for name, overrides in CASES.items():
    config = EngineConfig(max_len=64, buckets=(4, 2, 1), kv_buckets=2, eos_ids=(3,), seed=5,
                          bucket_moves="always", **overrides)
    drafter = RandomDrafter(64, seed=0) if config.max_draft else None
    eng = RolloutEngine(model, config, drafter)
    eng.warmup(filters=False)
    before = collections.Counter(TRACE_COUNTS)
    # Response caps from 5 to 23 tokens: rows finish at different times, so the live rows
    # shrink through every bucket.
    requests = [Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=5 + 3 * (i % 7)),
                        group_id=i // 4) for i, p in enumerate(mixed_prompts(9, 64, seed=3))]
    order = FewestTokensFirst() if config.divide_every else None
    results = eng.generate(requests, admission=order)
    report[name] = {
        "compiled": dict(collections.Counter(TRACE_COUNTS) - before),
        "bucket_moves": eng.stats.bucket_moves, "yields": eng.stats.yields,
        "errors": [r.error for r in results if r.error],
        "cache_devices": len(eng._new_state(1).cache.k_LxBxSxKxH.devices()),
    }
  return report


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                        cwd=REPO, capture_output=True, text=True, timeout=900)
  if proc.returncode:
    raise AssertionError(f"child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
  line = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")][-1]
  return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rollout_on_a_mesh_compiles_nothing_after_warm_up(report, name):
  got = report[name]
  assert got["errors"] == []
  assert got["cache_devices"] == 8  # the engine's state lives on the whole mesh
  assert got["bucket_moves"] == 2  # 4 -> 2 -> 1: each move's next step ran
  if CASES[name].get("divide_every"):
    assert got["yields"] > 0  # parked and resumed rows were stepped too
  assert got["compiled"] == {}, f"compiled inside the rollout on a mesh: {got['compiled']}"


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
  print("REPORT " + json.dumps(_child_report()), flush=True)
