"""What one step did on this rank: the runtime's return value, replacing per-step state on objects."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dmuon.comm.stats import CommStats
from dmuon.comm.streams import Interval


@dataclass
class StepReport:
    """This rank's figures for one ``step()`` and the backward before it."""

    orthogonalized: int = 0
    """Matrices this rank ran the owner's work (NS) for and the step used."""
    traffic: CommStats = field(default_factory=CommStats)
    """dmuon's own collectives on this rank, backward's and the step's (FSDP2's are not counted):
    bytes sent and received by level, how many, and the time blocked on them."""
    ns_seconds: float = 0.0
    """Host seconds of the owner's work and the exchange's bookkeeping around it, wherever it ran (on
    CUDA the host only enqueues: :attr:`ns_device_seconds` is the device's)."""
    blocks_exchanged_in_backward: int = 0
    """Launches from backward that the step kept (their directions stood the check)."""
    orthogonalized_in_backward: int = 0
    """Matrices whose owner work ran on the worker during backward (``ns_in_backward``) and was kept."""
    blocks_returned_in_backward: int = 0
    """Kept launches whose updates came back during backward (``returns_in_backward``): the step
    only applied them."""
    orthogonalized_while_agreeing: int = 0
    """Matrices whose owner work ran before the step's agreement was known, its flags
    travelling with their return, and was kept."""
    step_seconds: float = 0.0
    """Wall time of ``step()``."""
    rescaled_launches: int = 0
    """Launches kept that stood for gradients scaled by one factor since they were sent (clipping):
    the owners formed their directions from the launched ones (``ExecutionConfig.clipped_overlap``)."""
    skipped_nonfinite: bool = False
    """The whole step was skipped (``nonfinite="skip"`` saw a NaN/Inf)."""
    return_waves: list[list[int]] = field(default_factory=list)
    """The matrices of each pipelined update return, in order."""
    ns_spans: list[Interval] = field(default_factory=list, repr=False)
    """The spans :attr:`ns_seconds` adds up (:class:`dmuon.comm.streams.Interval`)."""

    @property
    def ns_device_seconds(self) -> float:
        """:attr:`ns_seconds` as the device measured it (CUDA events on the streams the work ran on;
        on CPU the host's): reading it waits for that work, so read it after the step."""
        return sum(span.device_seconds for span in self.ns_spans)

    def as_dict(self) -> dict[str, Any]:
        """The fields as one flat dict (``DMuon.last_step_stats()``): the traffic counters inline,
        their ``wait_seconds`` as ``exposed_comm_seconds`` (communication not hidden by compute)."""
        # Not ns_device_seconds: reading it waits for the device, and a dict of figures is read every step.
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("traffic", "ns_spans")}
        counters = self.traffic.as_dict()
        out["exposed_comm_seconds"] = counters.pop("wait_seconds")
        out.update(counters)
        out["return_waves"] = [list(w) for w in self.return_waves]
        return out
