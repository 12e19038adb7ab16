"""Pallas kernels (the bottom layer: imports nothing from rhyme_jax).

Tree-verification attention under the ATTENTION CONTRACT (see reference.py):
  tree_attention.py  dispatch: impl="auto" | "reference" | "tpu" | "gpu", logged fallback
  reference.py       dense plain-JAX reference (tests; tiny shapes)
  tpu.py             Mosaic TPU kernel (scalar prefetch, manual double-buffered DMA)
  gpu.py             Triton GPU kernel (flash-decoding KV splits)
  block_math.py      in-kernel tree bit tests and online softmax, shared by both kernels
  layout.py          packed <-> per-row query tiles, shared by both kernels
"""
