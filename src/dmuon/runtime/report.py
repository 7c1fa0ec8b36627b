"""What one step did on this rank: the runtime's return value, replacing per-step state on objects."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepReport:
    """This rank's figures for one ``step()`` and the backward before it."""

    orthogonalized: int = 0
    """Matrices this rank ran the owner's work (NS) for and the step used."""
    bytes_sent: int = 0
    """Bytes of dmuon's own collectives this rank sent (FSDP2's are not counted)."""
    bytes_received: int = 0
    """Bytes of dmuon's own collectives this rank received."""
    intra_bytes_sent: int = 0
    """Part of ``bytes_sent`` on the shard (intra-node) level."""
    intra_bytes_received: int = 0
    """Part of ``bytes_received`` on the shard level."""
    inter_bytes_sent: int = 0
    """Part of ``bytes_sent`` on the replicate (inter-node) level; 0 without HSDP."""
    inter_bytes_received: int = 0
    """Part of ``bytes_received`` on the replicate level."""
    collectives: int = 0
    """dmuon collectives issued (backward's and the step's)."""
    exposed_comm_seconds: float = 0.0
    """Time blocked on dmuon collectives, i.e. communication not hidden behind compute."""
    ns_seconds: float = 0.0
    """The owner's work and the exchange's bookkeeping around it, wherever it ran."""
    blocks_exchanged_in_backward: int = 0
    """Launches from backward that the step kept (their directions stood the check)."""
    orthogonalized_in_backward: int = 0
    """Matrices whose owner work ran on the worker during backward (``ns_in_backward``) and was kept."""
    orthogonalized_while_agreeing: int = 0
    """Matrices whose owner work ran before the step's agreement was known, its flags
    travelling with their return, and was kept."""
    step_seconds: float = 0.0
    """Wall time of ``step()``."""
    skipped_nonfinite: bool = False
    """The whole step was skipped (``nonfinite="skip"`` saw a NaN/Inf)."""
    return_waves: list[list[int]] = field(default_factory=list)
    """The matrices of each pipelined update return, in order."""

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``DMuon.last_step_stats()``)."""
        return asdict(self)
