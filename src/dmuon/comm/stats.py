"""Counters for dmuon's own collectives."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CommStats:
    """Traffic and waiting time of dmuon's collectives on this rank since the last reset."""

    bytes_sent: int = 0
    """Bytes this rank sent to other ranks (its own share excluded)."""
    bytes_received: int = 0
    """Bytes this rank received from other ranks."""
    collectives: int = 0
    """Number of collectives issued."""
    wait_seconds: float = 0.0
    """Wall time spent blocked on dmuon collectives (communication not hidden by compute)."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
