"""Bit-for-bit tensor comparison: as a Python bool (:func:`bitwise_equal`), or as a tensor on the
device that the host need not read (:func:`bits_differ`, :func:`any_bits_differ`)."""

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


def _word_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both tensors' bytes as the same integer words, or None when their shape, dtype or device differ."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return None
    if not (a.is_contiguous() and b.is_contiguous()):
        a, b = a.contiguous(), b.contiguous()
    wa, wb = _as_words(a), _as_words(b)
    if wa.dtype != wb.dtype:
        wa, wb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return wa, wb


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bits.

    Stricter than ``torch.equal`` where that is wanted for "the same input gives
    the same result": ``-0.0`` differs from ``0.0``, and a NaN equals the same
    NaN. Compared as 8-byte words where the sizes allow: several times faster
    than ``torch.equal`` on bfloat16 on CPU.
    """
    words = _word_views(a, b)
    return words is not None and torch.equal(*words)


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``not bitwise_equal(a, b)`` as a 0-d bool tensor on ``a``'s device.

    Nothing is read to the host: on an accelerator each ``torch.equal`` (a Python bool) waits for
    the device to finish everything queued before it, and the runtime compares every matrix each
    step, so its comparisons stay on the device and travel with the step's agreement.
    """
    words = _word_views(a, b)
    if words is None:
        return torch.ones((), dtype=torch.bool, device=a.device)
    wa, wb = words
    return wa.ne(wb).any()


def any_bits_differ(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str) -> torch.Tensor:
    """Whether any pair's bits differ (:func:`bits_differ`), a 0-d bool tensor on ``device``
    (False for no pairs)."""
    if not pairs:
        return torch.zeros((), dtype=torch.bool, device=device)
    device = torch.device(device)
    flags = [bits_differ(a, b) for a, b in pairs]
    return torch.stack([f if f.device == device else f.to(device) for f in flags]).any()
