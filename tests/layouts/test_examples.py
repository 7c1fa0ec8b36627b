"""The examples of the README and docs/guides, run on gloo CPU ranks against one process.

* The README's quick start is examples/quickstart.py's core, line for line, and ``python
  examples/quickstart.py`` prints the losses one process with torch.optim.Muon + AdamW gives.
* Every guide's example (examples/fsdp2.py, hsdp.py, ddp.py, tp.py, pipeline.py, experts.py) trains 3 steps on
  the same 4 ranks (one process group for all, so the suite pays one start) with an fp32 NS, and ends with the
  parameters of one process running torch.optim.Muon (fp32 NS; each expert of a stack its own matrix) + AdamW
  on the global batch.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import dmuon

from support.reference import ns_precision, reference_training
from support.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _example(name: str) -> ModuleType:
    """examples/<name>.py, loaded by path (on sys.path its name could be another module's): the quick start as
    ``quickstart``, the name the other examples import it by, the others under ``dmuon_examples.``."""
    key = name if name == "quickstart" else f"dmuon_examples.{name}"
    path = EXAMPLES / f"{name}.py"
    if getattr(sys.modules.get(key), "__file__", None) != str(path):
        if name != "quickstart":
            _example("quickstart")
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


quickstart = _example("quickstart")

WORLD = 4
STEPS = 3
LR, ADAMW_LR = 0.02, 3e-3

# example -> (the keywords of its train(), the data-parallel ranks whose batches make the global batch,
# the clipping norm)
RUNS = {
    "fsdp2": ("fsdp2", {}, WORLD, 1.0),
    "hsdp, dmuon's replicate level": ("hsdp", {"kind": "dmuon"}, WORLD, 1.0),
    "hsdp, FSDP2's own": ("hsdp", {"kind": "fsdp2"}, WORLD, 1.0),
    "ddp, torch's DDP": ("ddp", {"kind": "ddp"}, WORLD, None),
    "ddp, DDP with dmuon": ("ddp", {"kind": "route"}, WORLD, None),
    "tp": ("tp", {}, WORLD // 2, None),
    "pipeline": ("pipeline", {}, WORLD // 2, 1.0),
    "experts": ("experts", {}, WORLD, 1.0),
}


def _quick_start_in_readme() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _quick_start_in_file() -> str:
    text = (EXAMPLES / "quickstart.py").read_text()
    return text.split("# --- quick start ---\n", 1)[1].split("# --- end of the quick start ---\n", 1)[0]


def test_readme_quick_start_is_the_example():
    assert _quick_start_in_readme() == _quick_start_in_file()


def _experts_reference(clip: float) -> dict[str, torch.Tensor]:
    """One process: examples/experts.py's model (seed 0, every expert here) on every rank's batch at once,
    torch.optim.Muon on the router matrices and on each expert's ``(m, n)`` slice of a stack, AdamW on the rest."""
    torch.manual_seed(0)
    model = _example("experts").MoELM()
    named = dict(model.named_parameters())
    matrices = [n for n in named if ".router." in n or ".experts." in n]
    slices = [(named[n], e) for n in matrices if named[n].ndim == 3 for e in range(named[n].shape[0])]
    views = [nn.Parameter(p.data[e]) for p, e in slices] + [named[n] for n in matrices if named[n].ndim == 2]
    muon = torch.optim.Muon(views, lr=LR)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=ADAMW_LR)
    for step in range(STEPS):
        quickstart.loss_of(model, torch.cat([quickstart.batch(step, r) for r in range(WORLD)])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for view, (p, e) in zip(views, slices):
            view.grad = p.grad[e]
        with ns_precision(torch.float32):
            muon.step()
        adamw.step()
        model.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in named.items()}


@functools.lru_cache(maxsize=None)  # several examples share a reference (the same data and clipping)
def _reference(dp: int, clip: float | None, ns_dtype: torch.dtype, steps: int = STEPS, watch: int | None = None):
    """One process: the quick start's model (seed 0) on every data-parallel rank's batch at once;
    ``watch``: also the loss of that rank's batch before each step (what the quick start prints)."""
    torch.manual_seed(0)
    model = quickstart.TinyLM()
    watched = []

    def loss_fn(m, tokens):
        if watch is not None:
            with torch.no_grad():
                watched.append(quickstart.loss_of(m, tokens[4 * watch:4 * watch + 4]).item())
        return quickstart.loss_of(m, tokens)

    batches = [torch.cat([quickstart.batch(step, r) for r in range(dp)]) for step in range(steps)]
    params, _ = reference_training(model, batches, loss_fn, muon_kwargs=dict(lr=LR),
                                   adamw_kwargs=dict(lr=ADAMW_LR), ns_dtype=ns_dtype, clip=clip)
    return params, watched


def test_quick_start_runs_and_matches_one_process():
    """``python examples/quickstart.py`` as a user runs it: 2 ranks, bf16 NS (the default). Its printed
    losses (rank 0's batch) against one process with torch.optim.Muon's own bf16 NS: the first equal (the
    same initial weights), the later ones within what bf16 NS rounding moves them (1.4e-4 measured at step 4,
    which ``NSConfig(method="auto")`` may run another way on another machine: 2e-3 allowed, against losses that
    move by 0.01-0.26 a step)."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    printed = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", run.stdout, re.M)]
    _, expected = _reference(2, None, torch.bfloat16, steps=5, watch=0)
    assert len(printed) == 5
    assert printed[0] == pytest.approx(expected[0], abs=2e-6)
    assert printed == pytest.approx(expected, abs=2e-3)


def _run_examples(rank: int, world_size: int) -> dict:
    ns = dmuon.NSConfig(dtype=torch.float32, method="standard")
    return {name: _example(module).train(rank, world_size, steps=STEPS, ns=ns, **kwargs)
            for name, (module, kwargs, _, _) in RUNS.items()}


@pytest.fixture(scope="module")
def example_runs() -> list[dict]:
    return run_distributed(_run_examples, WORLD)


@pytest.mark.parametrize("name", list(RUNS))
def test_example_matches_one_process(example_runs, name):
    _, _, dp, clip = RUNS[name]
    expected = _experts_reference(clip) if name == "experts" else _reference(dp, clip, torch.float32)[0]
    got = {}
    for ranks in example_runs:        # a pipeline rank holds its stage's parameters only
        got.update(ranks[name])
    assert sorted(got) == sorted(expected)
    for param, value in expected.items():
        torch.testing.assert_close(got[param], value, atol=1e-5, rtol=0, msg=f"{name}: {param}")
