"""Speculation is invisible on the real SmolLM2-135M-Instruct (float32, CPU): oracle trees
with wrong branches and garbage drafts containing EOS emit exactly the tokens of plain decoding
through the same compiled step shape, greedy and sampled."""

import numpy as np
import pytest

from rhyme_jax.rollout.drafts import NoDrafts, OracleDrafter, RandomDrafter
from rhyme_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from rhyme_jax.rollout.sampling import SamplingParams

QUESTIONS = ["Tom has 7 apples and buys 5 more. How many apples does he have?",
             "A box holds 6 pens. How many pens are in 3 boxes?"]


@pytest.fixture(scope="module")
def setup(smollm2, smollm2_tokenizer):
  model, _ = smollm2
  tok = smollm2_tokenizer
  prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=False))
             for q in QUESTIONS]
  cfg = EngineConfig(max_len=96, buckets=(2,), max_draft=4, speculate="always", kv_buckets=1,
                     eos_ids=tuple(tok.stop_ids), seed=3)
  return model, tok, prompts, cfg


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=24),
                                    SamplingParams(temperature=1.0, max_new_tokens=24),
                                    SamplingParams(temperature=0.7, top_p=0.9,
                                                   max_new_tokens=24)],
                         ids=["greedy", "t1.0", "t0.7-top_p0.9"])
def test_smollm2_speculation_is_invisible(setup, params):
  model, tok, prompts, cfg = setup
  reqs = lambda: [Request(i, p, params) for i, p in enumerate(prompts)]
  plain = RolloutEngine(model, cfg, NoDrafts()).generate(reqs())
  targets = {r.request_id: r.tokens for r in plain}
  for drafter in (OracleDrafter(targets, model.cfg.vocab_size, accuracy=0.8, branches=2),
                  RandomDrafter(model.cfg.vocab_size, seed=1, extra_tokens=tok.stop_ids)):
    eng = RolloutEngine(model, cfg, drafter)
    spec = eng.generate(reqs())
    for a, b in zip(plain, spec):
      np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=tok.decode(a.tokens.tolist()))
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    if isinstance(drafter, OracleDrafter):
      assert eng.stats.mean_accepted_length > 1.5
