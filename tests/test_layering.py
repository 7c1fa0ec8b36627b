"""The library's imports flow one way: each layer imports only itself and the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon

# Lowest first (docs/architecture.md, "Layers"). Tests beside a package may import anything.
LAYERS = ["util", "ortho", "rules", "plan", "costmodel", "comm", "runtime", "prepare", "optim", "baselines", "testing", "bench", "cli"]
ROOT = Path(dmuon.__file__).parent


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dmuon" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_imports_flow_downwards():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "tests" in rel.parts or rel.name == "__init__.py" and len(rel.parts) == 1:
            continue
        own = rel.parts[0].removesuffix(".py")
        assert own in LAYERS, f"{rel}: package {own!r} is not in the layer list"
        for module in _imports(path):
            layer = _layer(module)
            if module == "dmuon":
                layer = "optim"  # the package's front door re-exports optim/prepare/plan
            if layer is not None and LAYERS.index(layer) > LAYERS.index(own):
                wrong.append(f"{rel} imports {module}")
    assert not wrong, "imports that run upwards:\n" + "\n".join(wrong)


def _imported_names(path: Path, package: str) -> set[str]:
    """Every dotted name a module imports, ``from a import b`` as both ``a`` and ``a.b``, relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_only_the_bench_uses_the_offline_cost_models():
    """Nothing but ``costmodel/`` itself, ``bench/`` (``dmuon plan``, ``dmuon bench``) and tests imports
    ``dmuon.costmodel``: the runtime and the optimizer never use the offline models."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "tests" in rel.parts or rel.parts[0] in ("costmodel", "bench"):
            continue
        package = ".".join(("dmuon",) + rel.parts[:-1])
        wrong += [f"{rel} imports {name}" for name in sorted(_imported_names(path, package))
                  if name == "dmuon.costmodel" or name.startswith("dmuon.costmodel.")]
    assert not wrong, "the offline cost models imported outside bench/:\n" + "\n".join(wrong)


def test_the_optimizer_reaches_collectives_only_through_the_runtime():
    """optim/ supplies the rule (callbacks) and holds the state; every collective and the step's
    schedule are the runtime's, so optim/ never imports dmuon.comm."""
    wrong = []
    for path in sorted((ROOT / "optim").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "tests" in rel.parts:
            continue
        package = ".".join(("dmuon",) + rel.parts[:-1])
        wrong += [f"{rel} imports {name}" for name in sorted(_imported_names(path, package))
                  if name == "dmuon.comm" or name.startswith("dmuon.comm.")]
    assert not wrong, "\n".join(wrong)
