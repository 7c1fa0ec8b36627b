"""The step's one agreement: every rank takes the same collective path.

Which matrices have a gradient, whether a gradient is non-finite (with
``nonfinite=``), and which launches from backward went stale are settled from
the maximum over every rank of a few 0/1 flags, before any collective that
depends on them. Nothing here communicates: the runtime all-reduces the
flags, or, on the speculative step, sends them with its update return (that
return is the one collective depending on them, and its rows are used only if
the flags, landed with them, keep them).

The same maximum also agrees the rule's **step maxima** (QK-clip's per-head
attention logit maxima, :meth:`~dmuon.runtime.callbacks.StepMaxima.step_maxima`)
at no collective of their own: each value rides as the int32 bit pattern of a
float32. Non-negative float32 values order like their bit patterns read as
integers (+inf above every finite one), so the integer maximum is the float
maximum, exactly; NaN and negative values are sent as 0, so that a NaN on one
rank cannot win over another rank's value (a NaN's bit pattern is above +inf's)
and a negative's (sign bit set) cannot be read as a huge one.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import torch

from dmuon.plan.plan import MatrixInfo
from dmuon.util.bits import any_bits_differ, bits_differ, bitwise_equal
from dmuon.util.dtensor import local_tensor


class Agreement(NamedTuple):
    """What every rank settled on."""

    active: list[int]
    """Matrices with a gradient (on every rank), plan order."""
    skipped: bool
    """The whole step is skipped (``nonfinite="skip"`` saw a NaN/Inf)."""
    stale: list[int]
    """Per launch from backward (block order): 1 where some rank's directions differ from those sent."""
    rescaled: list[int] = []
    """Per launch (block order): 1 where it stands for its gradients scaled by :attr:`scale` since it
    was sent (clipping; the owners form the directions), 0 where it stands as sent or is stale."""
    scale: float | None = None
    """The one factor every rescaled launch's gradients were scaled by (:func:`uniform_scale`)."""
    maxima: torch.Tensor = torch.zeros(0)
    """The rule's step maxima (float32, CPU): per value the maximum over every rank (NaN and negative
    values counted as 0); empty when the rule has none."""


def agreement_flags(infos: Sequence[MatrixInfo], column: int, managed: Sequence[int], here: Sequence[int],
                    nonfinite: str | None, checked: Sequence[tuple[str, torch.Tensor | None]],
                    stale: torch.Tensor | None, maxima: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, "FlagLayout"]:
    """This rank's flags, and how their maximum over every rank (however that travelled) reads.

    Args:
        infos: The plan's matrices.
        column: This rank's shard position (which piece of each matrix it holds).
        managed: The matrices the optimizer steps (the same on every rank).
        here: Those with a gradient on this rank.
        nonfinite: ``None``, ``"skip"`` or ``"raise"``.
        checked: With ``nonfinite``, the other gradients to check (name, local gradient or None).
        stale: Per launch, 1 where this rank's directions differ from those sent (None: no launches).
        maxima: The rule's step maxima on this rank (float32 values, the same count on every rank,
            on any device; None: none). They go last, as bit patterns (:func:`maxima_bits`), and
            the flags are then on their device.

    Returns:
        The flags (int32, laid out as :class:`FlagLayout` says), and their layout, whose
        :meth:`FlagLayout.decide` reads their elementwise maximum over every rank identically on
        every rank.
    """
    n = len(infos)
    check = nonfinite is not None
    count = n + len(checked) if check else 0
    stale = torch.zeros(0, dtype=torch.int32) if stale is None else stale
    # Built as a list: element-wise writes into a tensor cost microseconds each.
    values = [0] * (2 * n)
    for i in managed:
        values[n + i] = 1  # "some rank lacks it": FSDP2 gives every rank a shard or none
    for i in here:
        values[i], values[n + i] = 1, 0
    parts = [stale.to(torch.int32)]
    if check:
        # Found on the gradients' device and never read here (a read per gradient would wait for it).
        found: dict[int, torch.Tensor] = {}
        for i in here:
            part = infos[i].local_view(local_tensor(infos[i].param.grad), column)
            found[i] = torch.isfinite(part).all().logical_not()
        for k, (_, grad) in enumerate(checked):
            if grad is not None:
                found[n + k] = torch.isfinite(local_tensor(grad)).all().logical_not()
        marks = torch.zeros(count, dtype=torch.int32)
        if found:
            device = next(iter(found.values())).device
            clean = torch.zeros((), dtype=torch.bool, device=device)
            marks = torch.stack([found.get(p, clean).to(device) for p in range(count)]).int()
        parts.insert(0, marks)
    # The host's flags beside the others, on their device (which no one reads before the agreement lands).
    device = next((t.device for t in parts if t.numel()), stale.device)
    flags = torch.cat([host_to_device(torch.tensor(values, dtype=torch.int32), device),
                       *(host_to_device(t, device) if t.device.type == "cpu" else t.to(device) for t in parts)])
    extra = 0 if maxima is None else maxima.numel()
    if extra:
        # Beside the values, on their device: reading them to the host here would wait for the device.
        flags = torch.cat([flags.to(maxima.device), maxima_bits(maxima)])
    return flags, FlagLayout(infos, managed, nonfinite, [name for name, _ in checked], extra)


