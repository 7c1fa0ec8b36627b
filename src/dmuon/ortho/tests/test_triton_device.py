"""Every Triton launch in dmuon runs under its tensors' CUDA device."""

from __future__ import annotations

import ast
import pathlib

import torch

from dmuon.ortho import triton_syrk

SRC = pathlib.Path(__file__).resolve().parents[2]
GUARDS = {"on_device", "torch.cuda.device"}


def _launches(tree: ast.AST) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Each ``kernel[grid](...)`` call (a subscripted name or attribute, called), with its ancestors."""
    found = []

    def walk(node: ast.AST, parents: list[ast.AST]) -> None:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, (ast.Name, ast.Attribute))):
            found.append((node, parents))
        for child in ast.iter_child_nodes(node):
            walk(child, parents + [node])

    walk(tree, [])
    return found


def _guarded(parents: list[ast.AST]) -> bool:
    """Inside a ``with`` entering ``on_device(<tensor>.device)`` or ``torch.cuda.device(<tensor>.device)``."""
    for node in parents:
        if not isinstance(node, ast.With):
            continue
        for item in node.items:
            call = item.context_expr
            if (isinstance(call, ast.Call) and ast.unparse(call.func) in GUARDS and call.args
                    and isinstance(call.args[0], ast.Attribute) and call.args[0].attr == "device"):
                return True
    return False


def test_every_triton_launch_enters_its_tensors_device():
    """CUDA rule: a Triton kernel launches on the calling thread's current CUDA device, whatever its
    arguments' device. step() and the tuning at build run on the caller's thread, which a script
    with model.to(rank) and no torch.cuda.set_device leaves on cuda:0: every launch site must enter
    the tensors' device first. Found by reading the source: every kernel[grid](...) call in a module
    that uses Triton, and every @triton.jit kernel launched at one of them."""
    sites, kernels = [], set()
    for path in sorted(SRC.rglob("*.py")):
        if "tests" in path.relative_to(SRC).parts:
            continue
        text = path.read_text()
        if "triton" not in text:
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("triton" in ast.unparse(d) for d in node.decorator_list):
                kernels.add(node.name)
        sites += [(path.relative_to(SRC), call, parents) for call, parents in _launches(tree)]
    launched = {ast.unparse(call.func.value) for _, call, _ in sites}
    assert kernels and kernels <= launched, (kernels, launched)
    assert len(sites) >= 2  # the SYRK kernel with a pinned configuration and autotuned
    unguarded = [f"{path}:{call.lineno} {ast.unparse(call.func)}" for path, call, parents in sites
                 if not _guarded(parents)]
    assert unguarded == []


def test_the_guard_enters_a_cuda_tensors_device_and_nothing_for_the_interpreter():
    """CUDA rule: ``torch.cuda.device(d)`` makes d the thread's current device for the launch (the
    interpreter's CPU tensors have none to enter)."""
    guard = triton_syrk.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with triton_syrk.on_device(torch.device("cpu")):
        pass
