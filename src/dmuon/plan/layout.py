"""How FSDP2 lays a matrix's rows over the shard positions (``Shard(0)``, torch.chunk's rule)."""

from __future__ import annotations


def shard_rows(m: int, shard: int) -> list[int]:
    """Rows of an ``m``-row matrix on each of ``shard`` columns, by ``torch.chunk``'s rule.

    FSDP2's ``Shard(0)`` gives every column ``ceil(m / shard)`` rows until the
    rows run out, so trailing columns may hold fewer rows, or none.
    """
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    if m < 0:
        raise ValueError(f"rows must be >= 0, got {m}")
    chunk = -(-m // shard)
    return [max(0, min(m, (s + 1) * chunk) - s * chunk) for s in range(shard)]
