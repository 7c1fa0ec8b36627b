"""The host's share of a step: operations dispatched one tensor at a time, and FSDP2's per-unit work.

:mod:`dmuon.costmodel.simulate` prices compute by FLOPs and elementwise work by bytes. Where the
code dispatches per tensor, the host's cost per operation is what bounds it once the tensors are
small: ``torch.optim.AdamW`` over FSDP2's DTensors on CPU runs its per-tensor loop with eight
DTensor operations per parameter (sharding propagation, wrapping and unwrapping on every one),
gather-then-compute runs DTensor operations per matrix (momentum, ``full_tensor()``,
``distribute_tensor``, apply), dmuon's step its local operations per matrix and batch.

This module holds what the simulation needs for that: how many operations each modelled code
path issues (:class:`HostOps`, counted from the code paths, not fitted to any timing: the counts
below are what a ``TorchDispatchMode`` sees, ``src/dmuon/bench/tests/test_host_ops.py`` recounts
them) and how a task's host time and device time combine (:func:`with_host`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OpCount:
    """Operations one piece of work dispatches: on plain tensors and on DTensors."""

    plain: float = 0.0
    """Operations on plain tensors (an ATen op; a kernel launch on a GPU)."""
    dtensor: float = 0.0
    """Operations on DTensors (DTensor's dispatch around the plain op: sharding propagation, wrapping)."""
    layout: float = 0.0
    """DTensor calls that make or change a layout (``full_tensor()``, ``distribute_tensor``): their
    redistribution planning and functional-collective wrapping, beyond the collective itself."""

    def __mul__(self, n: float) -> "OpCount":
        return OpCount(self.plain * n, self.dtensor * n, self.layout * n)

    __rmul__ = __mul__

    def __add__(self, other: "OpCount") -> "OpCount":
        return OpCount(self.plain + other.plain, self.dtensor + other.dtensor, self.layout + other.layout)


@dataclass(frozen=True)
class HostOps:
    """Operations per unit of work of each modelled code path (torch 2.13, this repository).

    Counted with a ``TorchDispatchMode`` that sees each top-level operation once (an operation on
    a DTensor counts once, its local operation inside DTensor's dispatch not again), NS excluded
    (the owners' NS is priced by its own profile or FLOPs, host work included)."""

    adamw_per_tensor: OpCount = OpCount(plain=2, dtensor=8)
    """``torch.optim.AdamW`` on CPU (``_single_tensor_adam``; torch picks foreach on accelerators only),
    per parameter, decoupled weight decay: ``step += 1`` and ``step.item()`` on the plain step tensor;
    ``mul_`` (decay), ``lerp_``, ``mul_``, ``addcmul_`` (moments), ``sqrt``, ``div``, ``add_`` (denominator),
    ``addcdiv_`` (update) on the DTensors."""
    foreach_adamw: OpCount = OpCount(plain=0, dtensor=9)
    """``torch.optim.AdamW`` with foreach (torch picks it on accelerators), per step: its nine foreach
    operations (``_foreach_add_`` of the steps, two ``_foreach_mul_``, ``lerp_``, ``addcmul_``, ``sqrt``,
    ``div_``, ``add_``, ``addcdiv_``), each one dispatch over every parameter."""
    local_foreach_adamw: OpCount = OpCount(plain=9, dtensor=0)
    """The same nine on the local shards: dmuon's AdamW (``rules/adamw.py``), gather-then-compute's too."""
    foreach_adamw_per_tensor: OpCount = OpCount(plain=2, dtensor=0)
    """Either foreach path, per parameter: its step tensor's value read twice (``.item()``)."""
    gather_per_matrix: OpCount = OpCount(plain=13, dtensor=6, layout=2)
    """``GatherThenCompute.step`` per matrix, NS aside: ``lerp_``, ``lerp`` (momentum), ``_to_copy`` (to
    bf16), ``view``, ``mul_``, ``add_`` (apply) on DTensors; ``full_tensor()``'s all-gather, wrap and
    wait, ``unbind``, ``cat``, ``_to_copy``, ``split``, ``clone``, ``detach`` and views on plain tensors;
    the layout calls ``full_tensor()`` and ``distribute_tensor``."""
    dmuon_per_matrix: OpCount = OpCount(plain=37, dtensor=0)
    """dmuon's ``step()`` per Muon matrix on 2 ranks (momentum, checks, pieces in and out of the
    exchange buffers, apply), on local tensors, NS aside: 571 operations with 14 matrices (qwen2
    tiny) and 1087 with 28 (qwen2 mini) on each rank, ZeRO-2 and ZeRO-3 alike (501 and 949 while
    the launch checks read a Python bool per matrix: kept on the device, they take about 5
    operations a matrix more and no wait for it)."""
    dmuon_per_step: OpCount = OpCount(plain=53, dtensor=0)
    """dmuon's ``step()``, the part that does not grow with the matrices (the same two counts; the
    foreach AdamW of the other parameters is in it)."""

    def as_dict(self) -> dict:
        return asdict(self)


def host_seconds(ops: OpCount, dispatch_seconds: float, dtensor_dispatch_seconds: float,
                 layout_seconds: float = 0.0) -> float:
    """Host seconds of ``ops``: each plain operation ``dispatch_seconds``, each DTensor one
    ``dtensor_dispatch_seconds`` (which includes the plain operation under it), each layout call
    ``layout_seconds`` (beyond its operations and collective, which are counted apart)."""
    return ops.plain * dispatch_seconds + ops.dtensor * dtensor_dispatch_seconds + ops.layout * layout_seconds


def with_host(device_seconds: float, host: float, backend: str) -> float:
    """A task's seconds from its device work and its host work.

    On CPU ranks (``"gloo"``) one thread dispatches and computes: the two add up. On accelerators
    (``"nccl"``) the host queues kernels ahead of the device: the task takes the longer of the two
    (a lower bound where the host cannot run ahead, e.g. right after a synchronisation).
    With no host work (every dispatch figure 0) the device seconds are returned as they are.
    """
    if host == 0.0:
        return device_seconds
    return device_seconds + host if backend == "gloo" else max(device_seconds, host)
