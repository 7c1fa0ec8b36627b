"""Bit-for-bit tensor comparison."""

from __future__ import annotations

import torch

_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integer words that tile it (a view, no copy)."""
    flat = t.reshape(-1)
    nbytes, offset = flat.numel() * flat.element_size(), flat.storage_offset() * flat.element_size()
    for word, size in _WORDS:
        if nbytes % size == 0 and offset % size == 0:
            return flat.view(word)
    raise AssertionError("uint8 tiles every tensor")


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bits.

    Stricter than ``torch.equal`` where that is wanted for "the same input gives
    the same result": ``-0.0`` differs from ``0.0``, and a NaN equals the same
    NaN. Compared as 8-byte words where the sizes allow: several times faster
    than ``torch.equal`` on bfloat16 on CPU.
    """
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        a, b = a.contiguous(), b.contiguous()
    wa, wb = _as_words(a), _as_words(b)
    if wa.dtype != wb.dtype:
        wa, wb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return torch.equal(wa, wb)
