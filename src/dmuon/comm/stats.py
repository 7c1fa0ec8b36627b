"""Counters for dmuon's own collectives."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class CommStats:
    """Traffic and waiting time of dmuon's collectives on this rank since the last reset."""

    bytes_sent: int = 0
    """Bytes this rank sent to other ranks (its own share excluded)."""
    bytes_received: int = 0
    """Bytes this rank received from other ranks."""
    intra_bytes_sent: int = 0
    """Part of ``bytes_sent`` on the shard (intra-node) level."""
    intra_bytes_received: int = 0
    """Part of ``bytes_received`` on the shard level."""
    inter_bytes_sent: int = 0
    """Part of ``bytes_sent`` on the replicate (inter-node) level; 0 without HSDP."""
    inter_bytes_received: int = 0
    """Part of ``bytes_received`` on the replicate level."""
    collectives: int = 0
    """Number of collectives issued."""
    wait_seconds: float = 0.0
    """Wall time spent blocked on dmuon collectives (communication not hidden by compute)."""
    log: list[tuple[str, int, int]] = field(default_factory=list, repr=False)
    """``(level, sent, received)`` of each collective since the last reset, in issue order
    (not part of :meth:`as_dict`)."""
    last_log: list[tuple[str, int, int]] = field(default_factory=list, repr=False)
    """``log`` as it stood at the last :meth:`reset` (:class:`dmuon.DMuon` resets at the end of
    each ``step()``, so after a step this is that step's collectives, backward's included)."""

    def add(self, level: str, sent: int, received: int) -> None:
        assert level in ("intra", "inter"), level
        self.bytes_sent += sent
        self.bytes_received += received
        setattr(self, f"{level}_bytes_sent", getattr(self, f"{level}_bytes_sent") + sent)
        setattr(self, f"{level}_bytes_received", getattr(self, f"{level}_bytes_received") + received)
        self.collectives += 1
        self.log.append((level, int(sent), int(received)))

    def reset(self) -> None:
        log = self.log
        for f in fields(self):
            if f.name not in ("log", "last_log"):
                setattr(self, f.name, f.default)
        self.log = []
        self.last_log = log

    def as_dict(self) -> dict:
        """The counters (not the logs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("log", "last_log")}