def pins_host_copies(device: torch.device | str) -> bool:
    """Whether a host tensor bound for ``device`` goes through pinned memory: on an accelerator a pageable
    host-to-device copy is synchronous (the host waits for the device's queue to take it, every step); a
    pinned one with ``non_blocking`` is queued and the host goes on. On the CPU there is nothing to copy."""
    return torch.device(device).type not in ("cpu", "meta")


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: as it is on the CPU, else through pinned memory, non-blocking
    (torch's pinned allocator keeps the staging block until the copy has run, so it may be dropped at once)."""
    if not pins_host_copies(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def maxima_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bit patterns whose integer maximum is their float maximum: NaN and
    negative values (and -0.0) become 0 first (see the module docstring)."""
    values = values.detach().to(torch.float32).reshape(-1)
    return torch.where(values > 0, values, 0.0).contiguous().view(torch.int32)


class FlagLayout:
    """Where each flag of :func:`agreement_flags` lies, and what their maximum over every rank decides.

    The only reader of the layout, in order: ``n`` "has a gradient" flags, one per matrix; ``n`` "some
    rank lacks it" flags; with ``nonfinite``, one "non-finite" mark per matrix and one per checked
    gradient (:attr:`marks`); the launches' verdicts (whatever the caller appended: handed back as
    :attr:`Agreement.stale`); the rule's step maxima as bit patterns (:attr:`extra` of them, last).
    """

    def __init__(self, infos: Sequence[MatrixInfo], managed: Sequence[int], nonfinite: str | None,
                 checked_names: list[str], extra: int) -> None:
        self.infos, self.managed, self.nonfinite = infos, managed, nonfinite
        self.checked_names = checked_names
        self.marks = len(infos) + len(checked_names) if nonfinite is not None else 0
        """How many non-finite marks follow the two halves (none without ``nonfinite``)."""
        self.extra = extra
        """How many step maxima end the flags."""

    def nonfinite_seen(self, flags: Sequence[int]) -> bool:
        """Whether the agreed flags mark a non-finite gradient on some rank (before anything is decided)."""
        n = len(self.infos)
        return any(flags[2 * n : 2 * n + self.marks])

    def decide(self, flags: list[int]) -> Agreement:
        """The agreement from the flags' maximum over every rank.

        Raises ``RuntimeError`` for a matrix with a gradient on some ranks only, and
        ``FloatingPointError`` with ``nonfinite="raise"`` for a non-finite gradient on any rank.
        """
        infos, extra, count = self.infos, self.extra, self.marks
        maxima = torch.tensor(flags[len(flags) - extra:], dtype=torch.int32).view(torch.float32)
        flags = flags[: len(flags) - extra]
        n = len(infos)
        uneven = [infos[i].name for i in range(n) if flags[i] and flags[n + i]]
        if uneven:
            raise RuntimeError(f"gradients of {uneven[:5]} exist on some ranks only; FSDP2 reduces a block's "
                               "gradients on every rank or on none")
        active = [i for i in sorted(self.managed) if flags[i]]
        agreed_stale = flags[2 * n + count:]
        unscaled = [0] * len(agreed_stale)
        if self.nonfinite is None or not any(flags[2 * n : 2 * n + count]):
            return Agreement(active, False, agreed_stale, unscaled, maxima=maxima)
        if self.nonfinite == "raise":
            names = [infos[i].name for i in range(n) if flags[2 * n + i]]
            names += [self.checked_names[k] for k in range(len(self.checked_names)) if flags[3 * n + k]]
            raise FloatingPointError(f"non-finite gradients in {names}")
        return Agreement(active, True, agreed_stale, unscaled, maxima=maxima)


NONUNIFORM = "nonuniform"
"""A rank's gradients changed since the launches, but not by one factor."""

SCALE_FLAGS = 10
"""Flags :func:`scale_flags` adds: proposed, non-uniform, the factor's 4 bytes and their complements."""


def uniform_scale(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float | str | None:
    """The one float32 factor ``c`` with ``now == fl(launched * c)``, bit for bit, for every pair
    (this rank's gradient parts as launched and as they are now), as ``clip_grad_norm_``'s
    ``mul_`` by its coefficient leaves them.

    Returns:
        ``1.0`` if nothing changed (and something is nonzero), the factor, ``None`` when every
        launched part is zero (any factor fits), or :data:`NONUNIFORM`.
    """
    changed = [(g0, g1) for g0, g1 in pairs if not bitwise_equal(g0, g1)]
    if not changed:
        return 1.0 if any(g0.numel() and bool(g0.ne(0).any()) for g0, _ in pairs) else None
    g0, g1 = changed[0]
    flat0, flat1 = g0.reshape(-1).float(), g1.reshape(-1).float()
    j = int(flat0.abs().argmax())
    if not flat0[j] or not torch.isfinite(flat0[j]):
        return NONUNIFORM
    guess = (flat1[j] / flat0[j]).reshape(1)
    for c in (guess, torch.nextafter(guess, guess + 1), torch.nextafter(guess, guess - 1)):
        if bool(torch.isfinite(c)) and all(bitwise_equal(a * c.to(a.dtype), b) for a, b in pairs):
            return float(c)
    return NONUNIFORM


def uniform_scales(launches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> list[float | str | None]:
    """:func:`uniform_scale` of each launch's pairs, computed on their device with at most two reads
    to the host in all (the plain version reads once or more per pair: on an accelerator each read
    waits for the device).

    First every pair's "bits changed" and "not all zero", read together; then, for the launches with
    a change (a clip), each one's candidate factors (the first changed pair's largest element's
    ratio and its two float32 neighbours, as :func:`uniform_scale` tries them) and whether each
    reproduces every pair, read together. Pairs whose shape, dtype or device differ are decided on
    the host, empty pairs never change.
    """
    out: list[float | str | None] = [None] * len(launches)
    listed: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    for k, pairs in enumerate(launches):
        if any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in pairs):
            out[k] = NONUNIFORM  # no factor gives b's metadata from a's
            continue
        pairs = [(a, b) for a, b in pairs if a.numel()]
        if pairs:
            listed.append((k, pairs))
    if not listed:
        return out
    # Every pair's device is the launch's (its gradient parts and their copies live together).
    seen = torch.stack([torch.stack([bits_differ(a, b), a.ne(0).any()])
                        for _, pairs in listed for a, b in pairs]).tolist()
    changed: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]], int]] = []
    at = 0
    for k, pairs in listed:
        flags, at = seen[at:at + len(pairs)], at + len(pairs)
        first = next((p for p, (differs, _) in enumerate(flags) if differs), None)
        if first is None:
            out[k] = 1.0 if any(nonzero for _, nonzero in flags) else None
        else:
            changed.append((k, pairs, first))
    if not changed:
        return out
    tried = torch.stack([_candidates(pairs, first) for _, pairs, first in changed]).tolist()
    for (k, _, _), row in zip(changed, tried):
        found = next((c for c, ok in zip(row[:3], row[3:]) if ok), None)
        out[k] = NONUNIFORM if found is None else found
    return out


