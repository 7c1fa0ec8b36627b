"""The shard runtime: every dmuon collective and the step's schedule; the optimizer supplies the rule.

* :class:`ShardRuntime`: launches from backward, the agreement, the owners'
  batches and return waves; :meth:`ShardRuntime.step` runs one step.
* :class:`ReplicaRuntime`: the same step for torch's DistributedDataParallel (every rank holds the
  whole model and its mean gradient; the owners' updates are all-gathered).
* :class:`StepCallbacks`: what an optimizer supplies, and the contract it keeps;
  :class:`RowState`, :class:`Rescalable`, :class:`WeightSums`,
  :class:`StepMaxima` and :class:`CheckedGradients`: what a rule may declare beyond it.
* :class:`ExecutionConfig`: when things run (overlap, NS in backward, return
  waves, non-finite gradients, FSDP2's post-optimizer event).
* :class:`StepReport`: what one step did on this rank.
"""

from dmuon.runtime.backward import Launch
from dmuon.runtime.callbacks import (
    CheckedGradients,
    Rescalable,
    RowState,
    StepCallbacks,
    StepMaxima,
    WeightSums,
)
from dmuon.runtime.config import ExecutionConfig
from dmuon.runtime.replicas import ReplicaRuntime
from dmuon.runtime.report import StepReport
from dmuon.runtime.runtime import ShardRuntime

__all__ = ["CheckedGradients", "ExecutionConfig", "Launch", "ReplicaRuntime", "Rescalable", "RowState", "ShardRuntime", "StepCallbacks",
           "StepMaxima", "StepReport", "WeightSums"]
