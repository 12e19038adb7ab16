"""rhyme_jax: JAX-native RL post-training (GRPO) with speculative, history-drafted rollouts.

Shape-suffix legend, the one used throughout the project: an array named `x_BxTxD` has axes
B, T, D in that order.

  B  batch rows (slots / sequences)          P  packed tokens (all rows' tokens on one axis)
  T  tokens per row (sequence or tree)       S  KV-cache positions
  L  layers                                  D  model width        F  MLP hidden width
  N  query heads    K  KV heads    G  query heads per KV head (N = K*G)    H  head dim
  V  vocabulary     C  prefill-chunk tokens  R  requests (host side)  M  micro-batches
  W  words of a bit mask (uint32)            E  epochs kept in history

Inside a Pallas kernel (pallas_kernels/) three letters take a kernel's meaning: R the query
rows of one tile (a row's T tokens x G heads), C the cache positions of one KV block, X a
tile's lane width; J there counts the KV splits of one row (flash-decoding).

The nodes of one row's draft tree are that row's T axis. L is never a sequence length and N
never a count of nodes, groups or rows; an axis without a letter here (e.g. the samples of a
GRPO group) gets a plain name and a shape comment instead.

Imports flow one way: main -> rl -> (history, scheduling, data) -> rollout -> models ->
pallas_kernels, with config, parallel, checkpoint, run_config and metrics at the bottom
(tests/test_structure.py enforces it).
"""
