"""One process of a multi-process test run (tests/rl/test_trainer_multihost.py).

  python tests/rl/multihost_entry.py LOG_DIR --flags...   (the run's flags, --process_id etc.)

Runs `Trainer(config).run()` as `rhyme_jax.main` would, and records what this process did in
LOG_DIR/process<I>.jsonl, one line per event, flushed at once (a SIGKILL loses nothing
written): `batch` (the prompt-stream positions, example uids and epochs each `next()` of the data
iterator gave),
`generate` (request ids, response lengths and decode steps of each engine call), `train` (the
(uid, epoch) of every sample this process trained on). Wrappers only observe: each calls the
real method and returns its result. At the end it saves this host's rollout policy replica to
LOG_DIR/params<I>.npz and a fingerprint of its history store.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import train_entry


class _LoggedIterator:
  def __init__(self, inner, emit, trainer):
    self.inner, self.emit, self.trainer = inner, emit, trainer

  def __next__(self):
    batch = next(self.inner)
    self.emit(kind="batch", step=self.trainer.step, positions=list(batch.positions),
              uids=list(batch.uids), epochs=list(batch.epochs))
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


def main(log_dir: str, argv: list[str]) -> None:
  train_entry.register_test_reward()
  import jax
  import numpy as np
  from rhyme_jax.config import parse_flags
  from rhyme_jax.rl import trainer as trainer_lib

  t = trainer_lib.Trainer(parse_flags(argv))
  p = t.process_index
  log = open(os.path.join(log_dir, f"process{p}.jsonl"), "a", encoding="utf-8")

  def emit(**record):
    log.write(json.dumps(record) + "\n")
    log.flush()

  emit(kind="start", step=t.step, processes=t.process_count,
       local_devices=[d.id for d in t.policy.local_mesh.devices.flat])
  t.data_iter = _LoggedIterator(t.data_iter, emit, t)
  engine, learner = t.rollouts.engine, t.learner
  generate, train_on = engine.generate, learner.train_on

  def logged_generate(requests, **kwargs):
    results = generate(requests, **kwargs)
    emit(kind="generate", step=t.step,
         greedy=bool(requests) and requests[0].params.temperature == 0,
         ids=[r.request_id for r in requests], lengths=[len(r.tokens) for r in results],
         decode_steps=engine.stats.steps, spec_steps=engine.stats.spec_steps)
    return results

  def logged_train_on(groups):
    emit(kind="train", step=t.step,
         samples=[[s.prompt.example.uid, s.prompt.epoch] for g in groups for s in g])
    return train_on(groups)

  engine.generate, learner.train_on = logged_generate, logged_train_on
  t.run()
  leaves = jax.tree_util.tree_leaves_with_path(engine.params)
  np.savez(os.path.join(log_dir, f"params{p}.npz"),
           **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
  store = t.rollouts.store
  digest = None
  if store is not None:
    state = store.state_dict()
    h = hashlib.sha256(json.dumps({k: v for k, v in state.items()
                                   if not isinstance(v, np.ndarray)}, sort_keys=True,
                                  default=str).encode())
    for k in sorted(state):
      if isinstance(state[k], np.ndarray):
        h.update(k.encode() + state[k].tobytes())
    digest = h.hexdigest()
  emit(kind="end", step=t.step, history=digest, history_prompts=len(store or []))
  log.close()


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
