"""Operation census of one Gram Newton–Schulz call at m = 4096 (on the ``meta`` device).

Pins which matmuls run in which dtype and how many operations one call dispatches, so
a change to either is deliberate. The counts are those of the torch schedule (what
``meta``, CPU without NumPy, and CUDA without Triton run); views (``slice``,
``transpose``, ...) dispatch but launch nothing, and are counted in the total only.
The first call builds the cached triangle masks, so the census is of the second.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon.ortho.gram import gram_newton_schulz

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul"}
# Kernels that write memory (everything else in the census is a view or metadata).
KERNELS = MATMULS | {"copy_", "where", "empty", "mul", "add", "add_", "_to_copy", "linalg_vector_norm",
                     "clamp", "div"}


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.matmuls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in MATMULS:
            dts = tuple(str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor))
            self.matmuls[(name, dts)] += 1
        return func(*args, **(kwargs or {}))


def census(shape, dtype) -> Census:
    G = torch.empty(*shape, device="meta")
    gram_newton_schulz(G, "polar_express", 5, dtype=dtype)
    with Census() as c:
        gram_newton_schulz(G, "polar_express", 5, dtype=dtype)
    return c


# Polar Express, 5 steps: 16-bit output restarts every 3 steps, float32 every 2
# (gram.default_restart_every), hence fewer matmuls for float32. 65 float32 matmuls =
# the block-triangular products (4 per symmetric product) plus the restart Q X; the
# one 16-bit matmul is the final Q X (gram.gram_precision).
EXPECTED = {
    torch.bfloat16: {"total": 454, "kernels": 182, "matmuls": {("float32", "float32"): 65, ("bfloat16", "bfloat16"): 1}},
    torch.float16: {"total": 454, "kernels": 182, "matmuls": {("float32", "float32"): 65, ("float16", "float16"): 1}},
    torch.float32: {"total": 401, "kernels": 161, "matmuls": {("float32", "float32"): 59}},
}


@pytest.mark.parametrize("dtype", list(EXPECTED), ids=str)
def test_census_of_one_call_at_m_4096(dtype):
    c = census((4096, 4096), dtype)
    exp = EXPECTED[dtype]
    assert {dts: n for (name, dts), n in c.matmuls.items()} == exp["matmuls"]
    assert {name for name, _ in c.matmuls} == {"mm"}
    assert sum(c.ops.values()) == exp["total"], dict(c.ops)
    assert sum(n for k, n in c.ops.items() if k in KERNELS) == exp["kernels"], dict(c.ops)
    # One select per mirrored symmetric product, no per-tile copies or tril calls.
    assert "tril" not in c.ops and c.ops["where"] == c.ops["copy_"] // 4


def test_census_of_a_stack_is_batched_not_looped():
    single = census((4096, 4096), torch.bfloat16)
    stack = census((4, 4096, 4096), torch.bfloat16)
    # The same number of (batched) matmuls and kernels as one matrix, not four times as many.
    assert sum(n for (name, _), n in stack.matmuls.items() if name == "bmm") == sum(single.matmuls.values())
    assert {name for name, _ in stack.matmuls} == {"bmm"}
    kernels = lambda c: sum(n for k, n in c.ops.items() if k in KERNELS)  # noqa: E731
    assert kernels(stack) == kernels(single)
