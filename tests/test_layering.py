"""The library's imports flow one way: each layer imports only itself and the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon

# Lowest first (docs/architecture.md, "Layers"). Tests beside a package may import anything.
LAYERS = ["util", "ortho", "rules", "plan", "comm", "runtime", "prepare", "optim", "baselines", "bench", "cli"]
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


def test_the_optimizer_reaches_collectives_only_through_the_runtime():
    """optim/ supplies the rule (callbacks) and holds the state; every collective and the step's
    schedule are the runtime's, so optim/ never imports dmuon.comm."""
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sorted((ROOT / "optim").rglob("*.py")) if "tests" not in path.parts
             for module in _imports(path) if module == "dmuon.comm" or module.startswith("dmuon.comm.")]
    assert not wrong, "\n".join(wrong)
