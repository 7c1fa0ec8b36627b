"""The runtime: the step's schedule over dmuon's collectives; the optimizer supplies the rule.

* :class:`Runtime`: the interface both schedules share (setup, the step's frame and report, the
  owners' batches wave by wave, the applies); :meth:`Runtime.step` runs one step.
* :class:`ShardRuntime`: the FSDP2 schedule: launches from backward, the agreement, the owners'
  batches and return waves.
* :class:`DdpRuntime`: the schedule for torch's DistributedDataParallel (every rank holds the
  whole model and its mean gradient; the owners' updates go to every rank).
* :class:`StepCallbacks`: what an optimizer supplies, and the contract it keeps;
  :class:`RowState`, :class:`Rescalable`, :class:`WeightSums`,
  :class:`StepMaxima` and :class:`CheckedGradients`: what a rule may declare beyond it.
* :class:`ExecutionConfig`: when things run (overlap, NS in backward, return
  waves, non-finite gradients, FSDP2's post-optimizer event).
* :class:`StepReport`: what one step did on this rank.
"""

from dmuon.runtime.launch import Launch
from dmuon.runtime.base import Runtime
from dmuon.runtime.callbacks import (
    CheckedGradients,
    Rescalable,
    RowState,
    StepCallbacks,
    StepMaxima,
    WeightSums,
)
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.ddp import DdpRuntime
from dmuon.runtime.report import StepReport
from dmuon.runtime.runtime import ShardRuntime

__all__ = ["CheckedGradients", "ExecutionConfig", "Launch", "DdpRuntime", "Rescalable", "RowState", "Runtime", "ShardRuntime", "StepCallbacks",
           "StepMaxima", "StepReport", "WeightSums"]
