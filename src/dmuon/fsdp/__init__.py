"""FSDP2 integration: the owner runtime and its ZeRO-2/ZeRO-3 hooks."""

from dmuon.fsdp.runtime import OwnerRuntime, full_matrices, full_weights

__all__ = ["OwnerRuntime", "full_matrices", "full_weights"]
