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


# torch.distributed's collectives and point-to-point calls (what another rank must enter too).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
               "scatter_object_list", "reduce"}
# Where a collective may be issued outside comm/: the layers above the library's runtime (the bench and its
# oracles, the test launcher) and two floor modules below comm/ that comm/ cannot serve: the rank-0 broadcast
# the NS autotuner (ortho/, below comm/) shares its choices with, and torch_compat's one function for torch's
# two names of the flat all-gather.
COLLECTIVES_ALLOWED = ("comm/", "bench/", "baselines/", "testing/", "util/rank0.py", "util/torch_compat.py")


def _collective_calls(path: Path) -> list[str]:
    """``dist.X(...)`` or ``torch.distributed.X(...)`` calls of a collective in ``path``, by line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = ast.unparse(node.func.value)
        if node.func.attr in COLLECTIVES and owner in ("dist", "torch.distributed"):
            found.append(f"{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_every_collective_of_the_library_is_issued_from_comm():
    """The runtime, prepare and the optimizer issue their collectives through comm/ (the step's and setup's
    alike), so one package knows every collective dmuon enters and the order the ranks enter them in."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "/tests/" in f"/{rel}" or rel.startswith(COLLECTIVES_ALLOWED):
            continue
        wrong += [f"{rel}:{call}" for call in _collective_calls(path)]
    assert not wrong, "\n".join(wrong)
    # The check sees a collective where one is: comm/ has them.
    assert _collective_calls(ROOT / "comm" / "agree.py")