def _candidates(pairs: list[tuple[torch.Tensor, torch.Tensor]], first: int) -> torch.Tensor:
    """float32 ``[c0, c1, c2, ok0, ok1, ok2]``: :func:`uniform_scale`'s three candidate factors from
    changed pair ``first``, and 1 where a candidate is finite and reproduces every pair bit for bit
    (all 0 when that pair's largest element is zero or not finite: no factor is recognised)."""
    flat0, flat1 = (t.reshape(-1).float() for t in pairs[first])
    j = flat0.abs().argmax().reshape(1)
    v0, v1 = flat0.index_select(0, j)[0], flat1.index_select(0, j)[0]
    guess = v1 / v0
    candidates = torch.stack([guess, torch.nextafter(guess, guess + 1), torch.nextafter(guess, guess - 1)])
    usable = (v0 != 0) & torch.isfinite(v0)
    ok = torch.stack([usable & torch.isfinite(c) & ~any_bits_differ([(a * c.to(a.dtype), b) for a, b in pairs], c.device)
                      for c in candidates])
    return torch.cat([candidates, ok.float()])


def scale_flags(proposal: float | str | None) -> list[int]:
    """This rank's :data:`SCALE_FLAGS` flags for its :func:`uniform_scale`: integers 0-255, exact in every
    wire dtype, whose maxima over the ranks tell whether every rank proposed the same factor (each byte's
    maximum, and its complement's, give the byte's maximum and minimum)."""
    if proposal is None:
        return [0] * SCALE_FLAGS
    if proposal == NONUNIFORM:
        return [1, 1] + [0] * 8
    raw = struct.pack("<f", proposal)
    return [1, 0, *raw, *(255 - b for b in raw)]


def agreed_scale(flags: Sequence[int]) -> float | str | None:
    """From the maxima of every rank's :func:`scale_flags`: the factor every proposing rank gave,
    ``None`` when none proposed one, or :data:`NONUNIFORM` (a rank saw a non-uniform change, or
    two ranks proposed different factors)."""
    proposed, nonuniform, high, complement = flags[0], flags[1], flags[2:6], flags[6:10]
    if not proposed:
        return None
    if nonuniform or any(h != 255 - c for h, c in zip(high, complement)):
        return NONUNIFORM
    return struct.unpack("<f", bytes(int(b) for b in high))[0]
