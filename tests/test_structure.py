"""The package's shape: the import graph has no cycle and flows one way, modules stay small.

Layers, top to bottom (a module may import its own layer and anything below it; siblings
such as history and data only without a cycle):

  main -> rl -> (history, scheduling, data) -> rollout -> models -> pallas_kernels
  -> (config, parallel, multihost, checkpoint, run_config, metrics, plot), which import
  nothing above.

Every import counts, including those inside functions (they are cycles all the same, only
hidden). Read from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rhyme_jax"

LAYERS = {  # higher number = higher layer
    "main": 7, "rl": 6, "history": 5, "scheduling": 5, "data": 5, "rollout": 4, "models": 3,
    "pallas_kernels": 2,
    "rhyme_jax": 1,  # the package root: the legend, no imports
    "config": 1, "parallel": 1, "multihost": 1, "checkpoint": 1, "run_config": 1, "metrics": 1, "plot": 1,
}
# The bottom modules import nothing above them, and nothing from each other but these.
BOTTOM_ALLOWED = {("plot", "metrics")}

MAX_LINES = 400
LONGER_ALLOWED = {  # module -> why it may be longer (keep this list short)
    "rhyme_jax/history/fast_draft.py": "the numba kernels of batched drafting (index, match, "
                                       "best-first tree) and their buffers: one compiled unit",
    "rhyme_jax/config.py": "every flag of a run (dataclass field, default, help, check) in one "
                           "table-driven module that loads no JAX: the one place flags are read",
}


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  out = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  for p in (ROOT / "pallas_kernels").rglob("*.py") if (ROOT / "pallas_kernels").is_dir() else ():
    out[_module_name(p)] = p
  return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """Package modules `name` imports anywhere in its file (module or function level)."""
  tree = ast.parse(path.read_text(), str(path))
  is_pkg = path.name == "__init__.py"
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
      targets = [base] + [f"{base}.{a.name}" for a in node.names]
    else:
      continue
    for t in targets:
      while t and t not in known:  # `import a.b.c` of a package-level name -> its module
        t = t.rpartition(".")[0]
      if t and t != name and (t in known):
        found.add(t)
  return found


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  known = set(mods)
  graph = {}
  for name, path in mods.items():
    deps = _imports(name, path, known)
    # `from rhyme_jax.x import y` also imports rhyme_jax.x's package __init__: only the
    # package root itself is exempt (it holds the legend and imports nothing).
    graph[name] = {d for d in deps if d not in ("rhyme_jax", "pallas_kernels")}
  return graph


def _layer(module: str) -> tuple[str, int]:
  parts = module.split(".")
  if parts[0] == "pallas_kernels":
    return "pallas_kernels", LAYERS["pallas_kernels"]
  key = parts[1] if len(parts) > 1 else "rhyme_jax"
  return key, LAYERS.get(key, 0)


def test_graph_is_read_from_the_source():
  graph = _graph()
  assert "rhyme_jax.rl.trainer" in graph and "rhyme_jax.rl.learner" in graph
  assert "rhyme_jax.rl.learner" in graph["rhyme_jax.rl.trainer"]
  assert "rhyme_jax.config" in graph["rhyme_jax.main"]
  assert "rhyme_jax.rl.trainer" in graph["rhyme_jax.main"]  # function-level import counted


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(n):
    state[n] = 1
    stack.append(n)
    for d in sorted(graph.get(n, ())):
      if state.get(d) == 1:
        return stack[stack.index(d):] + [d]
      if d not in state:
        found = visit(d)
        if found:
          return found
    state[n] = 2
    stack.pop()
    return None

  for n in sorted(graph):
    if n not in state:
      found = visit(n)
      if found:
        return found
  return None


def test_no_import_cycles():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_flow_down_the_layers():
  bad = []
  for mod, deps in sorted(_graph().items()):
    key, level = _layer(mod)
    if level == 0:
      bad.append(f"{mod}: not in any layer (add its package to LAYERS)")
      continue
    for d in sorted(deps):
      dkey, dlevel = _layer(d)
      if dlevel > level:
        bad.append(f"{mod} ({key}) imports {d} ({dkey}), a higher layer")
      elif level == dlevel == 1 and key != dkey and (key, dkey) not in BOTTOM_ALLOWED:
        bad.append(f"{mod} imports {d}: bottom modules import no other package module")
  assert not bad, "\n".join(bad)


def test_config_imports_no_jax():
  tree = ast.parse((PACKAGE / "config.py").read_text())
  names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
           for a in n.names}
  names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)}
  assert not names & {"jax", "flax", "optax", "numpy", "rhyme_jax"}, names


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")))
def test_module_size(path):
  n = len((ROOT / path).read_text().splitlines())
  if path in LONGER_ALLOWED:
    return
  assert n <= MAX_LINES, (f"{path} has {n} lines (> {MAX_LINES}): split it along its concepts "
                          "or list it in LONGER_ALLOWED with the reason")
