"""Compute once on rank 0 of a process group and hand every rank the same result."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_distributed(group) -> bool:
    """Whether ``group`` spans more than one rank of an initialised process group."""
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def broadcast_from_rank0(fn: Callable[[], T], group, what: str) -> T:
    """``fn()`` run on rank 0 of ``group`` and broadcast, so every rank returns rank 0's result.

    Without a group of more than one rank (:func:`is_distributed`) ``fn`` just
    runs here. Call it on every rank of ``group``; only rank 0 calls ``fn``.

    Raises:
        RuntimeError: On every rank, ``"{what} failed on rank 0 of the group: ..."``
            naming the exception, if ``fn`` raised on rank 0 (so the others do not
            wait forever).
    """
    if not is_distributed(group):
        return fn()
    payload: list[object] = [None]
    if dist.get_rank(group) == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - the other ranks must not wait forever
            payload[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    kind, value = payload[0]  # type: ignore[misc]
    if kind != "ok":
        raise RuntimeError(f"{what} failed on rank 0 of the group: {value}")
    return value  # type: ignore[return-value]
